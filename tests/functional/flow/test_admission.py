"""Admission on Postgres under concurrency and faults (README, "In-flight limit" and "Holds and
settlement"): the in-flight limit is exact across gunicorn processes, leases are released on
every path and reclaimed after a worker dies, holds never let an org spend credits it does not
have, and SQL top-ups lose nothing."""
import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
import requests
import sqlalchemy as sa

from factories import MESSAGES, concurrently, fake_model_nanos
from fake_upstream import (Close, Gate, Hang, Reset, Send, Sleep, Status, chat_chunk,
                           chat_completion, default_script, error_reply, json_reply, sse_event)
from gateway.billing import to_nanos
from gateway_proc import balance_nanos, make_org, usage_event, wait_until

CHAT = "/v1/chat/completions"
SSE_HEAD = Status(200, {"Content-Type": "text/event-stream"})
LIMIT = 8  # KILN_DEFAULT_IN_FLIGHT_LIMIT
KILN = str(Path(sys.executable).with_name("kiln"))
FINAL = {"completed", "client_cancelled", "rejected", "upstream_error", "timeout", "abandoned",
         "error"}


# -- helpers ---------------------------------------------------------------------------------

def post(base_url, org, body, stream=False, timeout=60):
    """POST a chat request; ``body`` is a dict, or bytes sent as they are."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(base_url + CHAT, data=data, stream=stream, timeout=timeout,
                         headers={**org.headers, "Content-Type": "application/json"})


def stream_body(model="fake-model", **extra):
    return {"model": model, "messages": MESSAGES, "stream": True, **extra}


def org_state(engine, org_id):
    """Return ``(lease rows, in_flight counter, held_nanos)`` of an org."""
    with engine.connect() as conn:
        leases = conn.execute(sa.text("SELECT count(*) FROM in_flight WHERE org_id = :o"),
                              {"o": org_id}).scalar_one()
    _balance, held, counter = balance_nanos(engine, org_id, settled=False)
    return leases, counter, held


def quiet(engine, org_id, timeout_s=20):
    """Wait until the org has no lease, no hold and no pending usage event."""
    def check():
        with engine.connect() as conn:
            pending = conn.execute(sa.text("SELECT count(*) FROM usage_events WHERE org_id = :o "
                                           "AND status = 'pending'"), {"o": org_id}).scalar_one()
        return org_state(engine, org_id) == (0, 0, 0) and pending == 0
    wait_until(check, timeout_s=timeout_s)


def events_of(engine, org_id):
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.text(
            "SELECT * FROM usage_events WHERE org_id = :o ORDER BY started_at"),
            {"o": org_id}).mappings()]


def assert_ledger(engine, org_id, grants_nanos):
    """The org's balance is exactly its grants minus the costs of its usage events."""
    costs = sum(e["cost_nanos"] for e in events_of(engine, org_id))
    assert balance_nanos(engine, org_id)[0] == grants_nanos - costs


def assert_eight_then_429(base_url, fake, org, engine):
    """The org can run exactly LIMIT requests at once: all admitted, the next one is 429."""
    for _ in range(LIMIT):
        fake.enqueue([SSE_HEAD, Hang()])
    streams = concurrently(LIMIT, lambda i: post(base_url, org, stream_body(), stream=True))
    try:
        assert [r.status_code for r in streams] == [200] * LIMIT
        wait_until(lambda: fake.active == LIMIT)
        extra = post(base_url, org, stream_body())
        assert extra.status_code == 429
        assert extra.json()["error"]["code"] == "rate_limit_exceeded"
    finally:
        for r in streams:
            r.close()
    quiet(engine, org.id)


def read_until_data(resp, limit=50):
    """Read SSE lines until the first ``data:`` line; return it."""
    lines = resp.iter_lines()
    for _ in range(limit):
        line = next(lines)
        if line.startswith(b"data:"):
            return line
    raise AssertionError("no data line")


# -- the in-flight limit across processes ------------------------------------------------------

