#!/usr/bin/env python3
"""Benchmark Kiln against direct upstream access, the stack's floor and the LiteLLM proxy.

Targets, all in front of one fake OpenAI-compatible upstream (bench/fake_openai.py) on loopback:

* ``direct``: the fake upstream itself (always measured: every "added" time is over it);
* ``kiln``: Kiln metered on Postgres (bench/kiln_target.py), one org, or ``ORGS_CONNS`` orgs
  with a key per connection in the many-orgs scenario;
* ``kiln-nometer``: the same Kiln with ``KILN_METERING=false``;
* ``floor``: the stack's floor, a bare Flask relay on the same gunicorn gevent workers
  (bench/floor_app.py);
* ``litellm``: the LiteLLM proxy, in its own virtualenv (bench/litellm_env.sh).

Scenarios (bench/scenarios.py says which targets each runs on):

* ``nonstream_c1``: non-stream latency at one connection (wrk latency distribution), and on
  Kiln metered the median durable one-row commit on its database right after (metering's
  added latency is counted in those);
* ``messages_c1``: chat's request through Anthropic's ``POST /v1/messages`` at one connection
  beside chat's on the same Kiln;
* ``tput_cN``: throughput and p99 at N connections (wrk), N from ``--concurrencies``;
* ``orgs_c64``: 64 connections, each with its own wrk thread and the key of its own org;
* ``responses_c1``, ``responses_prev20_c1``: ``POST /v1/responses`` at one connection beside
  chat's on the same Kiln, plain and continuing a stored 20-turn conversation
  (``previous_response_id``);
* ``completions_c1``, ``embeddings_c1``: ``POST /v1/completions`` and ``POST /v1/embeddings``
  at one connection beside chat's, on Kiln and direct (the fake upstream serves both);
* ``endpoints_c64``: throughput at 64 connections of every endpoint (messages, responses,
  completions, embeddings) beside chat's on the same Kiln, run after run;
* ``stream_20ms``, ``stream_1ms``: TTFT, inter-chunk gap and total over a 64-chunk stream
  paced at 20 ms and at 1 ms (bench/stream_probe.py);
* ``stream_fast``: a few 2,000-chunk streams at once, unpaced, with usage, back to back for the
  wrk duration: text chunks received per second and per CPU-second of the target's own
  processes, every chunk counted (bench/relay_probe.py);
* ``open_N``: N slow streams opened at once and held: errors, time to open, RSS per stream,
  Postgres connections, how fast upstream streams stop once clients leave
  (bench/open_streams.py); LiteLLM only up to 5,000 (it takes minutes beyond).

No target shares the machine with another one waiting idle: each is started just before its
runs and stopped right after. Rounds are interleaved: within a round each block of scenarios
runs on every target in turn (so the values of a reported ratio are measured seconds apart),
every other round in reverse order; LiteLLM, slow to start, runs all its scenarios in one visit
a round, between two blocks. Every value reported is the median over the rounds. The bursts of
open streams run once per target, after the rounds, each on a freshly started target.

Every wrk run also reads the CPU seconds of the target's processes and of Postgres (/proc)
before and after: the detailed table gives both per request.

Prints the target table (the ratios, bench/goals.py) and the detailed table. A
complete run writes bench/RESULTS.md (keeping its hand-written analysis); a quick or partial
run writes RESULTS.md in its run directory instead, unless ``--results`` names a file. Logs and
raw results go to ``$KILN_CACHE_DIR/bench/runs/<time>/`` (default ``~/.cache/kiln``).

    make bench                                # installs wrk and LiteLLM, then a full run
    make bench BENCH_ARGS=--quick             # the same, short (about 6 min)
    python bench/run.py                       # full run (about 20-25 min on 2 cores)
    python bench/run.py --quick               # short run to check the harness
    python bench/run.py --targets kiln,kiln-nometer --scenarios tput_c64,orgs_c64
    python bench/run.py --targets kiln --scenarios open_5000,open_10000   # bursts vs direct

Options:

  --quick               1 round, 3 s wrk runs, fewer streams, one burst of 1000 streams
  --targets LIST        comma-separated targets (default: all; direct is always added)
  --scenarios LIST      comma-separated scenario keys (alias --only; default: all)
  --rounds N            interleaved rounds (default 3)
  --duration S          seconds per wrk run and per relay run (default 10)
  --concurrencies LIST  wrk connection counts (default 1,16,64; 16 and up run on direct,
                        Kiln and LiteLLM, 64 also on the others)
  --open-streams LIST   stream counts of the bursts (default 5000,10000)
  --results PATH        where to write the Markdown report
  --fresh-db            provision Kiln's database with the kiln command even when the copy
                        kept from an earlier run still serves (bench/kiln_target.py)
  --upstream-workers N, --litellm-workers N, --litellm-conn-limit N  see --help

Needs wrk (``bench/install.sh``, which ``make bench`` runs) and Postgres at 127.0.0.1:5432
(trust auth, user postgres) for Kiln; the database ``kiln_bench`` is dropped and made anew
(``kiln_bench_template`` keeps a copy for the next run).
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
import statistics
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

import goals  # noqa: E402 - after the sys.path line
import kiln_target as kt  # noqa: E402
import report  # noqa: E402
import scenarios as sc  # noqa: E402
import targets as tg  # noqa: E402
from stream_probe import probe  # noqa: E402

KILN_TARGETS = (sc.KILN, sc.NOMETER)


class Lab:
    """The upstream, and a way to start any target in front of it."""

    def __init__(self, args, upstream: tg.Target, run_dir: Path, kiln: kt.KilnBench | None):
        self.args, self.upstream, self.run_dir, self.kiln = args, upstream, run_dir, kiln
        self.started = {}  # name -> the last Target started, for the report's versions
        self.startups = {}  # name -> startup seconds of every start

    def start(self, name: str) -> tg.Target:
        """Start ``name`` (direct is the upstream, always running)."""
        if name == sc.DIRECT:
            target = dataclasses.replace(self.upstream, stop=lambda: None)
        elif name in KILN_TARGETS:
            kt.psql("CHECKPOINT")  # no checkpoint left over from an earlier target's writes
            target = self.kiln.start(metering=name == sc.KILN)
        elif name == sc.FLOOR:
            gunicorn = Path(sys.executable).parent / "gunicorn"
            target = tg.start_floor(self.upstream.base_url, self.run_dir, gunicorn)
        elif name == sc.LITELLM:
            target = tg.start_litellm(
                self.upstream.base_url,
                self.run_dir,
                workers=self.args.litellm_workers,
                conn_limit=self.args.litellm_conn_limit,
            )
        else:
            raise ValueError(f"unknown target {name}")
        self.started[name] = target
        if target.startup_s is not None:
            self.startups.setdefault(name, []).append(target.startup_s)
        return target

    def report_targets(self) -> list:
        """The targets as the report lists them: last version, median startup."""
        out = []
        for name, target in sorted(self.started.items(), key=lambda kv: sc.TARGETS.index(kv[0])):
            times = self.startups.get(name)
            startup = statistics.median(times) if times else None
            out.append(dataclasses.replace(target, startup_s=startup))
        return out


WARM_RUN_S = 2
WARM_MAX_S = 30
WARM_GAIN = 1.1  # still warming while a run beats every earlier one by this factor


def warm_up(target: tg.Target) -> int:
    """Touch every code path, then load the target until its throughput stops rising.

    A proxy that has just started can take seconds to reach its pace (LiteLLM about ten on two
    cores, three times slower at first): short wrk runs at 16 connections go on while each
    beats the best before it by ``WARM_GAIN``, for at most ``WARM_MAX_S``. A slower run ends
    it: on a shared machine that is noise, not warming. Returns the runs it took.
    """
    tg.check_chat(target)
    checked = probe(target.base_url, target.api_key, 1, 4, 5)
    if checked["errors"] or checked["short_streams"] or checked["missing_done"]:
        raise RuntimeError(f"{target.name}: bad stream: {checked}")
    if target.name == sc.DIRECT:
        return 0
    rates, t0 = [], time.monotonic()
    while time.monotonic() - t0 < WARM_MAX_S:
        rates.append(sc.wrk_run(target, 16, WARM_RUN_S)["rps"])
        if len(rates) > 1 and rates[-1] < WARM_GAIN * max(rates[:-1]):
            break
    return len(rates)


def visit(lab: Lab, name: str, todo: list, results: dict, label: str):
    """Start ``name``, run the scenarios ``todo`` on it, stop it."""

    def record(s, res):
        results.setdefault(s.key, {}).setdefault(name, []).append(res)

    try:
        target = lab.start(name)
    except Exception as exc:  # noqa: BLE001 - record it, go on with the other targets
        print(f"[{label}] {name}: FAILED to start: {exc}", flush=True)
        for s in todo:
            record(s, {"errors": 1, "failure": f"start: {str(exc)[:300]}"})
        return
    try:
        try:
            warm_runs = warm_up(target)
        except Exception as exc:  # noqa: BLE001 - a target that cannot serve fails this visit
            print(f"[{label}] {name}: FAILED warm-up: {exc}", flush=True)
            for s in todo:
                record(s, {"errors": 1, "failure": f"warm-up: {str(exc)[:300]}"})
            return
        startup = "" if target.startup_s is None else f"started in {target.startup_s:.1f} s, "
        warm = f"warm after {warm_runs} wrk runs" if warm_runs else "ready"
        print(f"[{label}] {name}: {startup}{warm}", flush=True)
        for s in todo:
            t0 = time.monotonic()
            try:
                res = s.run(target)
            except Exception as exc:  # noqa: BLE001 - record it, go on
                res = {"errors": 1, "failure": str(exc)[:300]}
            res["warm_up_runs"] = warm_runs
            record(s, res)
            print(
                f"[{label} {s.key}] {name:13s} {summary(s.kind, res)} "
                f"({time.monotonic() - t0:.0f}s)",
                flush=True,
            )
    finally:
        target.stop()
        time.sleep(1)  # let the stopped processes go before the next target starts
        (lab.run_dir / "results.json").write_text(json.dumps(results, indent=1))


SOLO = (sc.LITELLM,)  # slow to start: one visit a round, with all its scenarios


def round_visits(rnd: int, names: list, short: list) -> list:
    """``[(target, scenarios)]`` of round ``rnd``: block after block, each on every target.

    Every other round runs the targets in reverse order (A B C, C B A, ...): the targets
    compared with each other stay neighbours, and none always runs first. A solo target has
    one visit a round, with all its scenarios, between two blocks (never inside one), a
    boundary further each round.
    """
    order = [n for n in names if n not in SOLO]
    if rnd % 2:
        order.reverse()
    blocks = []
    for block in sorted({s.block for s in short}, key=sc.BLOCKS.index):
        visits = [(n, [s for s in short if s.block == block and n in s.targets]) for n in order]
        blocks.append([v for v in visits if v[1]])
    solos = [(n, [s for s in short if n in s.targets]) for n in names if n in SOLO]
    blocks.insert(rnd % (len(blocks) + 1), [v for v in solos if v[1]])
    return [v for block in blocks for v in block]


def measure(lab: Lab, plan: sc.Plan, scenarios: list, names: list, results: dict):
    """Interleaved rounds of the short scenarios, then the bursts, one target at a time."""
    short = [s for s in scenarios if s.kind != "open"]
    for rnd in range(plan.rounds):
        for name, todo in round_visits(rnd, names, short):
            visit(lab, name, todo, results, f"round {rnd + 1}/{plan.rounds}")
    for s in scenarios:
        if s.kind == "open":
            for name in (n for n in names if n in s.targets):
                visit(lab, name, [s], results, "burst")


def summary(kind: str, res: dict) -> str:
    """One progress line."""
    if "failure" in res:
        return f"FAILED: {res['failure']}"
    r = {k: ("-" if v is None else round(v, 2) if isinstance(v, float) else v)
         for k, v in res.items()}  # fmt: skip
    if kind == "wrk":
        return f"{r['rps']} req/s p50 {r['p50_ms']} ms p99 {r['p99_ms']} ms errors {r['errors']}"
    if kind == "endpoints":
        rates = ", ".join(f"{n} {r[f'{n}_rps']}" for n in ("chat", *sc.ENDPOINTS))
        return f"req/s: {rates}; errors {r['errors']}"
    if kind == "dialect":
        return (f"{r['rps']} req/s p50 {r['p50_ms']} ms (chat {r['chat_rps']} req/s p50 "
                f"{r['chat_p50_ms']} ms) errors {r['errors']}")
    if kind == "relay":
        return (
            f"{r['chunks_per_s']} chunks/s, {r['chunks_per_cpu_s']} per CPU-s "
            f"({r['busy_cores']} cores), {r['streams']} streams, errors {r['errors']} "
            f"{r['error_samples'][:1]}"
        )
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


def settings_lines(args, plan: sc.Plan, names: list, keys: list) -> list:
    return [
        f"targets: {', '.join(names)}; scenarios: {', '.join(keys)}",
        (
            f"rounds {plan.rounds} (blocks of scenarios on every target in turn, each target "
            f"started before and stopped after its runs, warmed until its pace stops rising); "
            f"wrk {plan.wrk_seconds} s per run, concurrencies "
            f"{', '.join(map(str, plan.concurrencies))}; {sc.ORGS_CONNS} orgs at "
            f"{sc.ORGS_CONNS} conns (a wrk thread and a key each)"
        ),
        f"streams: {plan.streams_20ms} × 64 chunks at 20 ms, {plan.streams_1ms} × 64 at 1 ms",
        (
            f"relay: {plan.fast_streams} streams at once of {plan.fast_chunks} chunks, unpaced, "
            f"with usage, back to back for {plan.wrk_seconds} s; CPU = the target's processes"
        ),
        (
            f"open streams: {', '.join(map(str, plan.open_counts))} at once, chunk every "
            f"{plan.open_gap_ms:g} ms, held {plan.open_hold_s:g} s, once per target; "
            f"LiteLLM up to {sc.LITELLM_OPEN_MAX}; RSS = gateway master + workers"
        ),
        (
            f"fake upstream: {args.upstream_workers} process(es); LiteLLM --num_workers "
            f"{args.litellm_workers}, AIOHTTP_CONNECTOR_LIMIT(_PER_HOST) "
            f"{args.litellm_conn_limit or 'default'}; Kiln gunicorn workers {kt.WORKERS}; "
            f"floor gunicorn workers {tg.FLOOR_WORKERS}"
        ),
    ]


def csv(text: str) -> list:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short run to check the harness")
    p.add_argument("--targets", default=",".join(sc.TARGETS), help="comma-separated targets")
    p.add_argument("--scenarios", "--only", dest="scenarios", help="comma-separated scenarios")
    p.add_argument("--rounds", type=int, help="interleaved rounds")
    p.add_argument("--duration", type=int, help="seconds per wrk run")
    p.add_argument("--concurrencies", help="comma-separated wrk connection counts")
    p.add_argument("--open-streams", help="comma-separated burst sizes, e.g. 5000,10000")
    p.add_argument("--upstream-workers", type=int, default=1)
    p.add_argument("--litellm-workers", type=int, default=2)
    p.add_argument(
        "--litellm-conn-limit",
        type=int,
        default=20000,
        help="LiteLLM upstream connection cap per worker (0 keeps its default of 500 per host)",
    )
    p.add_argument("--results", help="Markdown report path (default: see the docstring)")
    p.add_argument(
        "--fresh-db", action="store_true", help="provision Kiln's database anew, not from the cache"
    )
    args = p.parse_args(argv)
    unknown = set(csv(args.targets)) - set(sc.TARGETS)
    if unknown:
        p.error(f"unknown targets {sorted(unknown)}; known: {', '.join(sc.TARGETS)}")
    return args


def make_plan(args) -> sc.Plan:
    plan = dataclasses.replace(sc.QUICK if args.quick else sc.Plan())
    if args.rounds:
        plan.rounds = args.rounds
    if args.duration:
        plan.wrk_seconds = args.duration
    if args.concurrencies:
        plan.concurrencies = [int(x) for x in csv(args.concurrencies)]
    if args.open_streams is not None:
        plan.open_counts = [int(x) for x in csv(args.open_streams)]
    return plan


def select(args, plan: sc.Plan, upstream_url: str):
    """``(scenarios, target names)`` this run measures."""
    wanted = set(csv(args.targets)) | {sc.DIRECT}
    names = [t for t in sc.TARGETS if t in wanted]
    scenarios = sc.build(plan, upstream_url)
    if args.scenarios:
        keys = set(csv(args.scenarios))
        unknown = keys - {s.key for s in scenarios}
        if unknown:
            sys.exit(f"unknown scenarios {sorted(unknown)}: {', '.join(s.key for s in scenarios)}")
        scenarios = [s for s in scenarios if s.key in keys]
    scenarios = [s for s in scenarios if s.targets & set(names)]
    return scenarios, names


def raise_nofile():
    """Let this process and every child hold many sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def make_run_dir() -> Path:
    """Per-run directory for configs, service logs and raw results."""
    cache = Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")
    run_dir = cache / "bench" / "runs" / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def machine_note(notes: list, when: str):
    """Note a machine that is busy with something else: absolute numbers get noisy."""
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1) / 2:
        notes.append(
            f"machine not idle {when} (load {load:.1f} on {os.cpu_count()} cores): "
            "absolute numbers are noisy; ratios measured side by side hold better"
        )
        print(f"warning: {notes[-1]}", flush=True)


