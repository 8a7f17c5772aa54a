"""The ledger when the database fails (README "Metering"; docs/METERING.md, "When the usage
event is final"), on a Postgres cluster of the test's own (``tests/support/pg_cluster.py``:
made with ``pg_createcluster``, stopped and crashed with ``pg_ctlcluster``):

- Postgres stopped while generations finish: every settlement is retried until it commits, with
  the real usage; ``kiln credits reconcile`` is clean afterwards.
- Postgres crashed (immediate stop) while generations settle and kept down while more finish:
  brought back, every settlement has committed exactly once (events, balance, daily rollup).
- Under load, a worker killed with SIGKILL and Postgres restarted in immediate mode (a crash)
  mid-run: every generation id a client saw, answered or cut by the kill, has exactly one usage
  event, whose cost is the one the client was told; the gateway's own sweeper closes the killed
  worker's; no balance is below zero, no lease is left, and reconciliation is clean.
"""
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pytest
import requests
import sqlalchemy as sa

from factories import MESSAGES
from fake_upstream import Gate, chat_chunk, chat_completion, json_reply, make_usage, sse
from gateway.models import in_flight
from gateway_proc import Gateway, balance_nanos, make_org, migrate, wait_until
from pg_cluster import Cluster

pytestmark = pytest.mark.postgres

KILN = str(Path(sys.executable).with_name("kiln"))


@pytest.fixture
def cluster():
    c = Cluster()
    try:
        c.start()
    except subprocess.CalledProcessError as err:
        c.destroy()
        raise AssertionError(f"the test cluster did not start: {err.stderr}") from err
    engine = sa.create_engine(c.url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text("CREATE DATABASE kiln"))
    engine.dispose()
    c.db_url = c.url.rsplit("/", 1)[0] + "/kiln"
    migrate(c.db_url)
    yield c
    c.destroy()


@pytest.fixture
def db(cluster):
    engine = sa.create_engine(cluster.db_url, pool_pre_ping=True)
    yield engine
    engine.dispose()


def gateway_on(cluster, catalog_path, **env):
    settings = {"KILN_DATABASE_URL": cluster.db_url, "KILN_MODELS": str(catalog_path),
                "KILN_KEY_CACHE_TTL_S": "30"}
    settings.update({f"KILN_{k.upper()}": str(v) for k, v in env.items()})
    return Gateway(settings, workers=2).start()


def reconcile(cluster):
    env = {"KILN_DATABASE_URL": cluster.db_url, "PATH": "/usr/bin:/bin"}
    return subprocess.run([KILN, "credits", "reconcile"], env=env, capture_output=True,
                          text=True, timeout=60)


def events(db, gids):
    with db.connect() as conn:
        rows = conn.execute(sa.text("SELECT * FROM usage_events WHERE id = ANY(:g)"),
                            {"g": list(gids)}).mappings().all()
    return {r["id"]: dict(r) for r in rows}


def test_settlements_wait_out_a_stopped_database(cluster, db, catalog_path, fake):
    """20 streams finish while Postgres is stopped for 5 s: all are settled once it returns,
    each with the usage its backend reported (12 prompt, 3 completion tokens). The streams
    end only once the database is down (the fake holds them until then), whatever the time
    the cluster takes to stop."""
    gw = gateway_on(cluster, catalog_path)
    try:
        org = make_org(db, f"outage-{uuid.uuid4().hex[:8]}", limit=20)
        usage = make_usage(prompt=12, completion=3)
        database_down = threading.Event()
        first, *rest = sse([chat_chunk("a"), chat_chunk("b"), chat_chunk("c", finish_reason="stop"),
                            chat_chunk(choices=False, usage=usage)])[1:]
        fake.default = lambda record: [*sse([])[:1], first, Gate(database_down), *rest]
        results = []

        def stream():
            r = requests.post(gw.base_url + "/v1/chat/completions", headers=org.headers,
                              timeout=60, json={"model": "fake-model", "messages": MESSAGES,
                                                "stream": True})
            results.append((r.headers["X-Neocloud-Generation-Id"], r.text))
        threads = [threading.Thread(target=stream) for _ in range(20)]
        for t in threads:
            t.start()
        wait_until(lambda: fake.active == 20, timeout_s=30)
        cluster.stop()  # the streams finish while the database is gone
        database_down.set()
        for t in threads:
            t.join(60)
        assert len(results) == 20 and all(t.endswith("data: [DONE]\n\n") for _, t in results)
        time.sleep(5)
        cluster.start()
        gids = [gid for gid, _ in results]
        settled = wait_until(lambda: (e := events(db, gids)) and len(e) == 20 and all(
            v["status"] != "pending" for v in e.values()) and e, timeout_s=60)
        assert {(v["status"], v["prompt_tokens"], v["completion_tokens"], v["estimated"])
                for v in settled.values()} == {("completed", 12, 3, False)}
        assert {v["cost_nanos"] for v in settled.values()} == {2_100}  # 1.2 + 0.9 µ$
        assert "settlement of" in gw.log()  # the retries were logged
        check = reconcile(cluster)
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        gw.stop()


