"""Migrations that do not stop traffic (docs/RELIABILITY.md): an upgrade from the previous
release to head on a database of a running gateway's size, while key checks and usage-event
writes go on from other connections, makes none of them wait on a lock for a second.

The previous release is revision 0008: the head of the last release before this round of issues
(0009 to 0013, the endpoint of each usage event, stored responses, grants that are amounts,
``org_read`` and the rollup per endpoint, all merged together on 2026-12-01), and the schema the
deployed gateways run on when an operator runs ``kiln db upgrade`` for this release
(deploy/RUNBOOK.md, "Upgrade with a migration").

Deterministic, not timed: every checking connection runs with ``lock_timeout = '1s'``, so a
lock wait longer than a second is an error (SQLSTATE 55P03), which the test counts, and must
count none. A long report holds a read lock on ``api_keys`` from before the upgrade until the
upgrade has been seen waiting on it and 20 key checks have ended since: a migration that queued
for its lock for longer than a moment would queue every key check behind it.
"""
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.script import ScriptDirectory

from gateway.api.auth import hash_key
from gateway.ops.cli_db import alembic_config
from gateway_proc import create_database, drop_database

pytestmark = pytest.mark.postgres

KILN = str(Path(sys.executable).with_name("kiln"))
PREVIOUS_RELEASE = "0008"
ORGS, KEYS, EVENTS = 20, 600, 300_000
LOCK_NOT_AVAILABLE = "55P03"
CHECKS_WHILE_BLOCKED = 20

FILL = [
    f"INSERT INTO orgs (name) SELECT 'upgrade-org-' || i FROM generate_series(1, {ORGS}) i",
    # Every tenth key has a model allow-list and every seventh a spend limit: 0012 backfills
    # those (org_read false).
    f"""INSERT INTO api_keys (org_id, prefix, key_hash, name, allowed_models, limit_usd,
                              limit_reset)
        SELECT o.id, 'kiln-m' || lpad(i::text, 6, '0'),
               encode(sha256(convert_to('upgrade-key-' || i, 'UTF8')), 'hex'), 'key ' || i,
               CASE WHEN i % 10 = 0 THEN 'fake-model' END,
               CASE WHEN i % 7 = 0 THEN 5 END, CASE WHEN i % 7 = 0 THEN 'monthly' END
          FROM generate_series(0, {KEYS - 1}) i
          JOIN (SELECT id, row_number() OVER (ORDER BY id) - 1 AS n FROM orgs) o
            ON o.n = i % {ORGS}""",
    # 30 days of settled events, spread over every key.
    f"""WITH k AS (SELECT id, org_id, row_number() OVER (ORDER BY id) - 1 AS n FROM api_keys)
        INSERT INTO usage_events (id, org_id, api_key_id, model, backend, stream, status,
                                  prompt_tokens, completion_tokens, cost_nanos, hold_nanos,
                                  http_status, started_at, ended_at)
        SELECT 'gen-' || lpad(to_hex(i), 24, '0'), k.org_id, k.id, 'fake-model',
               'http://backend.example/v1', i % 2 = 0, 'completed', 100, 20, 1000 + i % 7, 5000,
               200, now() - (i % 43200) * interval '1 minute',
               now() - (i % 43200) * interval '1 minute' + interval '1 second'
          FROM generate_series(0, {EVENTS - 1}) i JOIN k ON k.n = i % {KEYS}""",
    """INSERT INTO usage_daily (org_id, day, model, api_key_id, requests, errors, prompt_tokens,
                                cached_tokens, completion_tokens, cost_nanos)
       SELECT org_id, CAST(started_at AT TIME ZONE 'UTC' AS date), model, api_key_id, count(*),
              0, sum(prompt_tokens), 0, sum(completion_tokens), sum(cost_nanos)
         FROM usage_events GROUP BY 1, 2, 3, 4""",
    "ANALYZE",
]
# The gateway's key lookup (gateway/api/auth.py ``lookup``) without ``org_read``, which the
# previous release's schema lacks until 0012 adds it.
KEY_CHECK = sa.text("""
    SELECT k.id, k.prefix, k.revoked_at, k.allowed_models, k.limit_usd, k.limit_reset,
           k.rpm_limit, o.id AS org_id, o.status, o.in_flight_limit
      FROM api_keys k JOIN orgs o ON o.id = k.org_id WHERE k.key_hash = :h""")
# What admission writes: a pending usage event (the columns of both schemas).
EVENT_WRITE = sa.text("""
    INSERT INTO usage_events (id, org_id, api_key_id, model, stream, status, started_at)
    SELECT :gid, org_id, id, 'fake-model', true, 'pending', now() FROM api_keys
     WHERE key_hash = :h""")


@pytest.fixture
def previous_release():
    """A database at the previous release's head with 20 orgs, 600 keys, 300k usage events and
    their daily rollup; its URL."""
    name = f"kiln_upgrade_{uuid.uuid4().hex[:10]}"
    url = create_database(name)
    command.upgrade(alembic_config(url), PREVIOUS_RELEASE)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        for statement in FILL:
            conn.execute(sa.text(statement))
    engine.dispose()
    yield url
    drop_database(name)