def test_200_concurrent_across_two_gateways_never_exceed_the_limit(start_gateway, fake, engine):
    """Two gunicorn masters (two workers each) on one database behave as one gateway: the
    upstream never sees more than 8 of one org's requests; the rest get 429 and leave nothing;
    afterwards no lease remains. Twice in a row, on the same org."""
    gateways = [start_gateway(workers=2), start_gateway(workers=2)]
    org = make_org(engine, f"burst-{uuid.uuid4().hex[:8]}", usd="100")
    fake.default = functools.partial(default_script, hold_s=3.0)
    body = {"model": "fake-model", "messages": MESSAGES, "max_tokens": 16}
    admitted_total = 0
    for _round in range(2):
        # The fake's count of running scripts drops just after each one's last byte (which its
        # client may have read already), and the shared fake may still be ending an earlier
        # test's hung script: start the high-water mark from an idle fake.
        wait_until(lambda: fake.active == 0)
        fake.reset_stats()
        seen = len(fake.requests)
        responses = concurrently(200, lambda i: post(gateways[i % 2].base_url, org, body))
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429}, codes
        admitted = codes.count(200)
        assert LIMIT <= admitted < 200 and fake.max_active == LIMIT
        assert len(fake.requests) - seen == admitted  # every 429 stayed out of the upstream
        for r in responses:
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "rate_limit_exceeded"
                assert not [h for h in r.headers if h.lower().startswith(
                    ("x-ratelimit", "retry-after"))]
        quiet(engine, org.id)
        admitted_total += admitted
        events = events_of(engine, org.id)
        assert len(events) == admitted_total  # a rejected request writes no usage event
        assert {e["status"] for e in events} == {"completed"}
    assert_ledger(engine, org.id, 100 * 10**9)


# -- leases are released on every path ---------------------------------------------------------

def _abort_stream_mid_relay(base_url, fake, org):
    fake.enqueue([SSE_HEAD, Send(sse_event(chat_chunk("a", role="assistant"))), Hang()])
    with post(base_url, org, stream_body(), stream=True) as r:
        assert r.status_code == 200
        read_until_data(r)


def _abort_before_status(base_url, fake, org, stream):
    fake.enqueue([Hang()])  # no status line: the client gives up first
    with pytest.raises(requests.exceptions.ReadTimeout):
        post(base_url, org, stream_body() if stream else {"model": "fake-model",
                                                           "messages": MESSAGES}, timeout=1.0)


def _upstream_fault(base_url, fake, org, script, stream, expect):
    fake.enqueue(script)
    body = stream_body() if stream else {"model": "fake-model", "messages": MESSAGES}
    with post(base_url, org, body, stream=stream) as r:
        assert r.status_code == expect
        if stream and expect == 200:
            text = r.content.decode()
            assert '"error"' in text and "[DONE]" not in text


def _rejected(base_url, org, body, expect):
    r = post(base_url, org, body)
    assert r.status_code == expect and "error" in r.json()


def faults(base_url, fake, org):
    """Every way a request can end badly, each once."""
    chunk = Send(sse_event(chat_chunk("a", role="assistant")))
    _abort_stream_mid_relay(base_url, fake, org)
    _abort_before_status(base_url, fake, org, stream=True)
    _abort_before_status(base_url, fake, org, stream=False)
    _upstream_fault(base_url, fake, org, error_reply(502, "bad gateway", plain=True), False, 502)
    _upstream_fault(base_url, fake, org, error_reply(500, "boom"), True, 502)
    _upstream_fault(base_url, fake, org, error_reply(400, "context too long"), False, 400)
    _upstream_fault(base_url, fake, org, [Reset()], False, 502)
    _upstream_fault(base_url, fake, org, [SSE_HEAD, chunk, Reset()], True, 200)
    _upstream_fault(base_url, fake, org, [SSE_HEAD, chunk, Close()], True, 200)
    # KILN_UPSTREAM_READ_TIMEOUT_S=1 in this gateway: both time out.
    _upstream_fault(base_url, fake, org, [Sleep(3)] + json_reply(chat_completion("late")),
                    False, 502)
    _upstream_fault(base_url, fake, org, [SSE_HEAD, chunk, Sleep(3), chunk], True, 200)
    _rejected(base_url, org, b"{not json", 400)
    _rejected(base_url, org, {"model": "fake-model", "messages": []}, 400)
    _rejected(base_url, org, {"model": "fake-model", "messages": "hi"}, 400)
    _rejected(base_url, org, {"model": "fake-model", "messages": MESSAGES, "stream": "maybe"},
              400)
    _rejected(base_url, org, {"model": "no-such-model", "messages": MESSAGES}, 404)