def test_settlements_are_retried_across_a_database_crash_and_commit_once(cluster, db,
                                                                          catalog_path, fake):
    """20 streams; half are let finish and Postgres is crashed at once (``pg_ctlcluster stop -m
    immediate``: no shutdown checkpoint, recovery replays the WAL), so that their settlements
    may commit before it, be cut mid-statement or mid-commit, or not reach it; the other half
    finish while it is down. Brought back, every usage event is settled exactly once
    with the usage its backend reported, and the balance and the daily rollup are exact."""
    gw = gateway_on(cluster, catalog_path)
    try:
        org = make_org(db, f"crash-settle-{uuid.uuid4().hex[:8]}", limit=20)
        usage = make_usage(prompt=12, completion=3)
        gates = [threading.Event() for _ in range(2)]
        for i in range(20):
            status, first, *rest = sse([chat_chunk("a"), chat_chunk("b", finish_reason="stop"),
                                        chat_chunk(choices=False, usage=usage)])
            fake.enqueue([status, first, Gate(gates[i % 2]), *rest])
        results = []

        def stream():
            r = requests.post(gw.base_url + "/v1/chat/completions", headers=org.headers,
                              timeout=120, json={"model": "fake-model", "messages": MESSAGES,
                                                 "stream": True})
            results.append((r.headers["X-Neocloud-Generation-Id"], r.text))
        threads = [threading.Thread(target=stream) for _ in range(20)]
        for t in threads:
            t.start()
        wait_until(lambda: fake.active == 20, timeout_s=30)
        gates[0].set()
        cluster.crash()  # while the first half settle
        gates[1].set()   # the second half finish with the database gone
        for t in threads:
            t.join(120)
        assert len(results) == 20 and all(t.endswith("data: [DONE]\n\n") for _, t in results)
        wait_until(lambda: "settlement of" in gw.log(), timeout_s=30)  # retried while down
        cluster.start()
        gids = [gid for gid, _ in results]
        settled = wait_until(lambda: (e := events(db, gids)) and len(e) == 20 and all(
            v["status"] != "pending" for v in e.values()) and e, timeout_s=120)
        assert {(v["status"], v["prompt_tokens"], v["completion_tokens"], v["cost_nanos"])
                for v in settled.values()} == {("completed", 12, 3, 2_100)}  # 1.2 + 0.9 µ$
        assert balance_nanos(db, org.id) == (10 * 10**9 - 20 * 2_100, 0, 0)
        with db.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM in_flight WHERE org_id = :o"),
                                {"o": org.id}).scalar_one() == 0
            assert tuple(conn.execute(sa.text(
                "SELECT sum(requests), sum(completion_tokens), sum(cost_nanos) FROM usage_daily "
                "WHERE org_id = :o"), {"o": org.id}).one()) == (20, 60, 20 * 2_100)
        check = reconcile(cluster)
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        gw.stop()


