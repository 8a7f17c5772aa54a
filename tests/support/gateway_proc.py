"""Run the real gateway for tests: gunicorn with gevent workers, from deploy/gunicorn.conf.py.

Also helpers for the database side of tests (orgs, keys, credits) through the gateway's own
functions, so tests set up state exactly as an operator would.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import requests
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[2]  # the repository
PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


# How long a worker keeps the maintenance switch it read (KILN_MAINTENANCE_POLL_S): a request
# that reaches a worker this long after a switch has committed sees it.
MAINTENANCE_POLL_S = 0.5


def free_port():
    """Return a free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    """A gunicorn master serving ``gateway.wsgi:app`` on a free loopback port."""

    def __init__(self, env, workers=2, log_path=None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.metrics_dir = tempfile.mkdtemp(prefix="kiln-metrics-")
        self.env = {**os.environ, **{k: str(v) for k, v in env.items()},
                    "KILN_BIND": f"127.0.0.1:{self.port}", "KILN_WORKERS": str(workers),
                    "PROMETHEUS_MULTIPROC_DIR": self.metrics_dir}
        self.log_path = log_path or tempfile.mktemp(prefix="kiln-gunicorn-", suffix=".log")
        self.proc = None

    def start(self, timeout_s=30):
        """Start gunicorn and wait until ``/healthz`` answers on every worker's socket."""
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", str(ROOT / "deploy" / "gunicorn.conf.py"),
             "gateway.wsgi:app"], cwd=ROOT, env=self.env, stdout=self._log,
            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()  # closes the log file
                raise RuntimeError(f"gunicorn exited: {self.log()}")
            try:
                if requests.get(self.base_url + "/healthz", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"gunicorn did not become healthy: {self.log()}")

    def worker_pids(self):
        """Return the pids of the gunicorn workers (children of the master)."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def log(self):
        """Return the gunicorn log so far."""
        return Path(self.log_path).read_text(errors="replace")

    def log_events(self, **fields):
        """The JSON lines of the log (``{"event": ...}``) whose members equal ``fields``."""
        out = []
        for line in self.log().splitlines():
            start = line.find('{"event"')
            if start < 0:
                continue
            try:
                obj = json.loads(line[start:])
            except ValueError:
                continue
            if all(obj.get(k) == v for k, v in fields.items()):
                out.append(obj)
        return out

    def signal(self, sig):
        self.proc.send_signal(sig)

    def stop(self, timeout_s=30):
        """Stop gracefully (SIGTERM), then kill if needed."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()


def create_database(name):
    """(Re)create Postgres database ``name``; return its SQLAlchemy URL."""
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"


def drop_database(name):
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def migrate(url):
    """Build the schema with the project's alembic migrations."""
    from alembic import command

    from gateway.ops.cli_db import alembic_config
    command.upgrade(alembic_config(url), "head")


@dataclass
class Org:
    """A test org with a key: ``id``, ``name``, ``key`` (in clear)."""

    id: int
    name: str
    key: str

    @property
    def headers(self):
        return {"Authorization": f"Bearer {self.key}"}


def make_org(engine, name, usd="10", limit=None):
    """Create org ``name`` with ``usd`` credits (a SQL grant) and one key."""
    from gateway.api import auth
    from gateway.models import orgs
    with engine.begin() as conn:
        org_id = conn.execute(orgs.insert().values(name=name, in_flight_limit=limit)
                              .returning(orgs.c.id)).scalar_one()
        if usd is not None and str(usd) != "0":
            conn.execute(sa.text("INSERT INTO credit_grants (org_id, amount_usd, note) "
                                 "VALUES (:o, CAST(:a AS NUMERIC(20, 9)), 'test')"),
                         {"o": org_id, "a": str(usd)})
        key = auth.create_key(conn, org_id, name="test")
    return Org(org_id, name, key)


def balance_nanos(engine, org_id, settled=True, timeout_s=15.0):
    """Return ``(balance_nanos, held_nanos, in_flight)`` of an org.

    With ``settled``, first wait (up to ``timeout_s``) until the org has no pending usage event:
    a generation's settlement commits just after its reply is written (README, "Metering").
    """
    if settled:
        _wait_quietly(lambda: _pending(engine, "org_id", org_id) == 0, timeout_s)
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT balance_nanos, held_nanos, in_flight FROM "
                                   "credit_balances WHERE org_id = :o"), {"o": org_id}).first()
    return tuple(row)


def _pending(engine, column, value):
    with engine.connect() as conn:
        return conn.execute(sa.text(f"SELECT count(*) FROM usage_events WHERE {column} = :v "
                                    f"AND status = 'pending'"), {"v": value}).scalar_one()


def _wait_quietly(predicate, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)


def usage_event(engine, gid, settled=True, timeout_s=15.0):
    """Return the usage-event row ``gid`` as a mapping, or None.

    With ``settled``, first wait (up to ``timeout_s``) until it exists and is not pending.
    """
    if settled:
        _wait_quietly(lambda: _pending(engine, "id", gid) == 0 and _exists(engine, gid),
                      timeout_s)
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT * FROM usage_events WHERE id = :g"),
                           {"g": gid}).mappings().first()
    return dict(row) if row else None


def settled_event(engine, gid, timeout_s=10.0):
    """Return the usage event ``gid`` once it is final (not pending), as a mapping; raise
    AssertionError if it is not within ``timeout_s``."""
    return wait_until(lambda: (e := usage_event(engine, gid)) and e["status"] != "pending" and e,
                      timeout_s=timeout_s)


def _exists(engine, gid):
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT 1 FROM usage_events WHERE id = :g"),
                            {"g": gid}).first() is not None


def metric(base_url, name, **labels):
    """The value of one series in ``/metrics`` (None when absent)."""
    text = requests.get(base_url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_until(predicate, timeout_s=10.0, interval_s=0.05):
    """Poll ``predicate`` until it returns a truthy value; return it, or raise AssertionError."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        time.sleep(interval_s)


def gateway_env(pg_url, catalog_path, **overrides):
    # No active probe unless a test asks (test_fleet.py): its GETs would be among the
    # requests a test reads back from the fake upstream.
    env = {"KILN_DATABASE_URL": pg_url, "KILN_MODELS": str(catalog_path),
           "KILN_KEY_CACHE_TTL_S": "1", "KILN_MAINTENANCE_POLL_S": str(MAINTENANCE_POLL_S),
           "KILN_PROBE_INTERVAL_S": "0"}
    env.update({f"KILN_{k.upper()}": str(v) for k, v in overrides.items()})
    return env