def prepare_kiln(args, names, scenarios, upstream_url: str, run_dir: Path):
    """Make Kiln's database when a Kiln target runs; ``None`` otherwise."""
    if not any(s.targets & set(names) & set(KILN_TARGETS) for s in scenarios):
        return None
    kiln = kt.KilnBench(upstream_url, run_dir, sc.ORGS_CONNS)
    t0 = time.monotonic()
    how = kiln.provision(fresh=args.fresh_db)
    print(f"kiln: database {how} in {time.monotonic() - t0:.0f} s", flush=True)
    return kiln


def complete_run(args) -> bool:
    """Every target and scenario at full size: the run bench/RESULTS.md records."""
    return not args.quick and not args.scenarios and set(csv(args.targets)) >= set(sc.TARGETS)


def main(argv=None):
    args = parse_args(argv)
    if not shutil.which("wrk"):
        sys.exit("wrk not found: run bench/install.sh (make bench does) or apt-get install wrk")
    plan = make_plan(args)
    raise_nofile()
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    t_start = time.monotonic()
    run_dir = make_run_dir()
    print(f"logs and raw results: {run_dir}", flush=True)
    notes, results = [], {}
    machine_note(notes, "at start")
    if sc.LITELLM in csv(args.targets):
        tg.litellm_bin()  # install it now, not between two measurements
    upstream, upstream_svc = tg.start_upstream(run_dir, workers=args.upstream_workers)
    print(f"upstream: {upstream.base_url}", flush=True)
    try:
        scenarios, names = select(args, plan, upstream.base_url)
        kiln = prepare_kiln(args, names, scenarios, upstream.base_url, run_dir)
        lab = Lab(args, upstream, run_dir, kiln)
        measure(lab, plan, scenarios, names, results)
    finally:
        upstream_svc.stop()
        (run_dir / "results.json").write_text(json.dumps(results, indent=1))
    machine_note(notes, "at the end")
    elapsed_min = (time.monotonic() - t_start) / 60
    lite = lab.started.get(sc.LITELLM)
    goal_lines = goals.table(results, plan.open_counts, lite.version if lite else "")
    lines = report.table(scenarios, results, names)
    metering = report.metering_lines(results)
    print("\nTargets:\n" + "\n".join(goal_lines))
    print("\n" + "\n".join(lines))
    if metering:
        print("\nKiln metering on vs off:\n" + "\n".join(metering))
    command = "python bench/run.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    path = Path(args.results) if args.results else None
    if path is None:
        path = BENCH_DIR / "RESULTS.md" if complete_run(args) else run_dir / "RESULTS.md"
    report.write_results(
        path,
        started=started,
        command=command.strip(),
        mode="quick" if args.quick else "full" if complete_run(args) else "partial",
        targets=lab.report_targets(),
        goal_lines=goal_lines,
        table_lines=lines,
        metering=metering,
        notes=notes,
        settings=settings_lines(args, plan, names, [s.key for s in scenarios])
        + [f"wall time {elapsed_min:.1f} min"],
    )
    print(f"\nwrote {path} ({elapsed_min:.1f} min)")


if __name__ == "__main__":
    main()
