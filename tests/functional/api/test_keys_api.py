"""The keys API through the real two-worker gateway on Postgres (docs/KEYS.md): a management key
creates a key, the ``openai`` client uses it, its limit refuses it, a rotation keeps the old
secret for its grace period only, a revocation ends it; expiry is exact; a key's in-flight cap
holds under 30 concurrent streams (counted by the backend and by the ledger); every change is
in the append-only ``key_changes``; bad input is a 400 in the envelope, never a change."""
import json
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone

import openai
import pytest
import requests
import sqlalchemy as sa

from factories import MESSAGES, concurrently
from fake_upstream import Gate, Send, Status, chat_chunk, sse_event
from gateway.ledger import key_admin
from gateway_proc import balance_nanos, make_org, wait_until

pytestmark = pytest.mark.postgres

SSE_HEAD = Status(200, {"Content-Type": "text/event-stream"})


def manager_of(engine, org):
    """A management key of ``org`` (the operator's to create), in clear."""
    with engine.begin() as conn:
        return key_admin.create_key_row(conn, org.id, name="admin", manage=True)[1]


def call(gateway, method, path, key, body=None):
    return requests.request(method, gateway.base_url + path, json=body, timeout=30,
                            headers={"Authorization": f"Bearer {key}"})


def chat(gateway, key):
    """One chat completion with the official client; return the error code, or None."""
    with openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0,
                       timeout=30) as client:
        try:
            client.chat.completions.create(model="fake-model", messages=MESSAGES)
        except openai.APIStatusError as err:
            return err.response.json()["error"]["code"]
    return None


def changes(engine, key_id):
    with engine.connect() as conn:
        return [(r.action, r.actor, r.actor_key_id, json.loads(r.changes)) for r in conn.execute(
            sa.text("SELECT * FROM key_changes WHERE api_key_id = :k ORDER BY id"),
            {"k": key_id})]


def test_create_use_limit_rotate_and_revoke(gateway, fake, engine):
    org = make_org(engine, f"kapi-{uuid.uuid4().hex[:8]}")
    admin = manager_of(engine, org)
    made = call(gateway, "POST", "/v1/keys", admin, {
        "label": "ci-bot", "limit_usd": "5", "limit_reset": "daily", "models": ["fake-model"],
        "rate_limit": {"requests_per_minute": 1000}, "in_flight_limit": 4})
    assert made.status_code == 201, made.text
    view, secret = made.json(), made.json()["key"]
    assert (view["label"], view["limit_usd"], view["limit_reset"], view["models"],
            view["rate_limit"], view["in_flight_limit"], view["manage"], view["org_read"]) == \
        ("ci-bot", "5", "daily", ["fake-model"], {"requests_per_minute": 1000}, 4, False,
         False)
    assert secret.startswith("kiln-") and view["prefix"] == secret[:12]
    key_id = view["id"]
    assert all(chat(gateway, secret) is None for _ in range(4))  # both workers
    shown = call(gateway, "GET", f"/v1/keys/{key_id}", admin).json()
    assert "key" not in shown and secret not in json.dumps(shown)
    assert shown["usage_usd"] != "0"

    # The limit: a nano-dollar refuses the next request; null lifts it.
    assert call(gateway, "PATCH", f"/v1/keys/{key_id}", admin,
                {"limit_usd": "0.000000001"}).json()["limit_usd"] == "0.000000001"
    wait_until(lambda: chat(gateway, secret) == "key_limit_exceeded")
    assert call(gateway, "PATCH", f"/v1/keys/{key_id}", admin,
                {"limit_usd": None}).json()["limit_usd"] is None
    wait_until(lambda: chat(gateway, secret) is None)

    # Rotation: inside the grace period both secrets work; after it only the new one.
    rotated = call(gateway, "POST", f"/v1/keys/{key_id}/rotate", admin, {"grace_period_s": 600})
    assert rotated.status_code == 200 and rotated.json()["id"] == key_id
    second = rotated.json()["key"]
    assert second != secret and rotated.json()["prefix"] == second[:12]
    assert all(chat(gateway, k) is None for k in (secret, second, secret, second))
    again = call(gateway, "POST", f"/v1/keys/{key_id}/rotate", admin, {"grace_period_s": 2})
    third, until = again.json()["key"], again.json()["previous_key_expires_at"]
    assert chat(gateway, third) is None
    time.sleep(max(0.0, (datetime.fromisoformat(until) - datetime.now(timezone.utc))
                   .total_seconds()) + 0.1)
    assert [chat(gateway, second) for _ in range(4)] == ["key_expired"] * 4
    assert [chat(gateway, secret) for _ in range(2)] == ["invalid_api_key"] * 2
    assert all(chat(gateway, third) is None for _ in range(4))

    # Revocation.
    revoked = call(gateway, "DELETE", f"/v1/keys/{key_id}", admin)
    assert revoked.status_code == 200 and revoked.json()["revoked"] is True
    wait_until(lambda: chat(gateway, third) == "key_revoked")
    manager_id = call(gateway, "GET", "/v1/key", admin).json()["id"]
    log = changes(engine, key_id)
    assert [(a, who, actor) for a, who, actor, _ in log] == \
        [(a, "key", manager_id) for a in ("create", "update", "update", "rotate", "rotate",
                                          "revoke")]
    assert log[1][3] == {"limit_usd": "0.000000001"} and log[3][3]["grace_period_s"] == 600
    assert all(secret not in json.dumps(entry) for entry in log)
    with engine.begin() as conn, pytest.raises(sa.exc.DBAPIError, match="append-only"):
        conn.execute(sa.text("DELETE FROM key_changes WHERE api_key_id = :k"), {"k": key_id})


