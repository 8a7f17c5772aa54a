"""The key holder's view of money (``GET /v1/credits``, ``GET /v1/generation``) and the
operator's (``kiln org``, ``kiln key``, ``kiln credits``), against the real gateway and Postgres."""
import json
import os
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pytest
import requests
import sqlalchemy as sa

from factories import MESSAGES
from fake_upstream import Hang, Status, chat_chunk, chat_completion, json_reply, make_usage, sse
from gateway.billing import from_nanos
from gateway_proc import (balance_nanos, create_database, drop_database, make_org, migrate,
                          settled_event, usage_event, wait_until)

KILN = str(Path(sys.executable).with_name("kiln"))
CHAT = "/v1/chat/completions"
GENERATION_KEYS = {"id", "object", "model", "stream", "status", "http_status", "prompt_tokens",
                   "cached_tokens", "completion_tokens", "total_tokens", "estimated", "cost_usd",
                   "hold_usd", "error", "error_code", "anomaly", "created_at", "first_token_at",
                   "ended_at", "ttft_ms", "duration_ms", "prompt_counted_by",
                   "completion_counted_by"}


def usd(nanos):
    return format(from_nanos(nanos), "f")


def kiln(pg_url, *args, check=True):
    """Run the ``kiln`` command on ``pg_url``; return the CompletedProcess."""
    result = subprocess.run([KILN, *args], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "KILN_DATABASE_URL": pg_url})
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def get(gateway, path, org=None, **params):
    return requests.get(gateway.base_url + path, params=params,
                        headers=org.headers if org else {}, timeout=30)


# -- GET /v1/credits -------------------------------------------------------------------------------

def test_credits_show_balance_holds_and_available(gateway, fake, org, engine):
    assert get(gateway, "/v1/credits", org).json() == {
        "object": "credits", "balance_usd": "10", "held_usd": "0", "available_usd": "10",
        "in_flight": 0, "in_flight_limit": 8}
    fake.enqueue([Status(200, {"Content-Type": "text/event-stream"}), Hang()])
    stream = requests.post(gateway.base_url + CHAT, headers=org.headers, stream=True, timeout=30,
                           json={"model": "fake-model", "messages": MESSAGES, "stream": True})
    gid = stream.headers["X-Neocloud-Generation-Id"]
    hold = usage_event(engine, gid)["hold_nanos"]
    with stream:
        during = get(gateway, "/v1/credits", org).json()
    assert (during["held_usd"], during["in_flight"]) == (usd(hold), 1)
    assert during["available_usd"] == usd(10 * 10**9 - hold)
    cost = settled_event(engine, gid)["cost_nanos"]
    after = get(gateway, "/v1/credits", org).json()
    assert after["balance_usd"] == after["available_usd"] == usd(10 * 10**9 - cost)
    assert (after["held_usd"], after["in_flight"]) == ("0", 0)


def test_credits_need_a_key(gateway):
    r = get(gateway, "/v1/credits")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


# -- GET /v1/generation ----------------------------------------------------------------------------

def test_generation_of_a_completed_request(gateway, fake, org, engine):
    fake.enqueue(json_reply(chat_completion("Hi!", usage=make_usage(prompt=12, completion=34))))
    r = requests.post(gateway.base_url + CHAT, headers=org.headers, timeout=30,
                      json={"model": "fake-model", "messages": MESSAGES, "max_tokens": 50})
    gid = r.headers["X-Neocloud-Generation-Id"]
    settled_event(engine, gid)
    view = get(gateway, "/v1/generation", org, id=gid).json()
    assert set(view) == GENERATION_KEYS
    expected = 11_400  # 12 x 100 + 34 x 300 nano-dollars (fake-model: 0.10 and 0.30 USD/M)
    assert view | {"created_at": None, "first_token_at": None, "ended_at": None, "ttft_ms": None,
                   "duration_ms": None, "hold_usd": None} == {
        "id": gid, "object": "generation", "model": "fake-model", "stream": False,
        "status": "completed", "http_status": 200, "prompt_tokens": 12, "cached_tokens": 0,
        "completion_tokens": 34, "total_tokens": 46, "estimated": False,
        "prompt_counted_by": "backend", "completion_counted_by": "backend",
        "cost_usd": usd(expected), "error": None, "error_code": None, "anomaly": False,
        "created_at": None, "first_token_at": None,
        "ended_at": None, "ttft_ms": None, "duration_ms": None, "hold_usd": None}
    assert Decimal(view["hold_usd"]) >= Decimal(view["cost_usd"])
    created, first, ended = (datetime.fromisoformat(view[k])
                             for k in ("created_at", "first_token_at", "ended_at"))
    assert created <= first <= ended and created.utcoffset() == timedelta(0)
    assert 0 <= view["ttft_ms"] <= view["duration_ms"]
    assert abs(datetime.now(timezone.utc) - created) < timedelta(minutes=5)