def client_load(gw, orgs, stop, seen, sent):
    """Requests in a loop until ``stop``: streams and JSON. Record each in ``seen`` as
    ``(kind, gid, status, detail)``: ``answered`` (read whole; detail: the cost it was told),
    ``cut`` (the connection broke after the id header arrived: a killed worker's),
    ``refused`` (no id: refused before admission; detail: the error code) or ``lost``; and in
    ``sent``, each generation id's ``(client port of its connection, monotonic time sent)``:
    a keep-alive connection stays with the worker that accepted it, so the port names it."""
    session = requests.Session()
    i = 0
    while not stop.is_set():
        org = orgs[i % len(orgs)]
        stream = i % 2 == 0
        i += 1
        r = None
        sent_at = time.monotonic()
        try:
            r = session.post(gw.base_url + "/v1/chat/completions", headers=org.headers,
                             timeout=30, stream=True,
                             json={"model": "fake-model", "messages": MESSAGES,
                                   "stream": stream, "max_tokens": 20,
                                   **({"stream_options": {"include_usage": True}}
                                      if stream else {})})
            _note_connection(r, sent_at, sent)
            text = r.text
        except requests.RequestException:
            gid = r.headers.get("X-Neocloud-Generation-Id") if r is not None else None
            seen.append(("cut", gid, None, None) if gid else ("lost", None, None, None))
            continue
        gid = r.headers.get("X-Neocloud-Generation-Id")
        if gid is None:  # 503 while the database was down or busy, 429
            seen.append(("refused", None, r.status_code, _error_code(text)))
        else:
            seen.append(("answered", gid, r.status_code, _told_cost(text, stream)))


def _error_code(text):
    try:
        return json.loads(text)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _told_cost(text, stream):
    """The ``usage.cost`` an answer told the client (exact), or None if it saw none."""
    try:
        if not stream:
            return Decimal(str(json.loads(text, parse_float=Decimal)["usage"]["cost"]))
        lines = [json.loads(line[6:], parse_float=Decimal) for line in text.splitlines()
                 if line.startswith("data: {")]
        if text.endswith("data: [DONE]\n\n") and lines and lines[-1].get("usage"):
            return lines[-1]["usage"]["cost"]
    except (ValueError, KeyError, TypeError):
        pass
    return None


def _note_connection(r, sent_at, sent):
    gid = r.headers.get("X-Neocloud-Generation-Id")
    sock = getattr(r.raw.connection, "sock", None)
    if gid and sock is not None:
        sent[gid] = (sock.getsockname()[1], sent_at)