def test_who_may_manage_which_keys(gateway, fake, engine):
    """Only a management key changes keys, only its own org's, never into another management
    key; it calls no model; another org's key id is not found."""
    org, other = (make_org(engine, f"{n}-{uuid.uuid4().hex[:8]}") for n in ("own", "other"))
    admin, other_admin = manager_of(engine, org), manager_of(engine, other)
    plain_id = call(gateway, "GET", "/v1/key", org.key).json()["id"]
    foreign_id = call(gateway, "GET", "/v1/key", other.key).json()["id"]
    refused = [
        (call(gateway, "POST", "/v1/keys", org.key, {"label": "x"}), 403,
         "management_key_required"),
        (call(gateway, "PATCH", f"/v1/keys/{plain_id}", org.key, {"label": "x"}), 403,
         "management_key_required"),
        (call(gateway, "POST", "/v1/keys", admin, {"manage": True}), 403, "operator_only"),
        (call(gateway, "DELETE", f"/v1/keys/{plain_id}", other_admin), 404, "not_found"),
        (call(gateway, "GET", f"/v1/keys/{foreign_id}", admin), 404, "not_found"),
        (call(gateway, "POST", f"/v1/keys/{foreign_id}/rotate", admin), 404, "not_found"),
        (call(gateway, "GET", f"/v1/keys/{2**40}", admin), 404, "not_found"),
    ]
    for resp, status, code in refused:
        assert (resp.status_code, resp.json()["error"]["code"]) == (status, code), resp.text
    assert chat(gateway, admin) == "management_key"
    listed = call(gateway, "GET", "/v1/keys", admin).json()["data"]
    assert {k["prefix"] for k in listed} == {org.key[:12], admin[:12]}
    assert call(gateway, "GET", f"/v1/keys/{plain_id}", org.key).json()["id"] == plain_id
    assert chat(gateway, org.key) is None and chat(gateway, other.key) is None
    assert changes(engine, plain_id) == [] and changes(engine, foreign_id) == []