def test_generation_of_a_stream_metered_by_kiln_is_flagged_estimated(gateway, fake, org, engine):
    fake.enqueue(sse([chat_chunk("one"), chat_chunk(" two"), chat_chunk(finish_reason="stop")]))
    r = requests.post(gateway.base_url + CHAT, headers=org.headers, timeout=30,
                      json={"model": "fake-model", "messages": MESSAGES, "stream": True})
    assert b"[DONE]" in r.content
    event = settled_event(engine, r.headers["X-Neocloud-Generation-Id"])
    view = get(gateway, "/v1/generation", org, id=event["id"]).json()
    assert view["stream"] is True and view["estimated"] is True
    # "one two": 7 bytes, Kiln's upward count without a tokenizer (docs/METERING.md)
    assert view["completion_tokens"] == 7 and view["status"] == "completed"
    assert view["completion_counted_by"] == view["prompt_counted_by"] == "bound"
    assert view["cost_usd"] == usd(event["cost_nanos"])


def test_generation_of_another_org_or_unknown_is_404(gateway, fake, org, engine):
    other = make_org(engine, f"other-{uuid.uuid4().hex[:8]}")
    r = requests.post(gateway.base_url + CHAT, headers=other.headers, timeout=30,
                      json={"model": "fake-model", "messages": MESSAGES})
    gid = r.headers["X-Neocloud-Generation-Id"]
    assert get(gateway, "/v1/generation", other, id=gid).status_code == 200
    for ref in (gid, "gen-000000000000000000000000"):
        denied = get(gateway, "/v1/generation", org, id=ref)
        assert denied.status_code == 404
        assert denied.json()["error"] == {"message": f"No generation '{ref}' for this "
                                          "organization.", "type": "invalid_request_error",
                                          "param": "id", "code": "not_found"}


# Percent-encoded in the query string exactly as a client may send them. Control characters
# (NUL first: Postgres refuses it in text) and ids longer than any generation id are 400.
UNSTORABLE_IDS = ["%00", "abc%00def", "gen-" + "0" * 23 + "%00", "%01", "gen-%7F", "%C2%85",
                  "x" * 41, "gen-" + "0" * 4000]
# Bytes that are not UTF-8 (a lone surrogate's encoding, an overlong NUL, a stray 0xFF):
# whatever text they decode to, it is no generation of this org.
NOT_UTF8_IDS = ["%ED%A0%80", "gen-%ED%B0%80", "%C0%80", "%FF"]


def test_generation_ids_no_generation_can_have_are_400_or_404_never_500(gateway, org):
    log_before = len(gateway.log())
    for raw in UNSTORABLE_IDS + NOT_UTF8_IDS:
        r = requests.get(f"{gateway.base_url}/v1/generation?id={raw}", headers=org.headers,
                         timeout=30)
        expected = 400 if raw in UNSTORABLE_IDS else 404
        assert r.status_code == expected, (raw[:40], r.status_code, r.text[:300])
        error = r.json()["error"]
        assert error["param"] == "id" and error["type"] == "invalid_request_error"
        assert error["code"] == ("invalid_value" if expected == 400 else "not_found")
        assert "\x00" not in error["message"] and len(error["message"]) < 200
    assert "Traceback" not in gateway.log()[log_before:]
    # The longest id a generation can have is looked up as usual.
    assert get(gateway, "/v1/generation", org, id="g" * 40).status_code == 404


def test_generation_without_id_is_400(gateway, org):
    for params in ({}, {"id": ""}):
        r = get(gateway, "/v1/generation", org, **params)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "id"
        assert r.json()["error"]["code"] == "missing_required_parameter"


# -- the kiln command ---------------------------------------------------------------------------

def test_org_key_and_credits_commands(gateway, pg_url, engine):
    name = f"cli-{uuid.uuid4().hex[:8]}"
    org_id = int(kiln(pg_url, "org", "create", name).stdout.strip())
    key = kiln(pg_url, "key", "create", name).stdout.splitlines()[-1]
    headers = {"Authorization": f"Bearer {key}"}
    credits = requests.get(gateway.base_url + "/v1/credits", headers=headers, timeout=30).json()
    assert credits["balance_usd"] == "0"
    shown = kiln(pg_url, "credits", "grant", name, "2.500000001", "--note", "test").stdout
    assert "balance_usd=2.500000001" in shown
    assert balance_nanos(engine, org_id) == (2_500_000_001, 0, 0)
    kiln(pg_url, "credits", "grant", f"id:{org_id}", "--", "-0.5")  # by id; a negative corrects
    assert "available_usd=2.000000001" in kiln(pg_url, "credits", "show", name).stdout
    refused = kiln(pg_url, "credits", "grant", name, "--", "-2.000000002", check=False)
    assert refused.returncode != 0 and "refused" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert balance_nanos(engine, org_id) == (2_000_000_001, 0, 0)
    assert kiln(pg_url, "org", "create", name, check=False).returncode != 0
    revoked = kiln(pg_url, "key", "revoke", key[:12]).stdout
    assert key[:12] in revoked
    wait_until(lambda: requests.get(gateway.base_url + "/v1/credits", headers=headers,
                                    timeout=30).status_code == 403, timeout_s=10)
    assert kiln(pg_url, "key", "revoke", key[:12], check=False).returncode != 0