def test_every_failure_path_releases_its_lease(start_gateway, fake, engine):
    """Aborted streams, upstream 502s, resets, timeouts, invalid bodies, unknown models: after
    them all (twice over) the org still runs 8 at once and the 9th gets 429."""
    gw = start_gateway(workers=2, upstream_read_timeout_s=1)
    org = make_org(engine, f"faults-{uuid.uuid4().hex[:8]}")
    for _round in range(2):
        faults(gw.base_url, fake, org)
    quiet(engine, org.id)
    statuses = {e["status"] for e in events_of(engine, org.id)}
    assert {"client_cancelled", "upstream_error", "timeout"} <= statuses <= FINAL
    assert_eight_then_429(gw.base_url, fake, org, engine)
    assert_ledger(engine, org.id, 10 * 10**9)


# -- a killed worker's leases ------------------------------------------------------------------

def upstream_connections(pids, port):
    """Return ``{pid: number of established TCP connections to 127.0.0.1:port}``."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[2].endswith(f":{port:04X}") and fields[3] == "01":
            inodes.add(f"socket:[{fields[9]}]")
    counts = {}
    for pid in pids:
        fds = Path(f"/proc/{pid}/fd")
        counts[pid] = sum(1 for fd in fds.iterdir() if _readlink(fd) in inodes)
    return counts


def _readlink(path):
    try:
        return os.readlink(path)
    except OSError:
        return None


def test_sigkilled_worker_gives_its_slots_back_within_the_ttl(start_gateway, fake, engine):
    """SIGKILL the worker serving open streams: once the TTL has passed since the kill, the org
    runs 8 at once again, and every killed request has a usage event closed as ``abandoned``
    that bills the tokens its last lease renewal recorded."""
    ttl_s = 3
    gw = start_gateway(workers=2, lease_ttl_s=ttl_s, sweep_interval_s=1)
    org = make_org(engine, f"killed-{uuid.uuid4().hex[:8]}")
    words = [Send(sse_event(chat_chunk(w, role="assistant" if i == 0 else None)))
             for i, w in enumerate(("one", " two", " three"))]
    for _ in range(LIMIT):
        fake.enqueue([SSE_HEAD, *words, Hang()])
    streams = concurrently(LIMIT, lambda i: post(gw.base_url, org, stream_body(), stream=True))
    gids = [r.headers["X-Neocloud-Generation-Id"] for r in streams]
    wait_until(lambda: fake.active == LIMIT)
    # A renewal (every ttl/3) has recorded the three relayed tokens of every stream.
    wait_until(lambda: all(usage_event(engine, g)["completion_tokens"] == 3 for g in gids),
               timeout_s=10)
    held = upstream_connections(gw.worker_pids(), fake.port)
    victim = max(held, key=held.get)
    assert held[victim] >= 1
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    for r in streams:
        r.close()  # the other worker's streams end normally (client_cancelled)
    time.sleep(max(0.0, killed_at + ttl_s - time.monotonic()))
    # The other worker settles its streams once it notices their clients gone: wait for their
    # leases to go, so that only the killed worker's (expired) remain for admission to reclaim.
    wait_until(lambda: live_leases(engine, org.id) == 0, timeout_s=30)
    assert_eight_then_429(gw.base_url, fake, org, engine)
    events = {g: usage_event(engine, g) for g in gids}
    abandoned = [e for e in events.values() if e["status"] == "abandoned"]
    assert len(abandoned) == held[victim]
    assert {e["status"] for e in events.values()} <= {"abandoned", "client_cancelled"}
    for e in abandoned:
        assert e["estimated"] and e["completion_tokens"] == 3 and e["ended_at"] is not None
        # Billed what its last renewal recorded: the estimated prompt and the tokens relayed.
        assert e["prompt_tokens"] > 0
        assert e["cost_nanos"] == fake_model_nanos(prompt=e["prompt_tokens"], completion=3)
        assert "lease expired" in e["error"]
    assert_ledger(engine, org.id, 10 * 10**9)


def test_requests_longer_than_the_ttl_keep_their_lease(start_gateway, fake, engine):
    """A live request renews its lease whatever it waits for (a slow status line, a long
    non-stream answer), so the sweeper never closes it: it completes and is billed in full.
    The backend answers only once the database's clock is past the leases' first expiry and
    two more sweeps: an event, not a sleep, so a slow machine cannot make it pass or fail."""
    ttl_s, sweep_s = 4, 0.5  # renewed every ttl/3: a renewal may run 2.6 s late
    gw = start_gateway(workers=1, lease_ttl_s=ttl_s, sweep_interval_s=sweep_s)
    org = make_org(engine, f"long-{uuid.uuid4().hex[:8]}")
    answer = threading.Event()
    slow_json = [Gate(answer)] + json_reply(chat_completion("slow", usage={
        "prompt_tokens": 7, "completion_tokens": 11, "total_tokens": 18}))
    slow_sse = [Gate(answer), SSE_HEAD, Send(sse_event(chat_chunk("x", role="assistant"))),
                Send(sse_event(chat_chunk(finish_reason="stop"))), Send(b"data: [DONE]\n\n")]
    fake.default = lambda record: slow_sse if (record.json or {}).get("stream") else slow_json
    with ThreadPoolExecutor(1) as pool:
        replies = pool.submit(concurrently, 2, lambda i: post(
            gw.base_url, org, stream_body() if i else {"model": "fake-model",
                                                       "messages": MESSAGES},
            stream=bool(i)))
        first_expiry = wait_until(lambda: lease_expiries(engine, org.id, count=2))
        wait_until(lambda: db_now(engine) > max(first_expiry) + timedelta(seconds=2 * sweep_s),
                   timeout_s=60)
        assert len(lease_expiries(engine, org.id, count=2)) == 2  # renewed, not swept
        answer.set()
        plain, streamed = replies.result(timeout=120)
    assert plain.status_code == 200 and b"[DONE]" in streamed.content
    quiet(engine, org.id)
    events = events_of(engine, org.id)
    assert [e["status"] for e in events] == ["completed", "completed"]
    # 7 prompt and 11 completion tokens of fake-model: 7 x 100 + 11 x 300 nano-dollars.
    assert usage_event(engine, plain.headers["X-Neocloud-Generation-Id"])["cost_nanos"] == 4_000


def live_leases(engine, org_id):
    """The org's leases not yet expired (by the database's clock)."""
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT count(*) FROM in_flight WHERE org_id = :o AND "
                                    "expires_at > CURRENT_TIMESTAMP"), {"o": org_id}).scalar_one()


def lease_expiries(engine, org_id, count):
    """The org's leases' expiry times, once it has ``count`` leases; else None."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT expires_at FROM in_flight WHERE org_id = :o"),
                            {"o": org_id}).scalars().all()
    return rows if len(rows) == count else None