def busiest_worker(gw):
    """Return the pid of the worker holding the most client connections (``ss -p``), and the
    client ports of its connections: the clients' keep-alive connections stay with one
    worker, so it is serving some right now."""
    out = subprocess.run(["ss", "-Htnp", "state", "established", f"sport = :{gw.port}"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    held = [(int(pid), int(port)) for port, pid in
            re.findall(r"\S+:\d+\s+\S+:(\d+)\s+users:\(\(.*?pid=(\d+)", out)]
    workers = gw.worker_pids()
    pid = max(workers, key=[p for p, _ in held].count)
    return pid, {port for p, port in held if p == pid}


def test_money_stays_exact_through_a_killed_worker_and_a_database_crash(
        cluster, db, catalog_path, fake):
    """Six clients in a loop; a worker killed (SIGKILL) while it serves some of them, then
    Postgres crashed and restarted (``pg_ctlcluster restart -m immediate``). Nothing is swept by
    hand: the gateway's own sweeper closes the killed worker's generations."""
    gw = gateway_on(cluster, catalog_path, lease_ttl_s=3, sweep_interval_s=1)
    try:
        orgs = [make_org(db, f"crash-{i}-{uuid.uuid4().hex[:6]}", limit=4) for i in range(3)]
        fake.default = lambda record: (
            sse([chat_chunk("x"), chat_chunk("y"), chat_chunk("z", finish_reason="stop"),
                 chat_chunk(choices=False, usage=make_usage(9, 3))], delay_s=0.15)
            if (record.json or {}).get("stream") else
            json_reply(chat_completion("xy", usage=make_usage(9, 2))))
        stop, seen, sent = threading.Event(), [], {}
        clients = [threading.Thread(target=client_load, args=(gw, orgs, stop, seen, sent))
                   for _ in range(6)]
        for t in clients:
            t.start()
        time.sleep(3)
        pid, ports = busiest_worker(gw)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        time.sleep(2)
        cluster.crash_and_restart()
        time.sleep(4)
        stop.set()
        for t in clients:
            t.join(60)
        _assert_faults_hit(seen)
        # The killed worker's generations: sent before the kill on a connection it held.
        killed = {gid for gid, (port, at) in list(sent.items())
                  if port in ports and at < killed_at}
        _assert_every_answer_has_one_event(db, seen, killed)
        # The gateway's own sweeper, none run by hand; it logs just after its commit, which
        # the wait above may have seen first.
        wait_until(lambda: "sweeper closed" in gw.log(), timeout_s=10)
        with db.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM in_flight")).scalar_one() == 0
            assert conn.execute(sa.text(
                "SELECT count(*) FROM credit_balances WHERE balance_nanos < 0")).scalar_one() == 0
        check = reconcile(cluster)
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        gw.stop()


def _assert_faults_hit(seen):
    """The kill cut answers that had begun; during the restart, admissions were refused with
    503 (the database unreachable or its connections all busy)."""
    kinds = [kind for kind, *_ in seen]
    assert kinds.count("answered") > 50, kinds
    assert kinds.count("cut") >= 1, "the kill cut no stream that had its id"
    codes = {(status, code) for kind, _, status, code in seen if kind == "refused"}
    assert codes & {(503, "database_unavailable"), (503, "database_busy")}, codes
    # Settlements in flight when the database went down are retried, when there were any:
    # settlement follows its answer by milliseconds, so a restart may find none (the
    # stopped-database test above holds settlements through an outage on purpose).


def _assert_every_answer_has_one_event(db, seen, killed):
    """Every generation id a client saw has exactly one final usage event: the cost it was
    told, if it was told one, unless it is one of the ``killed`` worker's generations and its
    settlement had not committed (docs/METERING.md: then the sweeper's, ``abandoned``); only
    the killed worker's generations may be cut or abandoned."""
    gids = [gid for _, gid, _, _ in seen if gid]
    assert len(set(gids)) == len(gids)
    found = wait_until(lambda: (e := events(db, gids)) and len(e) == len(gids) and all(
        v["status"] != "pending" for v in e.values()) and e, timeout_s=30)
    with db.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM usage_events WHERE id = ANY(:g)"),
                            {"g": gids}).scalar_one() == len(gids)
    for kind, gid, status, cost in seen:
        if gid is None:
            continue
        # An answer whose worker was killed in the milliseconds before its settlement
        # committed is the sweeper's (docs/METERING.md, "When the usage event is final").
        if found[gid]["status"] == "abandoned" or kind == "cut":
            assert gid in killed, (kind, found[gid])
        elif kind == "answered" and status == 200 and cost is not None:
            assert Decimal(found[gid]["cost_nanos"]) / 10**9 == cost, found[gid]
    cut = [found[gid] for kind, gid, _, _ in seen if kind == "cut"]
    assert {e["status"] for e in cut} <= {"abandoned", "completed"}, cut
    abandoned = [e for e in cut if e["status"] == "abandoned"]
    assert abandoned and {e["error_code"] for e in abandoned} == {"lease_expired"}, cut


# -- the ledger's statements, both dialects, without HTTP --------------------------------------

@pytest.fixture(params=["postgres", "sqlite"])
def ledger_db(request, pg_url, tmp_path):
    """A migrated database of each dialect, with an org ($1) and its key."""
    from gateway.config import Config
    from gateway.db import create_engine
    from gateway.ledger import Ledger
    url = pg_url if request.param == "postgres" else f"sqlite:///{tmp_path}/ledger.db"
    if request.param == "sqlite":
        migrate(url)
    config = Config.from_mapping({"database_url": url, "lease_ttl_s": 60})
    engine = sa.create_engine(url)
    org = make_org(engine, f"ledger-{uuid.uuid4().hex[:8]}", usd="1")
    with engine.connect() as conn:
        key_id = conn.execute(sa.text("SELECT id FROM api_keys WHERE org_id = :o"),
                              {"o": org.id}).scalar_one()
    ledger = Ledger(create_engine(config, ledger=True), config, CATALOG_PRICES)
    yield ledger, engine, org, key_id
    # A test may end with a generation still admitted: close it as the sweeper would once its
    # worker is gone, so `kiln credits reconcile` run by a later test finds every org settled.
    with engine.begin() as conn:
        conn.execute(in_flight.update().where(in_flight.c.org_id == org.id)
                     .values(expires_at=datetime.now(timezone.utc) - timedelta(minutes=1)))
    while ledger.sweep(org_id=org.id):
        pass
    assert _lease_state(engine, org, key_id)[1] == 0
    ledger.store.engine.dispose()
    engine.dispose()


class _Entry:  # the catalog entry's prices the sweeper bills with (USD per 1M tokens)
    def __init__(self, prices):
        from gateway.contract.catalog import Pricing
        self.pricing = Pricing(*map(Decimal, prices))


CATALOG_PRICES = {"fake-model": _Entry(("0.10", "0.05", "0.30"))}


def _admit(ledger, org, key_id, hold=1_000_000, key_checks=False):
    from gateway.ledger import AdmissionRequest
    return ledger.store.admit_once(AdmissionRequest(
        gid="gen-" + uuid.uuid4().hex[:24], org_id=org.id, key_id=key_id, model="fake-model",
        stream=True, hold_nanos=hold, in_flight_limit=8, lease_ttl_s=60,
        key_checks=key_checks))[0]


def _settlement(gid, org, key_id, prompt, completion, cost):
    from gateway.billing import Usage
    from gateway.ledger import Settlement
    return Settlement(gid=gid, org_id=org.id, key_id=key_id, model="fake-model", stream=True,
                      status="completed", usage=Usage(prompt=prompt, completion=completion),
                      cost_nanos=cost)


def test_a_cost_above_the_hold_is_debited_only_as_far_as_the_keys_limit(ledger_db):
    """A key's spend limit is a cap, like the org's balance: a backend that reports more than
    the hold is billed its hold plus what the limit leaves beyond the key's other holds."""
    ledger, engine, org, key_id = ledger_db  # the org has $1
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE api_keys SET limit_usd = 0.005 WHERE id = :k"),
                     {"k": key_id})
    first = _admit(ledger, org, key_id, hold=1_000_000, key_checks=True)  # $0.001 each
    second = _admit(ledger, org, key_id, hold=1_000_000, key_checks=True)
    # The first's backend reported $0.01: its hold, plus the $0.003 the limit leaves beyond
    # both holds. The second, within its hold, is debited in full.
    over = ledger.store.settle_batch([_settlement(first, org, key_id, 10, 33_000, 10_000_000)])
    assert over == {first: 4_000_000}
    within = ledger.store.settle_batch([_settlement(second, org, key_id, 1, 1, 400)])
    assert within == {second: 400}
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT period_spent_nanos, held_nanos FROM api_keys "
                                    "WHERE id = :k"), {"k": key_id}).one() == (4_000_400, 0)
        assert conn.execute(sa.text("SELECT balance_nanos FROM credit_balances WHERE "
                                    "org_id = :o"), {"o": org.id}).scalar_one() == \
            10**9 - 4_000_400
        assert conn.execute(sa.text("SELECT anomaly FROM usage_events WHERE id = :g"),
                            {"g": first}).scalar_one()


