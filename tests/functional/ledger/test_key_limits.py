"""Per-key spend limits and request rates (issue "Keys people can hand out"), on Postgres through
the real gateway: a key at its cap by holds alone refuses the next request; a limit that resets
monthly starts again at the UTC month boundary; the rate limit is exact across two gunicorn
masters on one database; ``kiln credits reconcile`` checks each key's spend against its events.

Limits are set as an operator does in SQL (deploy/RUNBOOK.md, "Key limits"), on a key no request
has used yet, so that the gateway's key cache reads them on first use.
"""
import json
import os
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

from factories import concurrently
from fake_upstream import Gate, Hang, Status, chat_chunk, make_usage, sse
from gateway.billing import Usage, hold_nanos
from gateway.contract.catalog import load_catalog
from gateway.ledger import AdmissionRequest, KeyLimitExceeded, Ledger, Settlement
from gateway.ledger.sqlite import period_start
from gateway.flow.metering import prompt_bound
from gateway_proc import make_org, wait_until

pytestmark = pytest.mark.postgres

CHAT = "/v1/chat/completions"
KILN = str(Path(sys.executable).with_name("kiln"))
BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "Say hello"}],
        "stream": True}
SSE_HEAD = Status(200, {"Content-Type": "text/event-stream"})


def post(base_url, org, body=BODY, stream=True):
    return requests.post(base_url + CHAT, data=json.dumps(body).encode(), stream=stream,
                         timeout=60, headers={**org.headers, "Content-Type": "application/json"})


def set_key(engine, org, **columns):
    """Set columns of the org's key by plain SQL, as an operator would."""
    assignments = ", ".join(f"{name} = :{name}" for name in columns)
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE api_keys SET {assignments} WHERE org_id = :org"),
                     {**columns, "org": org.id})


def key_row(engine, org):
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT * FROM api_keys WHERE org_id = :o"),
                            {"o": org.id}).mappings().one()


def body_hold(catalog_path):
    """The hold the gateway places for :data:`BODY` (sent as compact JSON bytes)."""
    entry = load_catalog(str(catalog_path))[BODY["model"]]
    raw = json.dumps(BODY).encode()
    return hold_nanos(entry.pricing, prompt_bound(entry.context_window, len(raw),
                                                  len(BODY["messages"]), False),
                      entry.max_output_tokens)


def quiet(engine, org):
    """Wait until the org has no pending usage event and no lease."""
    def check():
        with engine.connect() as conn:
            return conn.execute(sa.text(
                "SELECT (SELECT count(*) FROM usage_events WHERE org_id = :o AND status = "
                "'pending') + (SELECT count(*) FROM in_flight WHERE org_id = :o)"),
                {"o": org.id}).scalar_one() == 0
    wait_until(check, timeout_s=30)


