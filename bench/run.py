#!/usr/bin/env python3
"""Benchmark Kiln against direct upstream access and the LiteLLM proxy.

Starts on loopback a fake OpenAI-compatible upstream (bench/fake_openai.py),
Kiln (see :func:`start_kiln`) and the LiteLLM proxy (own virtualenv, see
bench/litellm_env.sh), then measures them side by side, interleaved:

* non-stream latency at one connection (wrk latency distribution);
* throughput and p99 at several concurrencies (wrk);
* streaming TTFT, inter-chunk gap and total over a 64-chunk stream paced at
  20 ms and at 1 ms (bench/stream_probe.py);
* many slow streams held open at once: errors, gateway RSS per stream,
  Postgres connections (bench/open_streams.py);
* Kiln with metering on vs off.

Prints a table and writes bench/RESULTS.md.

    python bench/run.py            # full run (~15 min on 2 cores)
    python bench/run.py --quick    # short run to check the harness
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

import report  # noqa: E402 - after the sys.path line
import targets as tg  # noqa: E402
from stream_probe import probe  # noqa: E402

# ==========================================================================
# INTEGRATION POINT: Kiln
# ==========================================================================

KILN_DB = "kiln_bench"
KILN_DATABASE_URL = f"postgresql+psycopg://postgres@127.0.0.1:5432/{KILN_DB}"
KILN_WORKERS = 2  # same as LiteLLM's --num_workers

CATALOG_TEMPLATE = """\
[[models]]
id = "bench-model"
context_window = 32768
max_output_tokens = 8192
input = ["text"]
pricing = {{ input = "0.10", cached_input = "0.05", output = "0.30" }}
backends = [{{ url = "{upstream_url}", model = "bench-model" }}]
"""


def write_catalog(upstream_url: str, directory: Path) -> Path:
    """Write the model catalog TOML Kiln reads through ``KILN_MODELS``."""
    path = directory / "models.toml"
    path.write_text(CATALOG_TEMPLATE.format(upstream_url=upstream_url))
    return path


def start_kiln(upstream_url: str, metering: bool = True, workdir: Path | None = None):
    """Start Kiln in front of ``upstream_url``.

    Returns ``(base_url, api_key, pids, stop)``: base URL such as
    ``http://127.0.0.1:PORT/v1``, a bearer key with credit, the gunicorn
    master PID (workers are found as its descendants), and a no-argument
    callable that shuts everything down.  ``workdir`` holds the run's
    configs and logs.

    See :func:`launch_kiln`: a fresh ``kiln_bench`` database provisioned with the ``kiln``
    CLI (one org with ample credit and no practical in-flight cap), then gunicorn from
    ``deploy/gunicorn.conf.py`` with ``KILN_METERING`` set from ``metering``.
    """
    return launch_kiln(upstream_url, metering, workdir)


def kiln_env(upstream_url: str, workdir: Path, metering: bool) -> dict:
    """Environment for the kiln CLI and gunicorn."""
    return dict(
        os.environ,
        KILN_DATABASE_URL=KILN_DATABASE_URL,
        KILN_MODELS=str(write_catalog(upstream_url, workdir)),
        KILN_METERING="true" if metering else "false",
        KILN_WORKERS=str(KILN_WORKERS),
    )


def kiln_cli(env: dict, *args: str) -> str:
    """Run ``kiln ARGS``; return its stdout."""
    kiln = Path(sys.executable).parent / "kiln"
    out = subprocess.run(
        [str(kiln), *args], env=env, cwd=REPO_DIR, capture_output=True, text=True, check=False
    )
    if out.returncode:
        raise RuntimeError(f"kiln {' '.join(args)} failed: {out.stderr[-800:]}")
    return out.stdout


_KILN_KEY = {}  # the database is provisioned once per run, shared by every Kiln


def provision_kiln(env: dict) -> str:
    """Fresh ``kiln_bench`` database with one org, ample credit and no in-flight cap."""
    if "key" not in _KILN_KEY:
        admin = KILN_DATABASE_URL.replace("+psycopg", "").rsplit("/", 1)[0] + "/postgres"
        for sql in (
            f"DROP DATABASE IF EXISTS {KILN_DB} WITH (FORCE)",
            f"CREATE DATABASE {KILN_DB}",
        ):
            subprocess.run(
                ["psql", admin, "-X", "-q", "-c", sql],
                check=True,
                env=dict(os.environ, PGOPTIONS="--client-min-messages=warning"),
            )
        kiln_cli(env, "db", "upgrade")
        kiln_cli(env, "org", "create", "bench", "--limit", "1000000")
        kiln_cli(env, "credits", "grant", "bench", "1000000")
        _KILN_KEY["key"] = kiln_cli(env, "key", "create", "bench").strip().splitlines()[-1]
    return _KILN_KEY["key"]


def launch_kiln(upstream_url: str, metering: bool = True, workdir: Path | None = None):
    """Provision and start Kiln under gunicorn; see :func:`start_kiln`."""
    workdir = workdir or Path(tempfile.mkdtemp(prefix="kiln-bench-"))
    env = kiln_env(upstream_url, workdir, metering)
    key = provision_kiln(env)
    port = tg.free_port()
    argv = [
        str(Path(sys.executable).parent / "gunicorn"),
        "-c", "deploy/gunicorn.conf.py",
        "--bind", f"127.0.0.1:{port}",
        "--workers", str(KILN_WORKERS),
        "gateway.wsgi:app",
    ]  # fmt: skip
    svc = tg.Service("kiln" if metering else "kiln-nometer", argv, workdir, env=env, cwd=REPO_DIR)
    try:
        tg.wait_http(
            f"http://127.0.0.1:{port}/v1/models",
            svc,
            120,
            headers={"Authorization": f"Bearer {key}"},
        )
    except RuntimeError:
        svc.stop()
        raise
    return f"http://127.0.0.1:{port}/v1", key, [svc.pid], svc.stop


# ==========================================================================
# Scenarios
# ==========================================================================


@dataclass
class Scenario:
    """One measurement, run once per target per round."""

    key: str
    title: str
    kind: str  # "wrk" | "stream" | "open"
    run: Callable[[tg.Target], dict]
    rounds: int
    with_nometer: bool = False  # also measure Kiln with metering off


@dataclass
class Plan:
    """Sizes and durations for one run."""

    rounds: int = 3
    wrk_seconds: int = 10
    concurrencies: list = field(default_factory=lambda: [1, 16, 64, 256])
    streams_20ms: int = 10
    streams_1ms: int = 50
    open_counts: list = field(default_factory=lambda: [1000, 5000])
    open_hold_s: float = 10.0
    open_gap_ms: float = 5000.0
    open_rounds: int = 1


QUICK = Plan(
    rounds=1,
    wrk_seconds=3,
    streams_20ms=3,
    streams_1ms=10,
    open_counts=[1000],
    open_hold_s=3.0,
)


def wrk_run(target: tg.Target, connections: int, seconds: int) -> dict:
    """Non-stream chat completions with wrk; latencies in ms."""
    threads = 1 if connections == 1 else 2
    argv = [
        "wrk", f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--latency",
        "--timeout", "30s", "-s", str(BENCH_DIR / "chat.lua"),
        f"{target.base_url}/chat/completions",
    ]  # fmt: skip
    env = dict(os.environ, BENCH_API_KEY=target.api_key)
    out = subprocess.run(
        argv, capture_output=True, text=True, env=env, check=False, timeout=seconds + 60
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRK_JSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk failed: {out.stdout[-500:]} {out.stderr[-500:]}")
    raw = json.loads(line.removeprefix("WRK_JSON "))
    errors = sum(
        raw[k] for k in ("connect_errors", "read_errors", "write_errors", "timeouts", "non2xx")
    )
    done = raw["requests"] > 0  # with no reply in time wrk reports zero latencies
    return {
        "rps": raw["rps"],
        "p50_ms": raw["p50_us"] / 1000 if done else None,
        "p99_ms": raw["p99_us"] / 1000 if done else None,
        "requests": raw["requests"],
        "errors": errors if done else max(errors, 1),
    }


def stream_run(target: tg.Target, streams: int, gap_ms: float) -> dict:
    """Sequential 64-chunk streams, timed per chunk."""
    return probe(target.base_url, target.api_key, streams, 64, gap_ms)


DRAIN_TIMEOUT_S = 60


def open_run(target: tg.Target, count: int, plan: Plan, upstream_url: str) -> dict:
    """Hold ``count`` slow streams at once via bench/open_streams.py."""
    ramp_s = 10 + count / 50
    argv = [
        sys.executable, str(BENCH_DIR / "open_streams.py"),
        "--base-url", target.base_url, "--api-key", target.api_key,
        "--streams", str(count), "--gap-ms", str(plan.open_gap_ms),
        "--ramp-s", str(ramp_s), "--hold-s", str(plan.open_hold_s),
        "--upstream-url", upstream_url, "--drain-timeout-s", str(DRAIN_TIMEOUT_S),
    ]  # fmt: skip
    if target.name != "direct":
        argv += ["--pids", ",".join(map(str, target.pids))]
    if target.db_name:
        argv += ["--pg-db", target.db_name]
    out = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        check=False,
        timeout=ramp_s + plan.open_hold_s + 240,
    )
    if not out.stdout.strip():
        raise RuntimeError(f"open_streams failed: {out.stderr[-800:]}")
    time.sleep(2)  # let the target settle before the next run
    return json.loads(out.stdout.strip().splitlines()[-1])


def build_scenarios(plan: Plan, upstream_url: str) -> list:
    r, secs = plan.rounds, plan.wrk_seconds
    scs = [
        Scenario(
            "nonstream_c1",
            "non-stream, 1 conn",
            "wrk",
            lambda t: wrk_run(t, 1, secs),
            r,
            with_nometer=True,
        )
    ]
    for c in plan.concurrencies:
        if c == 1:
            continue  # the latency scenario above is concurrency 1
        scs.append(
            Scenario(
                f"tput_c{c}",
                f"non-stream, {c} conns",
                "wrk",
                lambda t, c=c: wrk_run(t, c, secs),
                r,
                with_nometer=c == 64,
            )
        )
    scs += [
        Scenario(
            "stream_20ms",
            "stream 64×20 ms",
            "stream",
            lambda t: stream_run(t, plan.streams_20ms, 20),
            r,
            with_nometer=True,
        ),
        Scenario(
            "stream_1ms",
            "stream 64×1 ms",
            "stream",
            lambda t: stream_run(t, plan.streams_1ms, 1),
            r,
        ),
    ]
    for k in plan.open_counts:
        scs.append(
            Scenario(
                f"open_{k}",
                f"{k} open streams",
                "open",
                lambda t, k=k: open_run(t, k, plan, upstream_url),
                plan.open_rounds,
            )
        )
    return scs


# ==========================================================================
# Orchestration
# ==========================================================================


def raise_nofile():
    """Let this process and every child hold many sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return want