@pytest.fixture
def fresh_pg():
    """An empty Postgres database of its own, migrated to head (reconcile checks every org)."""
    name = f"kiln_credits_{uuid.uuid4().hex[:10]}"
    url = create_database(name)
    migrate(url)
    engine = sa.create_engine(url)
    yield url, engine
    engine.dispose()
    drop_database(name)


def test_reconcile_passes_then_names_the_orgs_that_are_off(fresh_pg):
    url, engine = fresh_pg
    good, drifted, leaking = (make_org(engine, f"{n}-{uuid.uuid4().hex[:6]}", usd="3")
                              for n in ("good", "drifted", "leaking"))
    ok = kiln(url, "credits", "reconcile")
    lines = ok.stdout.splitlines()
    assert lines[0].split() == ["org", "grants_usd", "costs_usd", "balance_usd", "held_usd",
                                "leases", "expired", "status"]
    assert [ln.split()[-1] for ln in lines[1:]] == ["ok"] * 3
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE credit_balances SET balance_nanos = balance_nanos - 7 "
                             "WHERE org_id = :o"), {"o": drifted.id})
        _expired_lease(conn, leaking.id)
    off = kiln(url, "credits", "reconcile", check=False)
    assert off.returncode == 1
    assert drifted.name in off.stderr and leaking.name in off.stderr
    assert good.name not in off.stderr
    rows = {ln.split()[0]: ln for ln in off.stdout.splitlines()[1:]}
    assert rows[good.name].endswith("ok")
    assert "balance off by -0.000000007 USD" in rows[drifted.name]
    assert "1 expired lease(s)" in rows[leaking.name]


def _expired_lease(conn, org_id):
    """A pending generation whose worker died a minute ago, as a SIGKILL leaves it."""
    key_id = conn.execute(sa.text("SELECT id FROM api_keys WHERE org_id = :o"),
                          {"o": org_id}).scalar_one()
    past = datetime.now(timezone.utc) - timedelta(minutes=1)
    conn.execute(sa.text("UPDATE credit_balances SET held_nanos = 5, in_flight = 1 "
                         "WHERE org_id = :o"), {"o": org_id})
    conn.execute(sa.text("INSERT INTO usage_events (id, org_id, api_key_id, model, stream, "
                         "status, hold_nanos, started_at) VALUES ('gen-dead', :o, :k, "
                         "'fake-model', true, 'pending', 5, :t)"),
                 {"o": org_id, "k": key_id, "t": past})
    conn.execute(sa.text("INSERT INTO in_flight (generation_id, org_id, hold_nanos, expires_at) "
                         "VALUES ('gen-dead', :o, 5, :t)"), {"o": org_id, "t": past})


def test_sweep_closes_the_expired_lease_and_reconcile_then_passes(fresh_pg, catalog_path):
    url, engine = fresh_pg
    org = make_org(engine, f"swept-{uuid.uuid4().hex[:6]}", usd="1")
    with engine.begin() as conn:
        _expired_lease(conn, org.id)
    assert kiln(url, "credits", "reconcile", check=False).returncode == 1
    env = {**os.environ, "KILN_DATABASE_URL": url, "KILN_MODELS": str(catalog_path)}
    swept = subprocess.run([KILN, "sweep"], capture_output=True, text=True, env=env, timeout=120)
    assert swept.stdout.strip() == "closed 1; stored responses past their retention deleted: 0"
    assert usage_event(engine, "gen-dead")["status"] == "abandoned"
    assert balance_nanos(engine, org.id) == (10**9, 0, 0)
    kiln(url, "credits", "reconcile")


@pytest.mark.parametrize("stream", [False, True])
def test_the_usage_event_is_final_when_the_client_has_its_answer(gateway, fake, org, stream):
    """No waiting and no polling: the generation read right after the reply (or [DONE]), on the
    same keep-alive connection as the SDKs read it (so from the worker that answered, which
    waits for its own settlement), shows its final status and cost, the one the reply told
    (docs/METERING.md). Another worker re-reads a pending event for 50 ms: not asserted here."""
    usage = make_usage(prompt=12, completion=34)
    fake.enqueue(sse([chat_chunk("Hi", finish_reason="stop"),
                      chat_chunk(choices=False, usage=usage)]) if stream
                 else json_reply(chat_completion("Hi!", usage=usage)))
    body = {"model": "fake-model", "messages": MESSAGES, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    session = requests.Session()
    r = session.post(gateway.base_url + CHAT, headers=org.headers, timeout=30, json=body)
    told = (json.loads(r.text.split("data: ")[-2], parse_float=Decimal) if stream
            else r.json(parse_float=Decimal))["usage"]["cost"]
    view = session.get(gateway.base_url + "/v1/generation", headers=org.headers, timeout=30,
                       params={"id": r.headers["X-Neocloud-Generation-Id"]}).json()
    assert view["status"] == "completed" and Decimal(view["cost_usd"]) == told
    assert view["cost_usd"] == "0.0000114"  # 12 × 0.10 + 34 × 0.30 micro-dollars