def test_a_late_real_settlement_corrects_the_sweepers_guess(ledger_db):
    """The sweeper closed a generation whose worker was only slow (its lease expired during a
    database outage): the worker's real settlement, arriving later, replaces the guess, and the
    balance, the key's spend and the daily rollup move by the difference."""
    ledger, engine, org, key_id = ledger_db
    gid = _admit(ledger, org, key_id)
    with engine.begin() as conn:  # progress recorded by a renewal, then the lease expired
        conn.execute(sa.text("UPDATE usage_events SET prompt_tokens = 10, completion_tokens = 1 "
                             "WHERE id = :g"), {"g": gid})
        conn.execute(sa.text("UPDATE in_flight SET expires_at = :t WHERE generation_id = :g"),
                     {"t": "2000-01-01 00:00:00+00", "g": gid})
    assert ledger.sweep(org_id=org.id) == 1
    # the guess: 10 × 0.10 + 1 × 0.30 = 1.3 micro-dollars, the progress recorded
    assert _event(engine, gid)[:2] == ("abandoned", 1_300)
    assert _counted_by(engine, gid) == ("progress", "progress")
    real = _settlement(gid, org, key_id, 12, 40, 13_200)
    real.usage = dataclasses.replace(real.usage, prompt_by="bound", completion_by="tokenizer")
    debited = ledger.store.settle_batch([real])
    assert debited == {gid: 13_200}
    assert _event(engine, gid) == ("completed", 13_200, 12, 40)
    assert _counted_by(engine, gid) == ("bound", "tokenizer")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT balance_nanos, held_nanos, in_flight FROM "
                                    "credit_balances WHERE org_id = :o"), {"o": org.id}
                            ).one() == (10**9 - 13_200, 0, 0)
        assert conn.execute(sa.text(
            "SELECT requests, errors, prompt_tokens, completion_tokens, cost_nanos "
            "FROM usage_daily WHERE org_id = :o"), {"o": org.id}).one() == (1, 0, 12, 40, 13_200)
        assert conn.execute(sa.text("SELECT period_spent_nanos FROM api_keys WHERE id = :k"),
                            {"k": key_id}).scalar_one() == 13_200
    # settled once: a second delivery of the same settlement changes nothing
    assert ledger.store.settle_batch([_settlement(gid, org, key_id, 99, 99, 99_999)]) == {}
    assert _event(engine, gid) == ("completed", 13_200, 12, 40)