def next_month(now):
    return datetime(now.year + now.month // 12, now.month % 12 + 1, 1, tzinfo=timezone.utc)


# -- a key at its cap by holds alone -------------------------------------------------------------

def test_a_key_at_its_cap_by_holds_alone_refuses_the_next_request(gateway, fake, engine,
                                                                  catalog_path):
    """Limit = 3.5 holds: of 8 requests at once exactly 3 are admitted (their holds fill the
    key; nothing is spent yet), 5 are 402 ``key_limit_exceeded``; while the 3 run the next one
    is refused too, with a message naming the limit and when it resets; nothing reaches the
    backend for a refused request, and every hold comes back."""
    hold = body_hold(catalog_path)
    org = make_org(engine, f"cap-{uuid.uuid4().hex[:8]}")
    limit_nanos = 3 * hold + hold // 2
    set_key(engine, org, limit_usd=f"{limit_nanos / 10**9:.9f}", limit_reset="monthly")
    for _ in range(8):
        fake.enqueue([SSE_HEAD, Hang()])
    answers = concurrently(8, lambda i: post(gateway.base_url, org))
    try:
        codes = sorted(r.status_code for r in answers)
        assert codes == [200] * 3 + [402] * 5
        refused = [r.json()["error"] for r in answers if r.status_code == 402]
        assert {e["code"] for e in refused} == {"key_limit_exceeded"}
        wait_until(lambda: fake.active == 3)
        assert key_row(engine, org)["held_nanos"] == 3 * hold
        assert key_row(engine, org)["period_spent_nanos"] == 0
        extra = post(gateway.base_url, org, stream=False)
        error = extra.json()["error"]
        assert extra.status_code == 402 and error["code"] == "key_limit_exceeded"
        assert error["type"] == "insufficient_quota"
        resets = next_month(datetime.now(timezone.utc)).isoformat()
        dollars = str(Decimal(limit_nanos) / 10**9).rstrip("0")
        assert f"spend limit of ${dollars} per UTC month" in error["message"]
        assert f"it resets at {resets}" in error["message"]
        assert len(fake.requests) == 3
    finally:
        for r in answers:
            r.close()
    quiet(engine, org)
    row = key_row(engine, org)
    assert row["held_nanos"] == 0
    with engine.connect() as conn:
        spent = conn.execute(sa.text("SELECT sum(cost_nanos) FROM usage_events WHERE "
                                     "org_id = :o"), {"o": org.id}).scalar_one()
    assert row["period_spent_nanos"] == spent


# -- the reset period ----------------------------------------------------------------------------

BOUNDARIES = [  # (reset, instant, start of its period): the last microsecond and the first
    ("monthly", "2026-11-30 23:59:59.999999+00", "2026-11-01 00:00:00+00"),
    ("monthly", "2026-12-01 00:00:00+00", "2026-12-01 00:00:00+00"),
    ("monthly", "2026-12-31 23:59:59.999999+00", "2026-12-01 00:00:00+00"),
    ("monthly", "2027-01-01 00:00:00+00", "2027-01-01 00:00:00+00"),
    ("weekly", "2026-11-29 23:59:59.999999+00", "2026-11-23 00:00:00+00"),  # a Sunday
    ("weekly", "2026-11-30 00:00:00+00", "2026-11-30 00:00:00+00"),         # a Monday
    ("daily", "2026-11-30 23:59:59.999999+00", "2026-11-30 00:00:00+00"),
    ("daily", "2026-12-01 00:30:00+01", "2026-11-30 00:00:00+00"),          # UTC, not local
    (None, "2026-12-01 00:00:00+00", None),
]


@pytest.mark.parametrize("reset,instant,start", BOUNDARIES)
def test_periods_start_at_the_utc_boundary_in_both_dialects(engine, reset, instant, start):
    with engine.connect() as conn:
        conn.execute(sa.text("SET TIME ZONE 'America/New_York'"))  # the session's zone is moot
        got, at = conn.execute(sa.text(
            "SELECT kiln_period_start(:r, CAST(:t AS timestamptz)), CAST(:t AS timestamptz)"),
            {"r": reset, "t": instant}).one()
    expected = None if start is None else datetime.fromisoformat(start.replace("+00", "+00:00"))
    assert got == expected
    assert period_start(reset, at) == expected  # SQLite's ledger computes the same


@pytest.fixture
def ledger(pg_url):
    from gateway.config import Config
    from gateway.db import create_engine
    config = Config.from_mapping({"database_url": pg_url})
    ledger = Ledger(create_engine(config, ledger=True), config, {})
    yield ledger
    ledger.store.engine.dispose()


def admission(org, key_id, hold):
    return AdmissionRequest(gid="gen-" + uuid.uuid4().hex[:24], org_id=org.id, key_id=key_id,
                            model="fake-model", stream=False, hold_nanos=hold, in_flight_limit=8,
                            lease_ttl_s=60, key_checks=True, limit_usd=Decimal("0.000010000"),
                            limit_reset="monthly")


def settlement(gid, org, key_id, cost):
    return Settlement(gid=gid, org_id=org.id, key_id=key_id, model="fake-model", stream=False,
                      status="completed", usage=Usage(prompt=1, completion=1), cost_nanos=cost)


def test_a_monthly_limit_spent_last_month_admits_again_this_month(ledger, engine):
    """The key spent its whole $0.00001 in the previous UTC month: the first admission of this
    month starts a new period (spend 0, this month's start) and is admitted; once this month's
    spend reaches the limit, the next hold is refused, naming the next month's start."""
    org = make_org(engine, f"reset-{uuid.uuid4().hex[:8]}")
    key_id = key_row(engine, org)["id"]
    now = datetime.now(timezone.utc)
    this_month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    last_month = (this_month - timedelta(days=1)).replace(day=1)
    set_key(engine, org, limit_usd="0.000010000", limit_reset="monthly",
            period_start=last_month, period_spent_nanos=10_000)
    gid, _ = ledger.admit(admission(org, key_id, 4_000))
    row = key_row(engine, org)
    assert (row["period_start"], row["period_spent_nanos"], row["held_nanos"]) == \
        (this_month, 0, 4_000)
    ledger.store.settle_batch([settlement(gid, org, key_id, 8_000)])  # spends 8_000 of 10_000
    row = key_row(engine, org)
    assert (row["period_spent_nanos"], row["held_nanos"]) == (8_000, 0)
    gid = ledger.admit(admission(org, key_id, 2_000))[0]  # exactly the limit: admitted
    with pytest.raises(KeyLimitExceeded) as refused:
        ledger.admit(admission(org, key_id, 1))
    ledger.store.settle_batch([settlement(gid, org, key_id, 0)])
    assert f"it resets at {next_month(now).isoformat()}" in refused.value.message
    assert ": $0.00 left, but the request needs a hold of $0.000000001" in \
        refused.value.message


def gated_stream(opened):
    """A streamed answer (one content chunk, the finish, usage 10/5) held back until
    ``opened`` is set."""
    steps = sse([chat_chunk("Hello", role="assistant"), chat_chunk(finish_reason="stop"),
                 chat_chunk(choices=False, usage=make_usage(10, 5))])
    return [steps[0], Gate(opened), *steps[1:]]


def test_a_key_at_its_monthly_cap_last_month_admits_what_the_new_month_allows(
        gateway, fake, engine, catalog_path, pg_url):
    """Limit = 3.5 holds, reset monthly. A request admitted before the UTC month boundary is
    still running after it (its usage event and the key's period are backdated to the last
    microsecond of the previous month, where the key spent all its limit but that hold). Then
    8 requests at once: the new month starts from 0 spent, but the running request's hold
    still counts (README, "Key limits": a running request's hold counts against the key's
    remaining), so exactly 2 are admitted and 6 are 402 ``key_limit_exceeded`` naming next
    month's start. Once all settle, the key's period is this month and its spend is the cost
    of the 3 requests: the one that ran across the boundary counts in the month it settled in."""
    hold = body_hold(catalog_path)
    org = make_org(engine, f"boundary-{uuid.uuid4().hex[:8]}")
    limit_nanos = 3 * hold + hold // 2
    set_key(engine, org, limit_usd=f"{limit_nanos / 10**9:.9f}", limit_reset="monthly")
    opened = threading.Event()
    for _ in range(9):
        fake.enqueue(gated_stream(opened))
    first = post(gateway.base_url, org)
    answers = []
    try:
        assert first.status_code == 200
        wait_until(lambda: fake.active == 1)
        now = datetime.now(timezone.utc)
        this_month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        last_instant = this_month - timedelta(microseconds=1)
        set_key(engine, org, period_start=(last_instant).replace(day=1, hour=0, minute=0,
                                                                 second=0, microsecond=0),
                period_spent_nanos=limit_nanos - hold)
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE usage_events SET started_at = :t WHERE org_id = :o"),
                         {"t": last_instant, "o": org.id})
        answers = concurrently(8, lambda i: post(gateway.base_url, org))
        assert sorted(r.status_code for r in answers) == [200] * 2 + [402] * 6
        wait_until(lambda: fake.active == 3)
        for refused in (r.json()["error"] for r in answers if r.status_code == 402):
            assert refused["code"] == "key_limit_exceeded"
            assert f"it resets at {next_month(now).isoformat()}" in refused["message"]
        row = key_row(engine, org)
        assert (row["period_start"], row["period_spent_nanos"], row["held_nanos"]) == \
            (this_month, 0, 3 * hold)
    finally:
        opened.set()
        for r in [first, *answers]:
            assert r.content  # read to its end: each admitted request completes
            r.close()
    quiet(engine, org)
    with engine.connect() as conn:
        costs = conn.execute(sa.text("SELECT sum(cost_nanos), count(*) FROM usage_events "
                                     "WHERE org_id = :o AND status = 'completed'"),
                             {"o": org.id}).one()
    assert costs[1] == 3 and costs[0] > 0
    row = key_row(engine, org)
    assert (row["period_start"], row["period_spent_nanos"], row["held_nanos"]) == \
        (this_month, costs[0], 0)
    assert row["prefix"] not in reconcile(pg_url).stderr


