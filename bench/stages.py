#!/usr/bin/env python3
"""Where a metered request's time goes at one connection, from Kiln's own stage histograms.

Starts the fake upstream (bench/fake_openai.py) and Kiln metered on the benchmark's database
(bench/kiln_target.py), runs wrk at one connection, then reads Kiln's ``/metrics``: the mean
seconds per request of admission (``kiln_admission_seconds``), of the backend call
(``kiln_upstream_latency_seconds``) and of settlement (``kiln_settlement_seconds``, per durable
batch; at one connection a batch is one request), set against wrk's mean latency. The same
runs with metering off (``KILN_METERING=false``) and with the answer held until its settlement
commits (``KILN_SETTLE_BEFORE_ANSWER=true``; by default it leaves first, docs/METERING.md),
which shows what settling on the client's clock costs, and with the request sent to the backend
while it is admitted (``KILN_EARLY_SEND=true``, docs/METERING.md). Each mode also runs at 64
connections, where throughput is bounded by the machine's cores: the CPU milliseconds per
request of Kiln's
workers and of Postgres (from /proc) show which one spends them. Prints one table; compare
within a run.

    python bench/stages.py [--seconds 10] [--rounds 2]

Needs Postgres at 127.0.0.1:5432 (trust, user postgres) and wrk.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kiln_target as kt  # noqa: E402
import procstat as ps  # noqa: E402
import scenarios as sc  # noqa: E402
import targets as tg  # noqa: E402

STAGES = {"admission": "kiln_admission_seconds", "backend call": "kiln_upstream_latency_seconds",
          "settlement (durable commit)": "kiln_settlement_seconds"}


def measure(kiln: kt.KilnBench, mode: str, seconds: int) -> dict:
    """Start Kiln in ``mode`` (metered, settle-first, early-send, nometer), run wrk at one
    connection, read it."""
    kiln.env["KILN_SETTLE_BEFORE_ANSWER"] = "true" if mode == "settle-first" else "false"
    kiln.env["KILN_EARLY_SEND"] = "true" if mode == "early-send" else "false"
    target = kiln.start(metering=mode != "nometer")
    try:
        sc.wrk_run(target, 1, 2)  # warm up, then start the histograms from here
        before = _metrics(target)
        result = sc.wrk_run(target, 1, seconds)
        after = _metrics(target)
        busy = _cpu_run(target, 64, seconds)
    finally:
        target.stop()
    out = {"wrk mean ms": 1000 / result["rps"], "p50 ms": result["p50_ms"]}
    for label, name in STAGES.items():
        out[label] = _delta_mean_ms(before, after, name)
    out.update(busy)
    return out


def _cpu_run(target: tg.Target, conns: int, seconds: int) -> dict:
    """Run wrk at ``conns``; return req/s and the CPU ms per request of Kiln and Postgres."""
    sc.wrk_run(target, conns, 2)
    kiln_pids = ps.process_tree(target.pids)
    pg_pids = ps.pids_named("postgres")
    k0, p0 = ps.cpu_seconds(kiln_pids), ps.cpu_seconds(pg_pids)
    result = sc.wrk_run(target, conns, seconds)
    k1, p1 = ps.cpu_seconds(kiln_pids), ps.cpu_seconds(ps.pids_named("postgres"))
    n = result["rps"] * seconds
    return {f"req/s at {conns} conns": result["rps"],
            f"Kiln CPU ms/request at {conns}": (k1 - k0) * 1000 / n,
            f"Postgres CPU ms/request at {conns}": (p1 - p0) * 1000 / n}


def _metrics(target: tg.Target) -> str:
    base = target.base_url.removesuffix("/v1")
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        return resp.read().decode()


def _delta_mean_ms(before: str, after: str, name: str) -> float | None:
    def sums(text, suffix):
        pattern = rf"^{name}_{suffix}(?:{{[^}}]*}})? ([0-9.e+-]+)$"
        return sum(float(v) for v in re.findall(pattern, text, flags=re.MULTILINE))
    count = sums(after, "count") - sums(before, "count")
    return (sums(after, "sum") - sums(before, "sum")) / count * 1000 if count else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kiln-stages-"))
    upstream, upstream_svc = tg.start_upstream(workdir)
    try:
        kiln = kt.KilnBench(upstream.base_url, workdir, sc.ORGS_CONNS)
        kiln.provision()
        runs = {mode: [] for mode in ("nometer", "metered", "settle-first", "early-send")}
        for _ in range(args.rounds):  # interleaved: the modes of one round are seconds apart
            for mode in runs:
                runs[mode].append(measure(kiln, mode, args.seconds))
    finally:
        upstream_svc.stop()
    rows = list(runs["metered"][0])
    print(f"| median of {args.rounds} rounds, wrk 1 conn, {args.seconds} s | "
          + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    for row in rows:
        cells = []
        for mode in runs:
            values = [r[row] for r in runs[mode] if r[row] is not None]
            cells.append(f"{statistics.median(values):.2f}" if values else "—")
        print(f"| {row} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