def _counted_by(engine, gid):
    """Which count the event bills, prompt and completion (docs/METERING.md)."""
    with engine.connect() as conn:
        return tuple(conn.execute(sa.text(
            "SELECT prompt_counted_by, completion_counted_by FROM usage_events WHERE id = :g"),
            {"g": gid}).one())


def test_two_sweepers_at_once_close_each_generation_once(ledger_db):
    """Every worker runs a sweeper: two sweeping the same expired leases at the same moment
    close each generation once (one debit, one row of activity), on both dialects."""
    from gateway.db import create_engine
    from gateway.ledger import Ledger
    ledger, engine, org, key_id = ledger_db
    gids = [_admit(ledger, org, key_id) for _ in range(8)]  # the in-flight limit
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE usage_events SET prompt_tokens = 10 WHERE org_id = :o"),
                     {"o": org.id})
        conn.execute(sa.text("UPDATE in_flight SET expires_at = :t"),
                     {"t": "2000-01-01 00:00:00+00"})
    other = Ledger(create_engine(ledger.config, ledger=True), ledger.config, CATALOG_PRICES)
    start, closed = threading.Barrier(2), []

    def sweep(one):
        start.wait()
        closed.append(one.sweep(org_id=org.id))

    threads = [threading.Thread(target=sweep, args=(one,)) for one in (ledger, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    other.store.engine.dispose()
    assert sum(closed) == len(gids)
    with engine.connect() as conn:  # 10 prompt tokens at 0.10 USD per 1M: 1,000 nano-dollars
        assert conn.execute(sa.text("SELECT balance_nanos, held_nanos, in_flight FROM "
                                    "credit_balances WHERE org_id = :o"), {"o": org.id}
                            ).one() == (10**9 - 8 * 1_000, 0, 0)
        assert conn.execute(sa.text("SELECT requests, errors, cost_nanos FROM usage_daily "
                                    "WHERE org_id = :o"), {"o": org.id}).one() == (8, 8, 8_000)


def test_an_admission_lost_in_a_crash_is_written_by_its_settlement(ledger_db):
    ledger, engine, org, key_id = ledger_db
    gid = "gen-" + uuid.uuid4().hex[:24]  # never admitted: the database lost it
    debited = ledger.store.settle_batch([_settlement(gid, org, key_id, 5, 5, 2_000)])
    assert debited == {gid: 2_000} and _event(engine, gid) == ("completed", 2_000, 5, 5)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT balance_nanos, held_nanos, in_flight FROM "
                                    "credit_balances WHERE org_id = :o"), {"o": org.id}
                            ).one() == (10**9 - 2_000, 0, 0)



def test_a_settlements_texts_reach_the_database_verbatim(ledger_db):
    """A backend's error text is data, whatever it holds: quotes, backslashes, dollar quotes,
    a semicolon and a COMMIT of its own (on Postgres the settlement's batch is bound into the
    query's text by the client: ``PostgresStore.settle_batch``)."""
    ledger, engine, org, key_id = ledger_db
    gid = _admit(ledger, org, key_id)
    error = "it's a \\ back%slash {x} ü 🙂 \"q\" $$ $1 ; COMMIT; SELECT 1; -- \n\t end"
    settlement = _settlement(gid, org, key_id, 10, 0, 1_000)
    settlement.status, settlement.http_status, settlement.error = "error", 502, error
    assert ledger.store.settle_batch([settlement]) == {gid: 1_000}
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT error FROM usage_events WHERE id = :g"),
                            {"g": gid}).scalar_one() == error