# -- the request rate, across two gateways -------------------------------------------------------

def test_the_rate_limit_is_exact_across_two_gateway_instances(start_gateway, fake, engine):
    """rpm 4 and 12 requests at once, alternating between two gunicorn masters on one
    database: exactly 4 are answered, 8 are 429 ``rate_limit_exceeded`` without rate-limit
    headers, and only 4 reach the backend. The limit counts UTC minutes: the burst starts early
    in one, and is tried again in a fresh minute if it still crossed a boundary."""
    gateways = [start_gateway(workers=1), start_gateway(workers=1)]
    for _attempt in range(3):
        org = make_org(engine, f"rate-{uuid.uuid4().hex[:8]}")
        set_key(engine, org, rpm_limit=4)
        wait_until(lambda: datetime.now(timezone.utc).second < 30, timeout_s=40, interval_s=0.2)
        minute = datetime.now(timezone.utc).replace(second=0, microsecond=0)
        fake.clear()
        answers = concurrently(12, lambda i, org=org: post(gateways[i % 2].base_url, org,
                                                           stream=False))
        if datetime.now(timezone.utc).replace(second=0, microsecond=0) == minute:
            break
    codes = sorted(r.status_code for r in answers)
    assert codes == [200] * 4 + [429] * 8
    for r in answers:
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert not [h for h in r.headers if h.lower().startswith(("x-ratelimit",
                                                                      "ratelimit"))]
    assert len(fake.requests) == 4
    served = {r.headers.get("X-Neocloud-Generation-Id") for r in answers if r.status_code == 200}
    assert len(served) == 4