@pytest.mark.parametrize("body, param, code", [
    ({"models": ["fake-model", "no-such-model"]}, "models[1]", "invalid_value"),
    ({"models": []}, "models", "invalid_type"),
    ({"limit_usd": 5}, "limit_usd", "invalid_type"),
    ({"limit_usd": "1e3"}, "limit_usd", "invalid_value"),
    ({"limit_usd": "0.0000000001"}, "limit_usd", "invalid_value"),
    ({"limit_reset": "hourly"}, "limit_reset", "invalid_value"),
    ({"in_flight_limit": 0}, "in_flight_limit", "invalid_value"),
    ({"in_flight_limit": True}, "in_flight_limit", "invalid_type"),
    ({"requests_per_minute": 2**31}, "requests_per_minute", "invalid_value"),
    ({"rate_limit": {"requests_per_minute": 5, "burst": 2}}, "rate_limit", "invalid_type"),
    ({"expires_at": "2020-01-01T00:00:00Z"}, "expires_at", "invalid_value"),
    ({"expires_at": "2099-01-01T00:00:00"}, "expires_at", "invalid_value"),
    ({"expires_at": "tomorrow"}, "expires_at", "invalid_value"),
    ({"label": "a\x00b"}, "label", "invalid_value"),
    ({"secret": "kiln-mine"}, "secret", "unknown_parameter"),
])
def test_bad_fields_are_a_400_naming_the_field_and_change_nothing(gateway, engine, body, param,
                                                                  code):
    org = make_org(engine, f"bad-{uuid.uuid4().hex[:8]}")
    admin = manager_of(engine, org)
    key_id = call(gateway, "GET", "/v1/key", org.key).json()["id"]
    for method, path in (("POST", "/v1/keys"), ("PATCH", f"/v1/keys/{key_id}")):
        resp = call(gateway, method, path, admin, body)
        assert resp.status_code == 400, resp.text
        assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == (param, code)
    assert len(call(gateway, "GET", "/v1/keys", admin).json()["data"]) == 2
    assert changes(engine, key_id) == []


@pytest.mark.parametrize("body, code", [({"grace_period_s": 86_401}, "invalid_value"),
                                        ({"grace_period_s": -1}, "invalid_value"),
                                        ({"grace_period_s": "60"}, "invalid_type"),
                                        ({"grace": 60}, "unknown_parameter")])
def test_a_bad_grace_period_is_a_400_and_the_secret_stays(gateway, engine, body, code):
    org = make_org(engine, f"grace-{uuid.uuid4().hex[:8]}")
    admin = manager_of(engine, org)
    key_id = call(gateway, "GET", "/v1/key", org.key).json()["id"]
    resp = call(gateway, "POST", f"/v1/keys/{key_id}/rotate", admin, body)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == code
    assert call(gateway, "GET", "/v1/key", org.key).status_code == 200
    assert changes(engine, key_id) == []


def test_a_key_expiring_during_a_run_is_refused_from_its_expiry_on(gateway, fake, engine):
    """Requests one after another on both workers (their key caches warm) while the key's
    ``expires_at`` passes: every request sent at or after it is 401 ``key_expired``; every one
    answered before it was served."""
    org = make_org(engine, f"exp-{uuid.uuid4().hex[:8]}")
    admin = manager_of(engine, org)
    at = datetime.now(timezone.utc) + timedelta(seconds=3)
    made = call(gateway, "POST", "/v1/keys", admin, {"expires_at": at.isoformat()}).json()
    expires = datetime.fromisoformat(made["expires_at"])
    assert expires == at
    runs = []
    while len([r for r in runs if r[2] != 200]) < 6:
        sent = datetime.now(timezone.utc)
        resp = requests.post(gateway.base_url + "/v1/chat/completions", timeout=30,
                             json={"model": "fake-model", "messages": MESSAGES},
                             headers={"Authorization": f"Bearer {made['key']}"})
        runs.append((sent, datetime.now(timezone.utc), resp.status_code,
                     resp.json().get("error", {}).get("code")))
    assert any(r[2] == 200 for r in runs)
    for sent, done, status, code in runs:
        if sent >= expires:
            assert (status, code) == (401, "key_expired")
        if done < expires:
            assert status == 200
        assert status in (200, 401)


