#!/usr/bin/env python3
"""Benchmark: what metering on Postgres costs per request (README, "Metering").

One run, side by side, against the fast fake upstream (``bench/fake_openai.py``, no delay):

* throughput (requests/s) and p50/p99 latency of the whole path — wrk → gunicorn (gevent
  workers) → Kiln → upstream — with metering on Postgres, with metering on and the gateway's
  sessions at ``synchronous_commit=off`` (an operator's option, to show what the WAL flush
  costs), and with metering off (``KILN_METERING=false``: no lease, no hold, no usage event;
  for benchmarks only), for non-stream requests and short streams, in interleaved rounds (the
  machine is shared: compare ratios, not absolute numbers);
* database statements, round trips and transactions per request with metering on and off,
  counted from libpq's protocol trace of every connection (the ledger's included), in an
  in-process harness (Flask test client under gevent) with the key and maintenance caches warm.

Needs Postgres at 127.0.0.1:5432 (user postgres, trust) and ``wrk``; makes and drops its own
database.

    python bench/metering.py                     # 3 rounds of 8 s per cell (~3 min)
    python bench/metering.py --rounds 1 --duration 3
"""

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PG_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432"
CATALOG = """[[models]]
id = "bench-model"
context_window = 8192
max_output_tokens = 1024
input = ["text"]
pricing = {{ input = "0.10", cached_input = "0.05", output = "0.30" }}
backends = [{{ url = "{url}", model = "bench-model" }}]
"""
MESSAGES = [{"role": "user", "content": "Say hello"}]
MODES = {
    "non-stream": {"model": "bench-model", "messages": MESSAGES, "max_tokens": 16},
    "stream": {"model": "bench-model", "messages": MESSAGES, "max_tokens": 16, "stream": True},
}


# -- processes -------------------------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_upstream(chunks):
    """Start the fast fake upstream; return ``(process, base_url)``."""
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "bench" / "fake_openai.py"),
            "--port",
            "0",
            "--latency-ms",
            "0",
            "--gap-ms",
            "0",
            "--chunks",
            str(chunks),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stdout.readline()
    if not line.startswith("ready "):
        proc.kill()
        raise SystemExit(f"fake upstream did not start: {line!r}")
    return proc, line.split()[1]


def start_gateway(env, workers, timeout_s=60):
    """Start gunicorn (deploy/gunicorn.conf.py) with ``env``; return ``(process, base_url)``."""
    import requests

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "-c",
            str(ROOT / "deploy" / "gunicorn.conf.py"),
            "gateway.wsgi:app",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={
            **os.environ,
            **env,
            "KILN_BIND": f"127.0.0.1:{port}",
            "KILN_WORKERS": str(workers),
            "KILN_LOG_REQUESTS": "false",
            "PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(prefix="kiln-bench-metrics-"),
        },
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/healthz", timeout=1).status_code == 200:
                return proc, url
        except requests.RequestException:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("gateway did not start")


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- database --------------------------------------------------------------------------------------