def db_now(engine):
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT CURRENT_TIMESTAMP")).scalar_one()


# -- credit holds --------------------------------------------------------------------------------

# The hold of a fake-vision stream with max_tokens 2000 (README, "Holds and settlement"): its
# 116 body bytes + 8 template tokens per message + 32 per request as prompt tokens, at 1,250
# nano-dollars each (1.25 USD per million), and 2,000 completion tokens at 10,000 each.
VISION_BODY = {"model": "fake-vision", "messages": MESSAGES, "stream": True, "max_tokens": 2000}
VISION_HOLD_NANOS = (116 + 8 + 32) * 1_250 + 2_000 * 10_000  # 20,195,000: $0.020195


def test_holds_above_the_credits_are_all_402_and_never_overdraw(gateway, fake, engine):
    """$0.01 of credits, 100 requests at once whose holds exceed it: all 402, with the
    available amount, the hold and the advice to lower max_tokens; nothing reaches the upstream
    and the balance never moves."""
    org = make_org(engine, f"poor-{uuid.uuid4().hex[:8]}", usd="0.01")
    body = VISION_BODY
    assert len(json.dumps(body).encode()) == 116 and VISION_HOLD_NANOS > 10**7
    seen, stop = [], threading.Event()

    def watch_balance():
        while not stop.is_set():
            seen.append(balance_nanos(engine, org.id, settled=False))
            time.sleep(0.02)
    watcher = threading.Thread(target=watch_balance)
    watcher.start()
    try:
        responses = concurrently(100, lambda i: post(gateway.base_url, org, body))
    finally:
        stop.set()
        watcher.join(10)
    assert [r.status_code for r in responses] == [402] * 100
    error = responses[0].json()["error"]
    assert error["code"] == "insufficient_credits"
    assert "$0.01 available" in error["message"]
    assert "hold of $0.020195," in error["message"]
    assert "max_tokens" in error["message"]
    assert fake.requests == []
    assert seen and all(s == (10**7, 0, 0) for s in seen)
    assert events_of(engine, org.id) == []