# -- reconciliation checks each key -------------------------------------------------------------

def reconcile(pg_url):
    return subprocess.run([KILN, "credits", "reconcile"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "KILN_DATABASE_URL": pg_url})


def test_reconcile_checks_each_keys_spend_and_holds_against_its_events(gateway, fake, engine,
                                                                       pg_url):
    org = make_org(engine, f"recon-{uuid.uuid4().hex[:8]}")
    set_key(engine, org, limit_usd="1.00", limit_reset="daily")
    for _ in range(3):
        assert post(gateway.base_url, org, stream=False).status_code == 200
    quiet(engine, org)
    prefix = key_row(engine, org)["prefix"]
    assert key_row(engine, org)["period_spent_nanos"] > 0
    assert prefix not in reconcile(pg_url).stderr
    set_key(engine, org, period_spent_nanos=key_row(engine, org)["period_spent_nanos"] + 1)
    off = reconcile(pg_url)
    assert off.returncode == 1
    assert f"key {prefix} of {org.name} (period spend off by 0.000000001 USD)" in off.stderr
    set_key(engine, org, period_spent_nanos=key_row(engine, org)["period_spent_nanos"] - 1,
            held_nanos=5)
    assert f"key {prefix} of {org.name} (held amount does not match its leases)" in \
        reconcile(pg_url).stderr
    set_key(engine, org, held_nanos=0)
    assert prefix not in reconcile(pg_url).stderr


def test_bad_key_settings_in_sql_are_refused_by_the_table(engine):
    """The same SQL an operator runs: an unknown period, a negative limit or a zero rate is
    refused by the table's checks, so admission never reads one."""
    org = make_org(engine, f"sql-{uuid.uuid4().hex[:8]}")
    for columns in ({"limit_reset": "yearly"}, {"limit_usd": "-1"}, {"rpm_limit": 0},
                    {"limit_usd": "9223372036.854775808"}):  # beyond BIGINT nano-dollars
        with pytest.raises(sa.exc.IntegrityError):
            set_key(engine, org, **columns)
    assert key_row(engine, org)["limit_usd"] is None


# -- a new limit on a key in use -----------------------------------------------------------------

def kiln_cli(pg_url, *args):
    return subprocess.run([KILN, *args], capture_output=True, text=True, timeout=120, check=True,
                          env={**os.environ, "KILN_DATABASE_URL": pg_url})


def test_a_new_limit_applies_to_a_key_in_use_within_the_key_cache_ttl(start_gateway, fake,
                                                                       engine, pg_url):
    """README "Key lookups are cached per worker for KILN_KEY_CACHE_TTL_S: ... a key's new limits
    apply": a key the worker has cached is set to spend nothing (``kiln key set --limit 0``),
    then its limit is cleared by SQL, then set to nothing again by SQL; each change is obeyed
    by the next request sent once the TTL (1 s) has passed since the change (a cache entry is
    never older than that), without a restart."""
    ttl_s = 1.0
    gw = start_gateway(workers=1, key_cache_ttl_s=ttl_s)
    org = make_org(engine, f"inuse-{uuid.uuid4().hex[:8]}")
    prefix = key_row(engine, org)["prefix"]

    def after_the_ttl():
        time.sleep(ttl_s + 0.2)
        return post(gw.base_url, org, stream=False)

    def assert_refused(answer):
        assert answer.status_code == 402, answer.text
        assert answer.json()["error"]["code"] == "key_limit_exceeded"

    assert post(gw.base_url, org, stream=False).status_code == 200  # the key is now cached
    assert post(gw.base_url, org, stream=False).status_code == 200  # served from the cache
    kiln_cli(pg_url, "key", "set", prefix, "--limit", "0")
    assert_refused(after_the_ttl())
    set_key(engine, org, limit_usd=None)
    assert [after_the_ttl().status_code for _ in range(2)] == [200, 200]
    set_key(engine, org, limit_usd="0")
    assert_refused(after_the_ttl())
    quiet(engine, org)