def warm_up(target: tg.Target):
    """Touch every code path once so first-request costs stay out of the numbers."""
    tg.check_chat(target)
    checked = probe(target.base_url, target.api_key, 1, 4, 5)
    if checked["errors"] or checked["short_streams"] or checked["missing_done"]:
        raise RuntimeError(f"{target.name}: bad stream: {checked}")
    wrk_run(target, 16, 2)
    return checked


def start_targets(args, workdir: Path, notes: list):
    """Start the upstream, Kiln (when wired) and LiteLLM; return (upstream, targets)."""
    upstream, _ = tg.start_upstream(workdir, workers=args.upstream_workers)
    print(f"upstream: {upstream.base_url}", flush=True)
    started = [upstream]
    wanted = set(args.targets.split(","))
    try:
        if "kiln" in wanted:
            started += start_kiln_targets(upstream.base_url, args.metering_compare, workdir, notes)
        if "litellm" in wanted:
            lite = tg.start_litellm(
                upstream.base_url,
                workdir,
                workers=args.litellm_workers,
                conn_limit=args.litellm_conn_limit,
            )
            print(
                f"litellm {lite.version}: {lite.base_url} (startup {lite.startup_s:.1f} s)",
                flush=True,
            )
            started.append(lite)
    except BaseException:
        stop_all(started)
        raise
    return upstream, [t for t in started if t.name in wanted or t.name == "kiln-nometer"]