def test_credits_for_exactly_three_holds_admit_exactly_three(gateway, fake, engine):
    """Credits of exactly three holds, 100 requests at once while the admitted ones stay
    open: exactly three admitted, 97 get 402; settled, the balance is grants minus costs."""
    body, hold = VISION_BODY, VISION_HOLD_NANOS
    org = make_org(engine, f"three-{uuid.uuid4().hex[:8]}", usd="0.060585")  # 3 holds
    for _ in range(3):
        fake.enqueue([SSE_HEAD, Hang()])
    responses = concurrently(100, lambda i: post(gateway.base_url, org, body, stream=True))
    try:
        codes = [r.status_code for r in responses]
        assert codes.count(200) == 3 and codes.count(402) == 97
        assert balance_nanos(engine, org.id, settled=False) == (3 * hold, 3 * hold, 3)
    finally:
        for r in responses:
            r.close()
    quiet(engine, org.id)
    assert len(events_of(engine, org.id)) == 3
    assert 0 <= balance_nanos(engine, org.id)[0]
    assert_ledger(engine, org.id, 3 * hold)


@pytest.mark.parametrize("stream", [False, True])
def test_back_to_back_requests_at_the_limit_are_never_refused(gateway, fake, engine, stream):
    """Settlement commits just after the answer leaves (docs/METERING.md): an org with a limit
    of one sends its next request the moment each answer ends, on its keep-alive connection as
    the SDKs do (so to the worker that answered, which waits for its own settlement): every one
    is admitted, and the ledger is exact. (On a new connection, another worker waits 20 ms for
    it: best effort, not asserted here.)"""
    org = make_org(engine, f"b2b-{uuid.uuid4().hex[:8]}", limit=1)
    body = {"model": "fake-model", "messages": MESSAGES, "stream": stream, "max_tokens": 8}
    codes = []
    session = requests.Session()
    for _ in range(30):
        r = session.post(gateway.base_url + CHAT, json=body, headers=org.headers, timeout=60)
        codes.append(r.status_code)
        assert r.status_code != 200 or (r.content.endswith(b"data: [DONE]\n\n") if stream
                                        else r.json()["usage"]["cost"] > 0)
    assert codes == [200] * 30
    quiet(engine, org.id)
    assert len(events_of(engine, org.id)) == 30
    assert_ledger(engine, org.id, 10 * 10**9)