def _event(engine, gid):
    with engine.connect() as conn:
        return tuple(conn.execute(sa.text(
            "SELECT status, cost_nanos, prompt_tokens, completion_tokens FROM usage_events "
            "WHERE id = :g"), {"g": gid}).one())


def test_a_settlement_the_database_refuses_does_not_hold_up_the_others(ledger_db):
    """One settlement whose values the database refuses (a backend URL longer than its column:
    Postgres refuses it, SQLite keeps any length) is written again within the columns, and the
    settlements queued with it commit: the worker goes on settling (docs/RELIABILITY.md)."""
    ledger, engine, org, key_id = ledger_db
    gids = [_admit(ledger, org, key_id) for _ in range(3)]
    settlements = [_settlement(gid, org, key_id, 10, 20, 7_000) for gid in gids]
    settlements[1].backend = "http://backend.example/v1/" + "a" * 600
    for settlement in settlements:
        ledger.settle(settlement)
    assert ledger.drain(10), "the worker's settlements are stuck"
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, status, cost_nanos, backend FROM usage_events "
                                    "WHERE org_id = :o"), {"o": org.id}).mappings().all()
        balance = conn.execute(sa.text("SELECT balance_nanos, held_nanos, in_flight FROM "
                                       "credit_balances WHERE org_id = :o"),
                               {"o": org.id}).one()
    assert {r["id"]: (r["status"], r["cost_nanos"]) for r in rows} == \
        {gid: ("completed", 7_000) for gid in gids}
    long_one = next(r for r in rows if r["id"] == gids[1])
    assert long_one["backend"].startswith("http://backend.example/v1/aaa")
    assert balance == (10**9 - 3 * 7_000, 0, 0)


@pytest.mark.parametrize("amount", ["'12abc'", "1e-10", "0", "'0.0000000001'", "-0.0000000004"])
def test_the_database_refuses_a_grant_that_is_not_an_amount(ledger_db, amount):
    """Plain SQL cannot credit text that is not a number (SQLite kept '12abc' as text and its
    trigger credited $12) nor an amount that rounds to zero nano-dollars (migration 0011)."""
    _, engine, org, _ = ledger_db
    with pytest.raises(sa.exc.DBAPIError):
        with engine.begin() as conn:
            conn.execute(sa.text(f"INSERT INTO credit_grants (org_id, amount_usd) "
                                 f"VALUES (:o, {amount})"), {"o": org.id})
    with engine.begin() as conn:  # one nano-dollar is an amount
        conn.execute(sa.text("INSERT INTO credit_grants (org_id, amount_usd) "
                             "VALUES (:o, 0.000000001)"), {"o": org.id})
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT balance_nanos FROM credit_balances WHERE "
                                    "org_id = :o"), {"o": org.id}).scalar_one() == 10**9 + 1


def test_a_keys_in_flight_cap_counts_its_leases_and_every_ending_releases_one(ledger_db):
    """A key capped at 2 in flight (its org at 8): a third admission is refused
    ``key_in_flight`` and leaves nothing; a settlement gives a slot back; leases expired (a
    dead worker's) are released by the sweeper, through the same settlement."""
    ledger, engine, org, key_id = ledger_db
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE api_keys SET in_flight_limit = 2 WHERE id = :k"),
                     {"k": key_id})
    first, second = (_admit(ledger, org, key_id, key_checks=True) for _ in range(2))
    assert first and second
    before = _lease_state(engine, org, key_id)
    third = _admit_row(ledger, org, key_id)
    assert (third[0], third[2], third[4]) == (None, "key_in_flight", 2)
    assert _lease_state(engine, org, key_id) == before == (2, 2)
    assert ledger.store.settle_batch([_settlement(first, org, key_id, 1, 1, 400)])
    again = _admit(ledger, org, key_id, key_checks=True)
    assert again and _admit_row(ledger, org, key_id)[2] == "key_in_flight"
    with engine.begin() as conn:
        conn.execute(in_flight.update().where(in_flight.c.api_key_id == key_id)
                     .values(expires_at=datetime.now(timezone.utc) - timedelta(minutes=1)))
    refused = _admit_row(ledger, org, key_id)
    assert refused[2] == "key_in_flight" and refused[5] is True  # expired leases seen
    assert ledger.sweep(org_id=org.id) == 2
    assert _lease_state(engine, org, key_id) == (0, 0)
    assert _admit(ledger, org, key_id, key_checks=True)


