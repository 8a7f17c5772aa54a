"""Graceful stop and reload of real gunicorn with streams in flight: running streams finish whole,
new connections are served (after HUP by the new workers), and every admitted request ends with
a final usage event — the books balance (``balance = Σ grants − Σ costs``) afterwards. A worker
that stops (TERM, or replaced by HUP) with settlements still queued in its settlement writer
commits them before it exits."""
import functools
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import requests
import sqlalchemy as sa
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from fake_upstream import default_script
from gateway.ledger.reconcile import reconcile
from gateway_proc import balance_nanos, make_org, wait_until

pytestmark = pytest.mark.postgres

CHUNKS, CHUNK_DELAY_S = 20, 0.15  # a three-second stream
CLOSE = {"Connection": "close"}
BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "Count slowly"}]}


class StreamClient(threading.Thread):
    """One streaming request read to its end in a thread: ``events`` (data payloads as bytes),
    ``gid``, ``error``; ``started`` is set at the first content event."""

    def __init__(self, gw, org):
        super().__init__(daemon=True)
        self.url, self.headers = gw.base_url + "/v1/chat/completions", {**org.headers, **CLOSE}
        self.events, self.gid, self.error = [], None, None
        self.started = threading.Event()

    def run(self):
        try:
            with requests.post(self.url, json={**BODY, "stream": True}, headers=self.headers,
                               stream=True, timeout=60) as resp:
                self.gid = resp.headers["X-Neocloud-Generation-Id"]
                for line in resp.iter_lines():
                    if line.startswith(b"data: "):
                        self.events.append(line[len(b"data: "):])
                        self.started.set()
        except requests.RequestException as err:
            self.error = err
        self.started.set()

    def content_deltas(self):
        chunks = [json.loads(e) for e in self.events if e != b"[DONE]"]
        return [c["choices"][0]["delta"]["content"] for c in chunks
                if c.get("choices") and c["choices"][0]["delta"].get("content")]