# -- top-ups by SQL while requests settle ---------------------------------------------------------

def sql_top_ups(pg_url, org_id, amounts, done):
    """Insert grants with plain SQL on a separate connection, as an admin in psql would."""
    dsn = pg_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for amount in amounts:
            conn.execute("INSERT INTO credit_grants (org_id, amount_usd, note) "
                         "VALUES (%s, %s, 'psql top-up')", (org_id, amount))
            time.sleep(0.01)
    done.set()


def test_sql_top_ups_during_settlements_lose_nothing(gateway, fake, engine, pg_url):
    """100 requests settle while grants are inserted by plain SQL: every grant and every debit
    lands, and ``kiln credits reconcile`` passes."""
    org = make_org(engine, f"topup-{uuid.uuid4().hex[:8]}", usd="1", limit=100)
    fake.default = functools.partial(default_script, hold_s=0.5)
    amounts = [Decimal("0.000000123") * (i + 1) for i in range(40)] + [Decimal("-0.25")]
    done = threading.Event()
    topper = threading.Thread(target=sql_top_ups, args=(pg_url, org.id, amounts, done))
    body = {"model": "fake-model", "messages": MESSAGES, "max_tokens": 32}

    def request(i):
        if i == 0:
            topper.start()
        return post(gateway.base_url, org, body).status_code
    codes = concurrently(100, request)
    topper.join(60)
    assert done.is_set() and codes == [200] * 100
    quiet(engine, org.id)
    grants = to_nanos(Decimal(1) + sum(amounts))
    assert_ledger(engine, org.id, grants)
    result = subprocess.run([KILN, "credits", "reconcile"], capture_output=True, text=True,
                            env={**os.environ, "KILN_DATABASE_URL": pg_url}, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith(org.name))
    assert line.split()[-1] == "ok"


# -- cross-org isolation -------------------------------------------------------------------------

def test_an_org_cannot_read_another_orgs_generation_or_credits(gateway, fake, engine):
    a = make_org(engine, f"org-a-{uuid.uuid4().hex[:8]}", usd="1")
    b = make_org(engine, f"org-b-{uuid.uuid4().hex[:8]}", usd="2")
    r = post(gateway.base_url, b, {"model": "fake-model", "messages": MESSAGES})
    gid = r.headers["X-Neocloud-Generation-Id"]
    url = gateway.base_url + "/v1/generation"
    assert requests.get(url, params={"id": gid}, headers=b.headers).status_code == 200
    denied = requests.get(url, params={"id": gid}, headers=a.headers)
    assert denied.status_code == 404
    assert denied.json()["error"]["type"] == "invalid_request_error"
    credits = requests.get(gateway.base_url + "/v1/credits", headers=a.headers,
                           params={"org": b.id, "org_id": b.id}).json()
    assert credits["balance_usd"] == "1" and credits["in_flight"] == 0


def test_a_relay_whose_lease_was_swept_stops_relaying(start_gateway, fake, engine, pg_url):
    """The sweeper closes a live stream's generation (its lease expired: a database outage
    longer than the TTL, or a clock jump): the worker learns it at its next renewal and stops
    relaying at once, with an error event and no [DONE], and closes the backend request; its
    real settlement then corrects the sweeper's guess (docs/METERING.md)."""
    from gateway.config import Config
    from gateway.db import create_engine
    from gateway.ledger import Ledger
    gw = start_gateway(workers=1, lease_ttl_s=3, keepalive_s=0.5)
    org = make_org(engine, f"swept-{uuid.uuid4().hex[:8]}")
    fake.enqueue([SSE_HEAD, Send(sse_event(chat_chunk("x", role="assistant"))), Hang()])
    r = post(gw.base_url, org, stream_body(), stream=True)
    lines = r.iter_lines()
    assert next(line for line in lines if line.startswith(b"data: "))
    gid = r.headers["X-Neocloud-Generation-Id"]
    config = Config.from_mapping({"database_url": pg_url})
    ledger = Ledger(create_engine(config, ledger=True), config, {})
    try:
        def expire_and_sweep():  # a renewal may come between the two: then again
            with engine.begin() as conn:
                conn.execute(sa.text("UPDATE in_flight SET expires_at = now() - interval "
                                     "'1 second' WHERE generation_id = :g"), {"g": gid})
            return ledger.sweep(org_id=org.id) == 1
        wait_until(expire_and_sweep, timeout_s=10)
    finally:
        ledger.store.engine.dispose()
    rest = [line for line in lines if line.startswith(b"data: ")]  # ends within a renewal
    assert b"[DONE]" not in b"".join(rest)
    assert json.loads(rest[-1][6:])["error"]["code"] == "lease_expired"
    wait_until(lambda: fake.requests[-1].closed_at is not None)
    quiet(engine, org.id)
    event = usage_event(engine, gid)
    assert event["completion_tokens"] == 1 and event["cost_nanos"] > 0  # the real figures
    assert_ledger(engine, org.id, 10 * 10**9)