def start_kiln_targets(upstream_url: str, compare_metering: bool, workdir: Path, notes) -> list:
    """Kiln (and Kiln without metering), or nothing while not wired."""
    out = []
    for name, metering in (("kiln", True), ("kiln-nometer", False)):
        if name == "kiln-nometer" and not compare_metering:
            break
        try:
            t0 = time.monotonic()
            base_url, key, pids, stop = start_kiln(upstream_url, metering, workdir)
        except NotImplementedError as exc:
            notes.append(f"Kiln not measured: {exc}")
            print(f"kiln: skipped ({exc})", flush=True)
            return out
        out.append(
            tg.Target(
                name,
                base_url,
                key,
                list(pids),
                stop,
                startup_s=time.monotonic() - t0,
                version=kiln_version(),
                db_name=KILN_DB,
            )
        )
        print(f"{name}: {base_url}", flush=True)
    return out


def kiln_version() -> str:
    out = subprocess.run(
        ["git", "-C", str(REPO_DIR), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or "unknown"


def stop_all(targets):
    for t in reversed(targets):
        try:
            t.stop()
        except Exception as exc:  # noqa: BLE001 - keep stopping the rest
            print(f"stopping {t.name}: {exc}", file=sys.stderr)


def measure(scenarios, targets, results: dict):
    """Run every scenario, interleaving the targets round by round."""
    for sc in scenarios:
        group = [t for t in targets if t.name != "kiln-nometer" or sc.with_nometer]
        for rnd in range(sc.rounds):
            for t in group:
                t0 = time.monotonic()
                try:
                    res = sc.run(t)
                except Exception as exc:  # noqa: BLE001 - record it, go on
                    res = {"errors": 1, "failure": str(exc)[:300]}
                results.setdefault(sc.key, {}).setdefault(t.name, []).append(res)
                print(
                    f"[{sc.key} round {rnd + 1}/{sc.rounds}] {t.name:13s} "
                    f"{summary(sc.kind, res)} ({time.monotonic() - t0:.0f}s)",
                    flush=True,
                )


def summary(kind: str, res: dict) -> str:
    """One progress line."""
    if "failure" in res:
        return f"FAILED: {res['failure']}"
    r = {k: ("-" if v is None else round(v, 2) if isinstance(v, float) else v)
         for k, v in res.items()}  # fmt: skip
    if kind == "wrk":
        return f"{r['rps']} req/s p50 {r['p50_ms']} ms p99 {r['p99_ms']} ms errors {r['errors']}"
    if kind == "stream":
        return (
            f"ttft p50 {r['ttft_p50_ms']} gap p99 {r['gap_p99_ms']} total p50 "
            f"{r['total_p50_ms']} ms errors {r['errors']} {r['error_samples'][:1]}"
        )
    return (
        f"open {r['open_at_hold']}/{r['streams']} in {r['open_s']} s, "
        f"held {r.get('held_to_end')}, errors {r['errors']} {r['error_kinds']}, "
        f"RSS/stream {r['rss_per_stream_kb']} KiB, pg peak {r['pg_peak']}, "
        f"upstream drained in {r.get('upstream_drain_s')} s, "
        f"processes lost {r.get('processes_lost')}"
    )


def settings_lines(args, plan: Plan) -> list:
    return [
        (
            f"rounds {plan.rounds}; wrk {plan.wrk_seconds} s per run, concurrencies "
            f"{', '.join(map(str, plan.concurrencies))}"
        ),
        f"streams: {plan.streams_20ms} × 64 chunks at 20 ms, {plan.streams_1ms} × 64 at 1 ms",
        (
            f"open streams: {', '.join(map(str, plan.open_counts))} at once, chunk every "
            f"{plan.open_gap_ms:g} ms, held {plan.open_hold_s:g} s, "
            "RSS = gateway master + workers"
        ),
        (
            f"fake upstream: {args.upstream_workers} process(es); LiteLLM --num_workers "
            f"{args.litellm_workers}, AIOHTTP_CONNECTOR_LIMIT(_PER_HOST) "
            f"{args.litellm_conn_limit or 'default'}; Kiln gunicorn workers {KILN_WORKERS}"
        ),
    ]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short run to check the harness")
    p.add_argument("--rounds", type=int, help="interleaved rounds per scenario")
    p.add_argument("--duration", type=int, help="seconds per wrk run")
    p.add_argument("--open-streams", help="comma-separated counts, e.g. 1000,5000")
    p.add_argument("--targets", default="direct,kiln,litellm")
    p.add_argument("--no-metering-compare", dest="metering_compare", action="store_false")
    p.add_argument("--upstream-workers", type=int, default=1)
    p.add_argument("--litellm-workers", type=int, default=2)
    p.add_argument(
        "--litellm-conn-limit",
        type=int,
        default=20000,
        help="LiteLLM upstream connection cap per worker (0 keeps its default of 500 per host)",
    )
    p.add_argument("--only", help="comma-separated scenario keys to run")
    p.add_argument("--results", default=str(BENCH_DIR / "RESULTS.md"))
    return p.parse_args(argv)


def make_run_dir() -> Path:
    """Per-run directory for configs, service logs and raw results."""
    cache = Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")
    run_dir = cache / "bench" / "runs" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def make_plan(args) -> Plan:
    plan = dataclasses.replace(QUICK if args.quick else Plan())
    if args.rounds:
        plan.rounds = args.rounds
    if args.duration:
        plan.wrk_seconds = args.duration
    if args.open_streams is not None:
        plan.open_counts = [int(x) for x in args.open_streams.split(",") if x]
    return plan


def main(argv=None):
    args = parse_args(argv)
    if not shutil.which("wrk"):
        sys.exit("wrk not found: apt-get install -y wrk")
    plan = make_plan(args)
    raise_nofile()
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    run_dir = make_run_dir()
    print(f"logs and raw results: {run_dir}", flush=True)
    notes, results = [], {}
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1) / 2:
        notes.append(
            f"machine not idle at start (load {load:.1f} on {os.cpu_count()} cores): "
            "absolute numbers are noisy"
        )
        print(f"warning: {notes[-1]}", flush=True)
    upstream, targets = start_targets(args, run_dir, notes)
    scenarios = build_scenarios(plan, upstream.base_url)
    if args.only:
        scenarios = [s for s in scenarios if s.key in set(args.only.split(","))]
    try:
        for t in targets:
            warm_up(t)
        measure(scenarios, targets, results)
    finally:
        stop_all([upstream] + [t for t in targets if t is not upstream])
        (run_dir / "results.json").write_text(json.dumps(results, indent=1))
    lines = report.table(scenarios, results, [t.name for t in targets])
    metering = report.metering_lines(results)
    print("\n" + "\n".join(lines))
    if metering:
        print("\nKiln metering on vs off:\n" + "\n".join(metering))
    command = "python bench/run.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    report.write_results(
        Path(args.results),
        started=started,
        command=command.strip(),
        mode="quick" if args.quick else "full",
        targets=targets,
        table_lines=lines,
        metering=metering,
        notes=notes,
        settings=settings_lines(args, plan),
    )
    print(f"\nwrote {args.results}")


if __name__ == "__main__":
    main()
