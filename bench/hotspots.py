#!/usr/bin/env python3
"""Where the gateway workers' CPU goes under load: Kiln metered and unmetered beside the
stack's floor.

Starts the fake upstream, then each target in turn (Kiln metered, Kiln with
``KILN_METERING=false``, and bench/floor_app.py: a bare Flask relay on the same gunicorn gevent
workers), drives it with
wrk at 64 connections, and samples every worker with py-spy meanwhile. Prints, per target,
requests/s and the share of the workers' samples by where their time is spent (the package or
Kiln module at the top of each stack), so that the difference between the two says what
Kiln's own path costs beyond the floor. Compare shares within one run.

    pip install py-spy          # not among Kiln's dependencies
    python bench/hotspots.py [--seconds 10] [--top 12]

Needs Postgres at 127.0.0.1:5432 (Kiln's benchmark database, bench/kiln_target.py) and wrk.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kiln_target as kt  # noqa: E402
import scenarios as sc  # noqa: E402
import targets as tg  # noqa: E402


def where(frame: str) -> str:
    """Name the code a py-spy frame (``function (path:line)``) belongs to: a Kiln module, or
    the top-level package (or standard-library module) of its path."""
    path = frame.rsplit("(", 1)[-1].rsplit(":", 1)[0]
    path = path.split("site-packages/", 1)[-1]
    if path.startswith("gateway/") or "/gateway/" in path:
        return "gateway/" + path.split("gateway/", 1)[1]
    return path.split("/", 1)[0].removesuffix(".py")


def sample(pid: int, seconds: int, out: Path) -> None:
    subprocess.run(["py-spy", "record", "--pid", str(pid), "--duration", str(seconds),
                    "--format", "raw", "--output", str(out), "--nonblocking", "--rate", "200"],
                   capture_output=True, check=False)


def workers(master_pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(master_pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def profile(target: tg.Target, seconds: int, workdir: Path) -> tuple[float, collections.Counter]:
    """Run wrk on ``target`` while py-spy samples its workers; return (req/s, self samples)."""
    sc.wrk_run(target, 64, 2)  # warm up
    pids = workers(target.pids[0])
    files = [workdir / f"{target.name}-{pid}.txt" for pid in pids]
    threads = [threading.Thread(target=sample, args=(pid, seconds, f))
               for pid, f in zip(pids, files, strict=True)]
    for t in threads:
        t.start()
    result = sc.wrk_run(target, 64, seconds)
    for t in threads:
        t.join()
    counts = collections.Counter()
    for f in files:
        for line in f.read_text().splitlines() if f.exists() else ():
            stack, _, n = line.rpartition(" ")
            counts[where(stack.split(";")[-1])] += int(n)
    return result["rps"], counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=int, default=10)
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    if not shutil.which("py-spy"):
        sys.exit("bench/hotspots.py needs py-spy: pip install py-spy")
    workdir = Path(tempfile.mkdtemp(prefix="kiln-hotspots-"))
    upstream, upstream_svc = tg.start_upstream(workdir)
    results = {}
    try:
        kiln = kt.KilnBench(upstream.base_url, workdir, sc.ORGS_CONNS)
        kiln.provision()
        gunicorn = Path(sys.executable).parent / "gunicorn"
        for name, start in (("kiln", lambda: kiln.start(metering=True)),
                            ("kiln-nometer", lambda: kiln.start(metering=False)),
                            ("floor", lambda: tg.start_floor(upstream.base_url, workdir,
                                                             gunicorn))):
            target = start()
            try:
                results[name] = profile(target, args.seconds, workdir)
            finally:
                target.stop()
    finally:
        upstream_svc.stop()
    for name, (rps, counts) in results.items():
        total = sum(counts.values()) or 1
        print(f"\n{name}: {rps:,.0f} req/s at 64 connections; self samples by code:")
        for code, n in counts.most_common(args.top):
            print(f"  {100 * n / total:5.1f} %  {code}")
        own = sum(n for code, n in counts.items() if code.startswith("gateway/"))
        print(f"  {100 * own / total:5.1f} %  all of gateway/ together")


if __name__ == "__main__":
    main()
