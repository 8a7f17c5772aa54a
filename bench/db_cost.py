#!/usr/bin/env python3
"""What one metered request costs the database, and how 1, 2 and 3 gateway hosts share one.

Starts a Postgres cluster of its own (``initdb`` in a temporary directory, on a free port, with
``pg_stat_statements``; the shared server of the tests would mix other clients into the WAL and
the CPU), optionally pgbouncer in front of it (transaction pooling, as docs/SCALING.md
advises), the fast fake upstream (``bench/fake_openai.py``) and ``--instances`` gateway hosts:
each its own gunicorn master with ``--workers`` gevent workers on its own port
(``deploy/gunicorn.conf.py``), all on the one database. A closed loop of ``--connections``
clients sends metered chat requests (non-stream, then stream with usage) spread over the hosts.

For each run it prints, per request: the statements the gateways sent (``pg_stat_statements``
calls of top-level statements: a ledger function counts once), the commits
(``pg_stat_database.xact_commit``; a batch of admissions or settlements is one), the WAL bytes
written (``pg_current_wal_lsn`` difference), the CPU milliseconds of every Postgres process (the
postmaster's tree: backends, WAL writer, checkpointer) and of every gateway process; and
requests per second. Counts do not depend on how busy the machine is, CPU time little;
requests per second do, so only the ratios of one run compare.

    .venv/bin/python bench/db_cost.py [--instances 1 2 3] [--requests 3000] [--pgbouncer]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

import procstat
import targets as tg
from kiln_target import CATALOG_TEMPLATE as CATALOG
from httpio import chat_body

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
PG_BIN = Path("/usr/lib/postgresql/15/bin")
# The counters read around a run; the reading itself is one statement and one commit, taken
# off the totals.
SNAPSHOT = """SELECT (SELECT sum(calls) FROM pg_stat_statements),
       (SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()),
       pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')"""


class Cluster:
    """A throwaway Postgres cluster: initdb, start on a free port, stop and delete."""

    def __init__(self, workdir: Path):
        self.dir, self.port = workdir / "pg", tg.free_port()
        self.dir.mkdir()
        if os.geteuid() == 0:  # Postgres refuses to run as root: its own system user does
            workdir.chmod(0o711)
            shutil.chown(self.dir, "postgres", "postgres")
        self.log = workdir / "pg" / "server.log"
        pg_run([PG_BIN / "initdb", "-D", self.dir, "-U", "postgres", "-A", "trust"])
        conf = self.dir / "postgresql.conf"
        conf.write_text(conf.read_text() + (
            f"\nport = {self.port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = ''"
            "\nshared_preload_libraries = 'pg_stat_statements'\nmax_connections = 300\n"
            "pg_stat_statements.track = top\nshared_buffers = 256MB\n"))
        pg_run([PG_BIN / "pg_ctl", "-D", self.dir, "-l", self.log, "-w", "start"])
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}"
        self.psql("CREATE DATABASE kiln")
        self.psql("CREATE EXTENSION pg_stat_statements", "kiln")

    @property
    def postmaster(self) -> int:
        return int((self.dir / "postmaster.pid").read_text().split()[0])

    def psql(self, sql: str, database: str = "postgres") -> str:
        done = run(["psql", f"{self.url}/{database}", "-X", "-q", "-A", "-t", "-c", sql])
        return done.stdout.strip()

    def snapshot(self):
        calls, commits, wal = self.psql(SNAPSHOT, "kiln").split("|")
        return {"statements": int(calls or 0), "commits": int(commits), "wal": int(float(wal)),
                "pg_cpu": procstat.cpu_seconds(procstat.process_tree([self.postmaster]))}

    def stop(self):
        pg_run([PG_BIN / "pg_ctl", "-D", self.dir, "-m", "fast", "-w", "stop"], check=False)


def pgbouncer(cluster: Cluster, workdir: Path) -> tuple[tg.Service, int]:
    """pgbouncer in transaction pooling before the cluster; return it and its port."""
    port = tg.free_port()
    ini = workdir / "pgbouncer.ini"
    ini.write_text(f"[databases]\nkiln = host=127.0.0.1 port={cluster.port} dbname=kiln\n"
                   f"[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n"
                   "auth_type = trust\nauth_file = {}\npool_mode = transaction\n"
                   "max_client_conn = 1000\ndefault_pool_size = 40\nunix_socket_dir =\n"
                   .format(workdir / "users.txt"))
    (workdir / "users.txt").write_text('"postgres" ""\n')
    prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    svc = tg.Service("pgbouncer", [*prefix, shutil.which("pgbouncer"), str(ini)], workdir)
    for _ in range(100):
        if subprocess.run(["pg_isready", "-h", "127.0.0.1", "-p", str(port)],
                          capture_output=True).returncode == 0:
            return svc, port
        time.sleep(0.1)
    raise RuntimeError(f"pgbouncer did not start:\n{svc.tail()}")


def pg_run(argv, check=True):
    """Run a Postgres server program as the ``postgres`` system user when this is root."""
    prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    return run([*prefix, *argv], check=check)


def run(argv, check=True, env=None):
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env)
    if check and done.returncode:
        raise RuntimeError(f"{argv[0]} failed: {done.stderr[-800:]}")
    return done