def create_database(name):
    """Create database ``name`` afresh, migrate it, add an org with credits; return
    ``(url, key)``."""
    import sqlalchemy as sa
    from alembic import command

    from gateway.api import auth
    from gateway.ops.cli_db import alembic_config

    admin = sa.create_engine(PG_SERVER + "/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    url = f"{PG_SERVER}/{name}"
    command.upgrade(alembic_config(url), "head")
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        org_id = conn.execute(
            sa.text(
                "INSERT INTO orgs (name, in_flight_limit) VALUES ('bench', 100000) RETURNING id"
            )
        ).scalar_one()
        conn.execute(
            sa.text(
                "INSERT INTO credit_grants (org_id, amount_usd, note) VALUES (:o, 1000000, 'bench')"
            ),
            {"o": org_id},
        )
        key = auth.create_key(conn, org_id, name="bench")
    engine.dispose()
    return url, key


def commit_latency(db_url, n=100):
    """Return median ms of a bare round trip (``SELECT 1``) and of a durable one-row commit."""
    import psycopg

    dsn = db_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE bench_commit_probe (x integer)")
        medians = [
            _median_ms(conn, q, n)
            for q in ("SELECT 1", "INSERT INTO bench_commit_probe VALUES (1)")
        ]
        conn.execute("DROP TABLE bench_commit_probe")
    return medians


def _median_ms(conn, query, n):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        conn.execute(query)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def drop_database(name):
    import sqlalchemy as sa

    admin = sa.create_engine(PG_SERVER + "/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def warm_up(db_url, targets, key, seconds=3, connections=16):
    """Send every gateway of ``targets`` (``[base URL, ...]``) each mode's requests for
    ``seconds``, then ``ANALYZE`` the database: unmeasured, so that every gateway's pools,
    caches and per-connection statement plans are made before the first measurement, on tables
    that are no longer empty and whose statistics are current. (Without it, in one run, the
    gateway measured first served 0.8x the requests per second of an identical second one; the
    cause was not isolated.)"""
    import sqlalchemy as sa

    for url in targets:
        for body in MODES.values():
            run_wrk(url, key, body, seconds, connections)
    time.sleep(1)  # the warm-up's settlements commit
    engine = sa.create_engine(db_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text("ANALYZE"))
    engine.dispose()


# -- load with wrk ---------------------------------------------------------------------------------

WRK_SCRIPT = """wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer {key}"
"""
UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def run_wrk(url, key, body, duration_s, connections):
    """Run wrk; return ``{"rps", "p50_ms", "p99_ms", "errors"}``."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(WRK_SCRIPT.format(body=json.dumps(json.dumps(body)), key=key))
    try:
        out = subprocess.run(
            [
                "wrk",
                "-t1",
                f"-c{connections}",
                f"-d{duration_s}s",
                "--latency",
                "-s",
                script.name,
                url + "/v1/chat/completions",
            ],
            capture_output=True,
            text=True,
            timeout=duration_s + 60,
        ).stdout
    finally:
        os.unlink(script.name)
    return {
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
        "p50_ms": _percentile(out, "50"),
        "p99_ms": _percentile(out, "99"),
        "errors": _errors(out),
        "error_lines": [ln.strip() for ln in out.splitlines() if "errors" in ln or "Non-2xx" in ln],
    }


def _percentile(out, pct):
    value, unit = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M).groups()
    return float(value) * UNITS[unit]


def _errors(out):
    found = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sockets = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out
    )
    return (int(found.group(1)) if found else 0) + (
        sum(map(int, sockets.groups())) if sockets else 0
    )


# -- round trips (in-process, run in a child with gevent's monkey-patching) ------------------------


def count_round_trips(db_url, models_path, key, n, metering):
    """Child-process harness: return ``{mode: {"statements", "round_trips", "transactions"}}``
    per request, averaged over ``n`` requests after one warm-up request each."""
    import sqlalchemy as sa

    from gateway import create_app

    app = create_app(
        {
            "database_url": db_url,
            "models": models_path,
            "log_requests": False,
            "key_cache_ttl_s": 3600,
            "maintenance_poll_s": 3600,
            "sweep_interval_s": 0,
            "metering": metering,
        }
    )
    # Every engine the app talks to Postgres through: its own, and the ledger's, whose
    # admissions and settlements go through raw DBAPI connections (no SQLAlchemy cursor events):
    # everything is counted from libpq's protocol trace of each connection.
    services = app.extensions["kiln"]
    ledger_store = getattr(services.ledger, "store", None)
    engines = [app.extensions["kiln.engine"]] + ([ledger_store.engine] if ledger_store else [])
    traces = []

    def _trace(dbapi_conn, _record):
        trace = tempfile.TemporaryFile()
        dbapi_conn.pgconn.trace(trace.fileno())
        traces.append(trace)

    for engine in engines:
        sa.event.listen(engine, "connect", _trace)
        engine.dispose()  # connections made from now on are traced
    client = app.test_client()
    headers = {"Authorization": f"Bearer {key}"}
    results = {}
    for mode, body in MODES.items():
        assert client.post("/v1/chat/completions", json=body, headers=headers).status_code == 200
        services.ledger.drain(30)
        before = _wire_counts(traces)
        for _ in range(n):
            resp = client.post("/v1/chat/completions", json=body, headers=headers)
            assert resp.status_code == 200, resp.data
            resp.get_data()
        services.ledger.drain(30)  # the settlements are written after the answers
        after = _wire_counts(traces)
        results[mode] = {k: (after[k] - before[k]) / n for k in after}
    return results


def _wire_counts(traces):
    """Count, over every traced connection: ``statements`` (the client's Query and Execute
    messages), ``round_trips`` (the server's ReadyForQuery, one per exchange) and
    ``transactions`` (ReadyForQuery with status idle: each ends one, explicit or implicit;
    PostgreSQL manual, "Message Formats")."""
    total = {"statements": 0, "round_trips": 0, "transactions": 0}
    for trace in traces:
        trace.seek(0)
        for line in trace.read().split(b"\n"):
            if b"\tReadyForQuery\t" in line:
                total["round_trips"] += 1
                total["transactions"] += line.rstrip().endswith(b"I")
            elif line.startswith(b"F\t") or b"\tF\t" in line[:40]:
                total["statements"] += b"\tQuery\t" in line or b"\tExecute\t" in line
    return total


def round_trips_in_child(db_url, models_path, key, n):
    """Return ``{metering: {mode: counts}}`` from the harness, run in a gevent-patched child."""
    trips = {}
    for metering in (True, False):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--_round-trips",
                db_url,
                models_path,
                key,
                str(n),
                str(metering),
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
        )
        if out.returncode != 0:
            raise SystemExit(f"round-trip harness failed:\n{out.stderr}")
        trips[metering] = json.loads(out.stdout.strip().splitlines()[-1])
    return trips


# -- the run ---------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell")
    p.add_argument("--duration", type=int, default=8, help="seconds of wrk per measurement")
    p.add_argument("--connections", type=int, default=16, help="wrk connections")
    p.add_argument("--workers", type=int, default=2, help="gunicorn workers per gateway")
    p.add_argument("--chunks", type=int, default=16, help="content chunks per stream")
    p.add_argument("--requests", type=int, default=200, help="requests for the round-trip count")
    return p.parse_args(argv)


# Gateways measured side by side: (label, metering, extra libpq options on the gateway's URL).
# "on, async commit" is metering with synchronous_commit=off for the gateway's sessions, an
# operator's option (a Postgres crash may lose the last ~0.6 s of commits, never corrupt them);
# it shows how much of the cost is the WAL flush of the two commits.
VARIANTS = (("on", True, None), ("on, async commit", True, "-csynchronous_commit%3Doff"),
            ("off", False, None))


def main(argv=None):
    args = parse_args(argv)
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed (apt-get install wrk)")
    name = f"kiln_bench_metering_{os.getpid()}"
    upstream, upstream_url = start_upstream(args.chunks)
    gateways = {}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        models = Path(tmp) / "models.toml"
        models.write_text(CATALOG.format(url=upstream_url))
        try:
            db_url, key = create_database(name)
            trips = round_trips_in_child(db_url, str(models), key, args.requests)
            for label, metering, options in VARIANTS:
                url = db_url + (f"?options={options}" if options else "")
                gateways[label] = start_gateway(
                    {"KILN_DATABASE_URL": url, "KILN_MODELS": str(models),
                     "KILN_METERING": str(metering).lower()}, args.workers)
            cells = measure(args, gateways, key)
            probe = commit_latency(db_url)
        finally:
            for proc, _url in gateways.values():
                stop(proc)
            stop(upstream)
            drop_database(name)
    print(report(args, cells, trips, probe))


def measure(args, gateways, key):
    """Run every (mode, variant) cell ``args.rounds`` times, interleaved; return the results."""
    cells = {}
    for _round in range(args.rounds):
        for mode, body in MODES.items():
            for label, (_proc, url) in gateways.items():
                result = run_wrk(url, key, body, args.duration, args.connections)
                cells.setdefault((mode, label), []).append(result)
                print(f"  {mode:<10} metering {label:<17} {result['rps']:8.1f} req/s  "
                      f"p50 {result['p50_ms']:7.2f} ms  p99 {result['p99_ms']:7.2f} ms  "
                      f"errors {result['errors']} {' '.join(result['error_lines'])}",
                      file=sys.stderr, flush=True)
    return cells


def report(args, cells, trips, probe):
    """Return the side-by-side table (medians over the rounds)."""
    lines = [f"Kiln metering on Postgres vs off: wrk -c{args.connections}, {args.duration} s x "
             f"{args.rounds} interleaved rounds, {args.workers} gevent workers, one org, medians",
             "",
             f"{'mode':<11}{'metering':<18}{'req/s':>8}{'vs off':>8}{'p50 ms':>9}{'p99 ms':>9}"
             f"{'errors':>7}{'SQL stmts':>10}{'round trips':>12}{'txns':>6}  (DB per request)"]
    for mode in MODES:
        off = statistics.median(r["rps"] for r in cells[(mode, "off")])
        for label, metering, _options in VARIANTS:
            runs = cells[(mode, label)]
            med = {k: statistics.median(r[k] for r in runs) for k in ("rps", "p50_ms", "p99_ms")}
            db = trips[metering][mode]
            lines.append(f"{mode:<11}{label:<18}{med['rps']:>8.1f}{med['rps'] / off:>8.2f}"
                         f"{med['p50_ms']:>9.2f}{med['p99_ms']:>9.2f}"
                         f"{sum(r['errors'] for r in runs):>7}{db['statements']:>10.2f}"
                         f"{db['round_trips']:>12.2f}{db['transactions']:>6.2f}")
    lines += ["",
              f"DB columns: measured in-process (Flask test client under gevent), {args.requests} "
              "requests per mode, key and maintenance caches warm, every settlement written; "
              "statements, round trips and transactions from libpq's protocol trace of every "
              "connection (pool pings included).",
              f"This Postgres: a bare round trip (SELECT 1) {probe[0]:.3f} ms; a durable one-row "
              f"commit {probe[1]:.3f} ms (WAL flush). Admission and settlement of one org both "
              "update its balance row, whose lock is held until the commit is flushed: one "
              "org's throughput is bounded by about 1 / (2 x commit time)."]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_round-trips":
        from gevent import monkey

        monkey.patch_all()
        sys.path.insert(0, str(ROOT))
        db, models_path, bench_key, count, on = sys.argv[2:7]
        print(json.dumps(count_round_trips(db, models_path, bench_key, int(count), on == "True")))
    else:
        sys.path.insert(0, str(ROOT))
        main()