def _admit_row(ledger, org, key_id):
    from gateway.ledger import AdmissionRequest
    return ledger.store.admit_once(AdmissionRequest(
        gid="gen-" + uuid.uuid4().hex[:24], org_id=org.id, key_id=key_id, model="fake-model",
        stream=True, hold_nanos=1_000_000, in_flight_limit=8, lease_ttl_s=60, key_checks=True))


def _lease_state(engine, org, key_id):
    """``(the key's lease rows, the org's in-flight count)``."""
    with engine.connect() as conn:
        leases = conn.execute(sa.select(sa.func.count()).select_from(in_flight)
                              .where(in_flight.c.api_key_id == key_id)).scalar_one()
        count = conn.execute(sa.text("SELECT in_flight FROM credit_balances WHERE org_id = :o"),
                             {"o": org.id}).scalar_one()
    return leases, count


def test_a_settlement_frees_the_orgs_row_before_its_flush_and_returns_once_durable(cluster):
    """The org's next admission never waits for a settlement's WAL flush, and the writer hears
    of a settlement only once it is durable. Made certain with a cluster whose durable commits
    wait forever (``synchronous_standby_names`` names a standby that never connects: each
    commit that waits for its flush then also waits for that standby, PostgreSQL manual,
    "Synchronous Replication"): the settlement is visible and the org's next admission is
    decided while ``settle_batch`` is still waiting, and it returns once the standby is no
    longer waited for."""
    from gateway.config import Config
    from gateway.db import create_engine
    from gateway.ledger import Ledger
    admin = sa.create_engine(cluster.url, isolation_level="AUTOCOMMIT")
    engine = sa.create_engine(cluster.db_url)
    config = Config.from_mapping({"database_url": cluster.db_url, "lease_ttl_s": 60})
    ledger = Ledger(create_engine(config, ledger=True), config, CATALOG_PRICES)

    def wait_for_absent_standby(on):
        with admin.connect() as conn:
            conn.execute(sa.text("ALTER SYSTEM SET synchronous_standby_names = "
                                 + ("'kiln_absent_standby'" if on else "''")))
            conn.execute(sa.text("SELECT pg_reload_conf()"))
        time.sleep(0.5)  # the reload reaches every backend at its next command
    try:
        org = make_org(engine, f"flush-{uuid.uuid4().hex[:8]}", usd="1")
        with engine.connect() as conn:
            key_id = conn.execute(sa.text("SELECT id FROM api_keys WHERE org_id = :o"),
                                  {"o": org.id}).scalar_one()
        gid = _admit(ledger, org, key_id)
        wait_for_absent_standby(True)
        returned = {}
        writer = threading.Thread(target=lambda: returned.setdefault(
            "debited", ledger.store.settle_batch([_settlement(gid, org, key_id, 5, 5, 2_000)])))
        writer.start()
        settled = wait_until(lambda: _event(engine, gid)[0] == "completed", timeout_s=10)
        assert settled and "debited" not in returned  # visible, not yet reported durable
        admitted = {}
        admission = threading.Thread(target=lambda: admitted.setdefault(
            "gid", _admit(ledger, org, key_id)))
        admission.start()
        admission.join(10)
        assert admitted.get("gid", "").startswith("gen-"), "the admission waited for a flush"
        writer.join(2)
        assert writer.is_alive() and "debited" not in returned
        wait_for_absent_standby(False)
        writer.join(20)
        assert returned["debited"] == {gid: 2_000}
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT balance_nanos, in_flight FROM credit_balances "
                                        "WHERE org_id = :o"), {"o": org.id}).one() == \
                (10**9 - 2_000, 1)
    finally:
        wait_for_absent_standby(False)
        ledger.store.engine.dispose()
        engine.dispose()
        admin.dispose()