class Gateways:
    """``count`` gunicorn masters on one database, each on its own port."""

    def __init__(self, count: int, workers: int, env: dict, workdir: Path, key: str):
        self.services, self.urls = [], []
        gunicorn = Path(sys.executable).parent / "gunicorn"
        for i in range(count):
            port = tg.free_port()
            argv = [gunicorn, "-c", "deploy/gunicorn.conf.py", "--bind", f"127.0.0.1:{port}",
                    "--workers", str(workers), "gateway.wsgi:app"]
            svc = tg.Service(f"kiln-{count}-{i}", [str(a) for a in argv], workdir, env=env,
                             cwd=REPO_DIR)
            self.services.append(svc)
            tg.wait_http(f"http://127.0.0.1:{port}/v1/models", svc, 120,
                         headers={"Authorization": f"Bearer {key}"})
            self.urls.append(f"http://127.0.0.1:{port}/v1/chat/completions")

    def cpu(self) -> float:
        return procstat.cpu_seconds(procstat.process_tree([s.pid for s in self.services]))

    def stop(self):
        for svc in self.services:
            svc.stop()


def load(urls, key, body: bytes, total: int, connections: int) -> tuple[float, int]:
    """Send ``total`` requests over ``connections`` closed-loop clients spread over ``urls``;
    return (seconds, failures)."""
    left, lock, failures = [total], threading.Lock(), [0]

    def client(i):
        session, url = requests.Session(), urls[i % len(urls)]
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        while True:
            with lock:
                if left[0] == 0:
                    return
                left[0] -= 1
            r = session.post(url, data=body, headers=headers, timeout=60)  # reads it all
            if r.status_code != 200:
                with lock:
                    failures[0] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(connections)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.monotonic() - start, failures[0]


def measure(cluster, gateways, key, args, stream: bool) -> dict:
    body = chat_body(stream, chunks=16, gap_ms=0, latency_ms=0)
    load(gateways.urls, key, body, 200, args.connections)  # warm: pools, caches, first pages
    time.sleep(1)  # settlements of the warm-up commit
    before, cpu_before = cluster.snapshot(), gateways.cpu()
    seconds, failures = load(gateways.urls, key, body, args.requests, args.connections)
    time.sleep(1)  # settlements follow their answers by milliseconds
    after, cpu_after = cluster.snapshot(), gateways.cpu()
    n = args.requests
    return {"rps": n / seconds, "failures": failures,
            "statements": (after["statements"] - before["statements"] - 1) / n,
            "commits": (after["commits"] - before["commits"] - 1) / n,
            "wal_bytes": (after["wal"] - before["wal"]) / n,
            "pg_cpu_ms": (after["pg_cpu"] - before["pg_cpu"]) * 1000 / n,
            "kiln_cpu_ms": (cpu_after - cpu_before) * 1000 / n}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--instances", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--workers", type=int, default=1, help="gevent workers per instance")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--pgbouncer", action="store_true")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kiln-dbcost-"))
    cluster = Cluster(workdir)
    bouncer = None
    try:
        port = cluster.port
        if args.pgbouncer:
            bouncer, port = pgbouncer(cluster, workdir)
        upstream, upstream_svc = tg.start_upstream(workdir, workers=1, gap_ms=0, chunks=16)
        catalog = workdir / "models.toml"
        catalog.write_text(CATALOG.format(upstream_url=upstream.base_url))
        env = dict(os.environ, KILN_MODELS=str(catalog),
                   KILN_DATABASE_URL=f"postgresql+psycopg://postgres@127.0.0.1:{port}/kiln")
        kiln = Path(sys.executable).parent / "kiln"
        run([kiln, "db", "upgrade"], env={**env, "KILN_DATABASE_URL": env[
            "KILN_DATABASE_URL"].replace(str(port), str(cluster.port))})
        run([kiln, "org", "create", "bench", "--limit", "100000"], env=env)
        run([kiln, "credits", "grant", "bench", "1000000"], env=env)
        key = run([kiln, "key", "create", "bench"], env=env).stdout.strip().splitlines()[-1]
        rows = []
        for count in args.instances:
            gateways = Gateways(count, args.workers, env, workdir, key)
            try:
                for stream in (False, True):
                    rows.append((count, "stream" if stream else "json",
                                 measure(cluster, gateways, key, args, stream)))
            finally:
                gateways.stop()
        report(rows, args)
        upstream_svc.stop()
    finally:
        if bouncer:
            bouncer.stop()
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def report(rows, args):
    print(f"\none Postgres{' behind pgbouncer' if args.pgbouncer else ''}, {args.workers} "
          f"worker(s) per gateway host, {args.connections} connections, {args.requests} "
          f"metered requests per row; per request:")
    print(f"{'hosts':>5} {'kind':>6} {'req/s':>8} {'x 1 host':>8} {'stmts':>6} {'commits':>7} "
          f"{'WAL B':>7} {'PG CPU ms':>9} {'Kiln CPU ms':>11} {'failed':>6}")
    base = {kind: m["rps"] for count, kind, m in rows if count == rows[0][0]}
    for count, kind, m in rows:
        print(f"{count:>5} {kind:>6} {m['rps']:>8.0f} {m['rps'] / base[kind]:>8.2f} "
              f"{m['statements']:>6.2f} {m['commits']:>7.2f} {m['wal_bytes']:>7.0f} "
              f"{m['pg_cpu_ms']:>9.3f} {m['kiln_cpu_ms']:>11.3f} {m['failures']:>6}")


if __name__ == "__main__":
    main()