def open_streams(gw, org, n):
    """Start ``n`` streams and return them once each has relayed its first content event."""
    streams = [StreamClient(gw, org) for _ in range(n)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(60) and s.error is None, s.error
    assert not any(s.events[-1:] == [b"[DONE]"] for s in streams), "streams ended too soon"
    return streams


def assert_whole(streams):
    for s in streams:
        s.join(60)
        assert not s.is_alive() and s.error is None, s.error
        assert s.events[-1] == b"[DONE]", s.events[-3:]
        assert len(s.content_deltas()) == CHUNKS


def assert_books_balance(engine, org, admitted):
    """Every admitted request has a final usage event; the org reconciles exactly."""
    # A live worker commits a settlement just after its answer has left (docs/METERING.md):
    # first wait (bounded) until the org has no pending event.
    balance_nanos(engine, org.id)
    with engine.connect() as conn:
        events = conn.execute(sa.text("SELECT id, status, cost_nanos, completion_tokens "
                                      "FROM usage_events WHERE org_id = :o"),
                              {"o": org.id}).all()
    assert {e.id for e in events} == set(admitted)
    assert all(e.status != "pending" for e in events), [e.status for e in events]
    row = next(r for r in reconcile(engine)[0] if r.name == org.name)
    assert row.verdict == "ok" and row.leases == 0 and row.held_usd == 0
    assert row.balance_usd == row.grants_usd - row.costs_usd
    return events


@pytest.fixture
def slow_streams(fake):
    fake.default = functools.partial(default_script, chunks=CHUNKS, delay_s=CHUNK_DELAY_S)
    return fake


def refused(url):
    try:
        requests.get(url, headers=CLOSE, timeout=5)
    except requests.ConnectionError:
        return True
    return False


def test_sigterm_lets_running_streams_finish_and_settles_every_one(start_gateway, slow_streams,
                                                                    engine):
    gw = start_gateway(workers=2, graceful_timeout=30)
    org = make_org(engine, "graceful-term")
    streams = open_streams(gw, org, 6)
    gw.signal(signal.SIGTERM)
    # The listener closes at once (new connections are refused) while the streams go on.
    wait_until(lambda: refused(gw.base_url + "/healthz"), timeout_s=30)
    assert_whole(streams)
    assert gw.proc.wait(60) == 0
    events = assert_books_balance(engine, org, [s.gid for s in streams])
    assert {e.status for e in events} == {"completed"} and all(e.cost_nanos > 0 for e in events)
    assert "Worker graceful timeout" not in gw.log()


def listening_pids(port):
    """Return the pids holding the listening socket on ``port`` (``ss -p``)."""
    out = subprocess.run(["ss", "-Htlnp", f"sport = :{port}"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return {int(pid) for pid in re.findall(r"pid=(\d+)", out)}


def per_worker_requests(gw, pids):
    """Return kiln_requests_total summed over the samples that the workers ``pids`` wrote."""
    with tempfile.TemporaryDirectory() as only:
        for pid in pids:
            for path in Path(gw.metrics_dir).glob(f"*_{pid}.db"):
                shutil.copy(path, only)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=only)
        return sum(s.value for family in registry.collect() for s in family.samples
                   if s.name == "kiln_requests_total")


def test_hup_serves_new_connections_with_new_workers_while_old_streams_finish(
        start_gateway, slow_streams, engine):
    gw = start_gateway(workers=2, graceful_timeout=30)
    org = make_org(engine, "graceful-hup")
    streams = open_streams(gw, org, 6)
    old = set(gw.worker_pids())
    gw.signal(signal.SIGHUP)
    new = wait_until(lambda: (pids := set(gw.worker_pids()) - old) and len(pids) == 2 and pids,
                     timeout_s=60, interval_s=0.1)
    # The old workers close their copy of the listening socket within a second of the TERM
    # the master sends them (gevent worker loop); from then on only new workers accept.
    wait_until(lambda: not old & listening_pids(gw.port), timeout_s=30, interval_s=0.1)
    fresh = [requests.post(gw.base_url + "/v1/chat/completions", json=BODY,
                           headers={**org.headers, **CLOSE}, timeout=60) for _ in range(8)]
    assert [r.status_code for r in fresh] == [200] * 8
    assert_whole(streams)
    wait_until(lambda: not old & set(gw.worker_pids()), timeout_s=60, interval_s=0.1)
    # Counted per worker (prometheus-client keeps one file per pid): the new connections
    # went to the new workers only; the old ones served nothing but their streams.
    assert per_worker_requests(gw, new) == 8
    assert per_worker_requests(gw, old) == 6
    assert_books_balance(engine, org, [s.gid for s in streams] +
                         [r.headers["X-Neocloud-Generation-Id"] for r in fresh])
    assert gw.proc.poll() is None  # the master stayed up throughout


def kiln(pg_url, catalog_path, *args):
    env = {"PATH": "/usr/bin:/bin", "KILN_DATABASE_URL": pg_url, "KILN_MODELS": str(catalog_path)}
    command = [str(Path(sys.executable).with_name("kiln")), *args]  # the venv's console script
    return subprocess.run(command, env=env, check=True, capture_output=True, text=True,
                          timeout=60).stdout


def test_a_stream_longer_than_the_graceful_timeout_is_ended_told_and_billed(
        start_gateway, slow_streams, engine, pg_url, catalog_path):
    """A stream still running near the graceful timeout is ended by its worker before the
    master's kill: the client gets an error event (no ``[DONE]``), and the usage event is settled
    by the worker with the tokens relayed. The lease TTL is the default minute, so no sweep can
    be what bills it."""
    slow_streams.default = functools.partial(default_script, chunks=200, delay_s=0.1)
    gw = start_gateway(workers=1, graceful_timeout=4)
    org = make_org(engine, "graceful-cut")
    stream, = open_streams(gw, org, 1)
    gw.signal(signal.SIGTERM)
    stream.join(60)
    assert not stream.is_alive()
    assert b"[DONE]" not in stream.events
    relayed = len(stream.content_deltas())
    assert 0 < relayed < 200
    error = json.loads(stream.events[-1])["error"]
    assert error["code"] == "server_shutting_down" and "restarting" in error["message"]
    assert "stream relay failed" not in gw.log()  # Kiln's decision, not a failure of it
    assert gw.proc.wait(60) == 0  # the master itself stops cleanly
    assert "Worker graceful timeout" not in gw.log()  # ended before gunicorn had to kill
    assert _settled(engine, stream.gid) == "interrupted"  # the operator's stop, not an error
    with engine.connect() as conn:  # the activity rollup counts the request, not as an error
        assert conn.execute(sa.text("SELECT requests, errors FROM usage_daily WHERE org_id = :o"),
                            {"o": org.id}).one() == (1, 0)
    event, = assert_books_balance(engine, org, [stream.gid])
    # One token per relayed delta at least (Kiln's own count errs upward), at the fake's
    # literal price of 300 nano-dollars per completion token.
    assert event.completion_tokens >= relayed
    assert event.cost_nanos >= relayed * 300


def _settled(engine, gid):
    """Return the usage event's status once it is final, else None."""
    with engine.connect() as conn:
        status = conn.execute(sa.text("SELECT status FROM usage_events WHERE id = :g"),
                              {"g": gid}).scalar_one()
    return None if status == "pending" else status


def test_an_idle_keep_alive_connection_does_not_hold_a_stop(start_gateway, fake):
    """nginx keeps idle connections to gunicorn open (its upstream keepalive pool). A stopping
    gevent worker waits for them until gunicorn's ``keepalive`` expires, with its listener
    already closed; so that wait must be short (nginx's own idle timeout is shorter still)."""
    gw = start_gateway(workers=1)
    with requests.Session() as idle:
        assert idle.get(gw.base_url + "/healthz", timeout=30).status_code == 200
        gw.signal(signal.SIGTERM)
        # Generous bound: gunicorn's keepalive (5 s) plus slack; not the 60 s of nginx's old
        # idle timeout, nor the 120 s graceful timeout.
        assert gw.proc.wait(30) == 0


# -- the settlement writer drains before a worker exits (deploy/gunicorn.conf.py, worker_exit) ---

def _locked_balance(engine, org):
    """Lock the org's balance row in an open transaction (a slow database, as a settlement
    sees it): settlements wait for it, queued in the worker's writer. Return the connection;
    its ``rollback()`` releases the lock."""
    conn = engine.connect()
    conn.execute(sa.text("SELECT balance_nanos FROM credit_balances WHERE org_id = :o "
                         "FOR UPDATE"), {"o": org.id})
    return conn


def _statuses(engine, gids):
    with engine.connect() as conn:
        return sorted(conn.execute(sa.text("SELECT status FROM usage_events WHERE id = ANY(:g)"),
                                   {"g": list(gids)}).scalars())


def _answered_with_settlements_outstanding(gw, engine, org):
    """Run four streams to their end while their settlements are held back by a lock on the
    org's balance row; return the streams' ids and the lock's connection."""
    streams = open_streams(gw, org, 4)  # admitted: admission locks the same row
    lock = _locked_balance(engine, org)
    assert_whole(streams)  # each answer waited KILN_SETTLE_WAIT_S, then went out
    gids = [s.gid for s in streams]
    assert _statuses(engine, gids) == ["pending"] * 4  # outstanding in the writer
    return gids, lock


def test_sigterm_waits_for_the_settlement_writer_to_commit(start_gateway, slow_streams, engine):
    """A worker stopped with settlements still queued commits them before it exits (the lease
    TTL is the default minute: no sweeper is what settles them)."""
    gw = start_gateway(workers=1, graceful_timeout=30, settle_wait_s=0.2, settle_drain_s=30)
    org = make_org(engine, "graceful-drain-term")
    gids, lock = _answered_with_settlements_outstanding(gw, engine, org)
    try:
        gw.signal(signal.SIGTERM)
        wait_until(lambda: refused(gw.base_url + "/healthz"), timeout_s=30)
        time.sleep(2)
        assert gw.proc.poll() is None, "the worker exited with settlements queued"
        assert _statuses(engine, gids) == ["pending"] * 4
    finally:
        lock.rollback()
        lock.close()
    assert gw.proc.wait(30) == 0
    assert _statuses(engine, gids) == ["completed"] * 4  # committed before the exit
    assert_books_balance(engine, org, gids)
    assert "settlements still queued at exit" not in gw.log()


def test_a_worker_replaced_by_hup_commits_its_queued_settlements(start_gateway, slow_streams,
                                                                   engine):
    gw = start_gateway(workers=1, graceful_timeout=30, settle_wait_s=0.2, settle_drain_s=30)
    org = make_org(engine, "graceful-drain-hup")
    gids, lock = _answered_with_settlements_outstanding(gw, engine, org)
    old = set(gw.worker_pids())
    try:
        gw.signal(signal.SIGHUP)
        wait_until(lambda: set(gw.worker_pids()) - old, timeout_s=60, interval_s=0.1)
        # The master has told the old worker to stop once it closes its listening socket.
        wait_until(lambda: not old & listening_pids(gw.port), timeout_s=30, interval_s=0.1)
        time.sleep(2)
        assert old <= set(gw.worker_pids()), "the old worker exited with settlements queued"
        assert _statuses(engine, gids) == ["pending"] * 4
    finally:
        lock.rollback()
        lock.close()
    wait_until(lambda: not old & set(gw.worker_pids()), timeout_s=30, interval_s=0.1)
    assert _statuses(engine, gids) == ["completed"] * 4  # committed by the old worker
    assert_books_balance(engine, org, gids)
    assert gw.proc.poll() is None and "settlements still queued at exit" not in gw.log()