@pytest.fixture
def key_lease_peaks(engine):
    """Record, with a trigger for the test's duration, how many leases each key holds when one
    is written (in the admission's own transaction): ``peak(key_id)``."""
    ddl = ["CREATE TABLE test_key_leases (key_id bigint, leases bigint)",
           "CREATE FUNCTION test_count_key_leases() RETURNS trigger LANGUAGE plpgsql AS $$ "
           "BEGIN INSERT INTO test_key_leases SELECT NEW.api_key_id, count(*) FROM in_flight "
           "WHERE api_key_id = NEW.api_key_id; RETURN NEW; END $$",
           "CREATE TRIGGER test_key_leases AFTER INSERT ON in_flight FOR EACH ROW "
           "EXECUTE FUNCTION test_count_key_leases()"]
    with engine.begin() as conn:
        for statement in ddl:
            conn.execute(sa.text(statement))

    def peak(key_id):
        with engine.connect() as conn:
            return conn.execute(sa.text("SELECT max(leases) FROM test_key_leases WHERE "
                                        "key_id = :k"), {"k": key_id}).scalar_one()
    yield peak
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TRIGGER test_key_leases ON in_flight"))
        conn.execute(sa.text("DROP FUNCTION test_count_key_leases()"))
        conn.execute(sa.text("DROP TABLE test_key_leases"))


def key_leases(engine, key_id):
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT count(*) FROM in_flight WHERE api_key_id = :k"),
                            {"k": key_id}).scalar_one()


def test_a_keys_in_flight_cap_of_2_holds_under_30_streams(gateway, fake, engine,
                                                          key_lease_peaks):
    """30 streams at once on a key capped at 2 (its org allows 50), the admitted ones held open
    by the backend: 2 admitted, 28 refused 429 ``key_in_flight_limit`` without reaching the
    backend; the backend and the ledger never saw a third. Their endings release the slots;
    leases expired (a dead worker's) are reclaimed by the sweeper at the next admission."""
    org = make_org(engine, f"cap-{uuid.uuid4().hex[:8]}", usd="100", limit=50)
    admin = manager_of(engine, org)
    made = call(gateway, "POST", "/v1/keys", admin, {"in_flight_limit": 2}).json()
    headers = {"Authorization": f"Bearer {made['key']}"}
    opened = threading.Event()
    for _ in range(2):
        fake.enqueue([SSE_HEAD, Send(sse_event(chat_chunk("a", role="assistant"))),
                      Gate(opened), Send(sse_event(chat_chunk(finish_reason="stop"))),
                      Send(sse_event("data: [DONE]\n\n"))])
    wait_until(lambda: fake.active == 0)
    fake.reset_stats()
    body = {"model": "fake-model", "messages": MESSAGES, "stream": True}
    responses = concurrently(30, lambda i: requests.post(
        gateway.base_url + "/v1/chat/completions", json=body, headers=headers, stream=True,
        timeout=60))
    try:
        codes = sorted(r.status_code for r in responses)
        assert codes == [200] * 2 + [429] * 28
        assert {r.json()["error"]["code"] for r in responses if r.status_code == 429} == \
            {"key_in_flight_limit"}
        assert fake.max_active == 2 and len(fake.requests) == 2
        assert key_lease_peaks(made["id"]) == 2 and key_leases(engine, made["id"]) == 2
    finally:
        opened.set()
        for r in responses:
            r.close()
    wait_until(lambda: key_leases(engine, made["id"]) == 0)
    assert chat(gateway, made["key"]) is None

    # Two leases left by a dead worker: the next admission sweeps them and is served.
    held = threading.Event()
    for _ in range(2):
        fake.enqueue([SSE_HEAD, Send(sse_event(chat_chunk("a", role="assistant"))), Gate(held)])
    streams = [requests.post(gateway.base_url + "/v1/chat/completions", json=body,
                             headers=headers, stream=True, timeout=60) for _ in range(2)]
    try:
        assert [s.status_code for s in streams] == [200, 200]
        assert chat(gateway, made["key"]) == "key_in_flight_limit"
        # The two streams' worker is alive and renews their leases every few seconds: a renewal
        # landing between the expiry below and the admission puts them back, rightly. Expired
        # again, a third time at most, the next admission must sweep them.
        for _attempt in range(3):
            with engine.begin() as conn:
                conn.execute(sa.text("UPDATE in_flight SET expires_at = now() - interval "
                                     "'1 minute' WHERE api_key_id = :k"), {"k": made["id"]})
            if (refused := chat(gateway, made["key"])) is None:
                break
        assert refused is None
    finally:
        held.set()
        for s in streams:
            s.close()
    wait_until(lambda: key_leases(engine, made["id"]) == 0)
    assert key_lease_peaks(made["id"]) == 2
    assert balance_nanos(engine, org.id)[1:] == (0, 0)