class Checker(threading.Thread):
    """Runs one statement in a loop on its own connection (autocommit, ``lock_timeout`` 1 s)
    until stopped: keeps the end time of every statement that ran and every lock timeout."""

    def __init__(self, url, run):
        super().__init__(daemon=True)
        self.engine = sa.create_engine(url, isolation_level="AUTOCOMMIT",
                                       connect_args={"options": "-c lock_timeout=1s"})
        self.run_once, self.stop = run, threading.Event()
        self.ended, self.lock_timeouts, self.errors = [], [], []

    def run(self):
        with self.engine.connect() as conn:
            i = 0
            while not self.stop.is_set():
                i += 1
                try:
                    self.run_once(conn, i)
                except sa.exc.OperationalError as err:
                    if getattr(err.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                        raise
                    self.lock_timeouts.append(time.monotonic())
                except Exception as err:  # noqa: BLE001 - reported by the test
                    self.errors.append(repr(err))
                    return
                else:
                    self.ended.append(time.monotonic())
        self.engine.dispose()


def key_check(conn, i):
    key = f"upgrade-key-{i % KEYS}"
    row = conn.execute(KEY_CHECK, {"h": hash_key(key)}).one()
    assert row.prefix == "kiln-m" + str(i % KEYS).zfill(6)


def event_write(conn, i):
    conn.execute(EVENT_WRITE, {"gid": "gen-live-" + uuid.uuid4().hex[:20],
                               "h": hash_key(f"upgrade-key-{i % KEYS}")})


class LongReport(threading.Thread):
    """A report over the keys in one transaction (a read lock on ``api_keys``), open from before
    the upgrade until the upgrade has been seen waiting on it and ``CHECKS_WHILE_BLOCKED`` key
    checks have ended (or failed) since; or until ``done`` is set."""

    def __init__(self, url, checks, done):
        super().__init__(daemon=True)
        self.engine = sa.create_engine(url)
        self.checks, self.done = checks, done
        self.holding, self.blocked_seen = threading.Event(), None

    def run(self):
        with self.engine.connect() as report, self.engine.connect() as watch:
            with report.begin():
                report.execute(sa.text("SELECT count(*) FROM api_keys")).scalar_one()
                me = report.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
                self.holding.set()
                while not self.done.is_set() and self.blocked_seen is None:
                    if watch.execute(sa.text(
                            "SELECT count(*) FROM pg_stat_activity "
                            "WHERE :me = ANY(pg_blocking_pids(pid))"), {"me": me}).scalar_one():
                        self.blocked_seen = len(self.checks.ended) + len(
                            self.checks.lock_timeouts)
                    watch.commit()
                    time.sleep(0.01)
                while not self.done.is_set() and len(self.checks.ended) + len(
                        self.checks.lock_timeouts) < self.blocked_seen + CHECKS_WHILE_BLOCKED:
                    time.sleep(0.01)
        self.engine.dispose()


def test_an_upgrade_from_the_previous_release_makes_no_key_check_wait_a_second(previous_release):
    url = previous_release
    keys, writes = Checker(url, key_check), Checker(url, event_write)
    upgraded = threading.Event()
    report = LongReport(url, keys, upgraded)
    keys.start(), writes.start(), report.start()
    assert report.holding.wait(60)
    began = time.monotonic()
    upgrade = subprocess.run([KILN, "db", "upgrade"], capture_output=True, text=True,
                             timeout=600, env={**os.environ, "KILN_DATABASE_URL": url})
    finished = time.monotonic()
    upgraded.set()
    report.join(60)
    for checker in (keys, writes):
        checker.stop.set()
        checker.join(60)
    assert upgrade.returncode == 0, upgrade.stdout + upgrade.stderr
    assert report.blocked_seen is not None, "the upgrade never waited on the report's lock"
    # It gave up its place in the queue at least once, and was tried again (migrations/env.py).
    assert "lock was not granted within 500ms" in upgrade.stderr, upgrade.stderr
    assert keys.errors == [] and writes.errors == []
    assert keys.lock_timeouts == [], f"{len(keys.lock_timeouts)} key checks waited 1 s"
    assert writes.lock_timeouts == [], f"{len(writes.lock_timeouts)} event writes waited 1 s"
    during = [t for t in keys.ended if began < t < finished]
    assert len(during) >= CHECKS_WHILE_BLOCKED, len(during)
    assert any(began < t < finished for t in writes.ended)
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar_one() \
            == ScriptDirectory.from_config(alembic_config(url)).get_current_head()
        assert conn.execute(sa.text("SELECT count(*) FROM usage_events WHERE endpoint = 'chat' "
                                    "AND status = 'completed'")).scalar_one() == EVENTS
        restricted = conn.execute(sa.text(
            "SELECT count(*) FROM api_keys WHERE NOT org_read")).scalar_one()
        assert restricted == sum(1 for i in range(KEYS) if i % 10 == 0 or i % 7 == 0)
    engine.dispose()