# -- early send (docs/METERING.md, "Early send") ------------------------------------------------

def test_early_send_overlaps_admission_and_a_refusal_stops_the_backend(start_gateway, fake,
                                                                         engine):
    """With ``KILN_EARLY_SEND=true``, an org this worker admitted last is sent to its backend
    while its admission waits (here on the org's balance row, held by the test): the backend
    has the request before the admission is granted, and the answer is billed once. A
    refusal (429 at the in-flight limit of 1) closes the early request at the backend; the
    org's next request is not sent before its admission, and that one is refused without
    reaching the backend at all."""
    gw = start_gateway(workers=1, early_send="true")
    org = make_org(engine, f"early-{uuid.uuid4().hex[:8]}", limit=1)
    with requests.Session() as client:
        def ask(body):
            return client.post(gw.base_url + CHAT, json=body, headers=org.headers, timeout=30)

        first = {"model": "fake-model", "messages": MESSAGES}
        assert ask(first).status_code == 200  # not sent early: the org was never admitted here
        assert len(fake.requests) == 1

        locked, release = threading.Event(), threading.Event()

        def hold_the_balance_row():
            with engine.connect() as conn, conn.begin():
                conn.execute(sa.text("SELECT 1 FROM credit_balances WHERE org_id = :o "
                                     "FOR UPDATE"), {"o": org.id})
                locked.set()
                release.wait(timeout=30)
        holder = threading.Thread(target=hold_the_balance_row)
        holder.start()
        assert locked.wait(timeout=10)
        try:
            with ThreadPoolExecutor(1) as pool:
                second = pool.submit(ask, first)
                fake.wait_for(lambda reqs: len(reqs) == 2)  # while the admission waits
                assert not second.done()
                release.set()
                answer = second.result(timeout=30)
        finally:
            release.set()
            holder.join()
        assert answer.status_code == 200
        gid = answer.headers["X-Neocloud-Generation-Id"]
        assert usage_event(engine, gid)["status"] == "completed"

        fake.enqueue([SSE_HEAD, Hang()])
        held = requests.post(gw.base_url + CHAT, json=stream_body(), headers=org.headers,
                             stream=True, timeout=30)
        try:
            assert held.status_code == 200
            fake.enqueue([Hang()])  # the early request would wait here for ever
            refused = ask(first)
            assert refused.status_code == 429
            early = fake.wait_for(lambda reqs: len(reqs) == 4 and reqs[3])
            wait_until(lambda: fake.requests[3].closed_at is not None, timeout_s=10)
            assert early.json["messages"] == MESSAGES
            again = ask(first)
            assert again.status_code == 429
            assert len(fake.requests) == 4  # refused before any backend saw it
        finally:
            held.close()
    quiet(engine, org.id)
    events = events_of(engine, org.id)
    assert [e["status"] for e in events] == ["completed", "completed", "client_cancelled"]
    assert_ledger(engine, org.id, 10 * 10**9)
