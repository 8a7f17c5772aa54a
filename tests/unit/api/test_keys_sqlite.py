"""The keys API in process on SQLite (the embedded database): the same views and ledger
statements as on Postgres (tests/functional/api/test_keys_api.py), through Flask's test
client."""
import json
from datetime import datetime, timedelta, timezone

import sqlalchemy as sa

import factories
from gateway.ledger.key_admin import create_key_row


def manager(engine, org):
    with engine.begin() as conn:
        secret = create_key_row(conn, org.id, name="admin", manage=True)[1]
    return {"Authorization": f"Bearer {secret}"}


def bearer(secret):
    return {"Authorization": f"Bearer {secret}"}


def test_create_change_rotate_and_revoke_on_sqlite(client, engine, org):
    admin = manager(engine, org)
    at = datetime.now(timezone(timedelta(hours=2))) + timedelta(days=1)
    made = client.post("/v1/keys", headers=admin, json={
        "label": "bot", "expires_at": at.isoformat(), "models": ["fake-model"],
        "requests_per_minute": 5, "in_flight_limit": 2, "limit_usd": "1.5"})
    assert made.status_code == 201, made.get_data(as_text=True)
    view = made.get_json()
    # Kept in UTC: SQLite stores the wall time alone.
    assert datetime.fromisoformat(view["expires_at"]) == at
    assert view["expires_at"].endswith("+00:00")
    assert (view["rate_limit"], view["in_flight_limit"], view["limit_usd"]) == \
        ({"requests_per_minute": 5}, 2, "1.5")
    path = f"/v1/keys/{view['id']}"
    assert client.get("/v1/key", headers=bearer(view["key"])).get_json()["id"] == view["id"]
    changed = client.patch(path, headers=admin, json={"models": None, "rate_limit": None})
    assert (changed.get_json()["models"], changed.get_json()["rate_limit"]) == (None, None)
    rotated = client.post(path + "/rotate", headers=admin, json={"grace_period_s": 60})
    new = rotated.get_json()["key"]
    assert rotated.get_json()["previous_key_expires_at"] is not None
    assert client.get("/v1/key", headers=bearer(new)).status_code == 200
    assert client.delete(path, headers=admin).get_json()["revoked"] is True
    with engine.connect() as conn:
        actions = conn.execute(sa.text("SELECT action FROM key_changes WHERE api_key_id = :k "
                                       "ORDER BY id"), {"k": view["id"]}).scalars().all()
    assert actions == ["create", "update", "rotate", "revoke"]


def test_an_expired_key_is_401_key_expired_on_sqlite(client, engine, org):
    admin = manager(engine, org)
    made = client.post("/v1/keys", headers=admin,
                       json={"expires_at": "2099-01-01T00:00:00Z"}).get_json()
    with engine.begin() as conn:  # as if that time had come, before the key's first use
        conn.execute(sa.text("UPDATE api_keys SET expires_at = :t WHERE id = :k"),
                     {"t": datetime.now(timezone.utc) - timedelta(seconds=1), "k": made["id"]})
    refused = client.post("/v1/chat/completions", json=factories.chat_body(),
                          headers=bearer(made["key"]))
    assert refused.status_code == 401
    assert refused.get_json()["error"]["code"] == "key_expired"


def test_a_management_key_calls_no_model_and_bad_fields_change_nothing(client, engine, org):
    admin = manager(engine, org)
    refused = client.post("/v1/chat/completions", json=factories.chat_body(), headers=admin)
    assert (refused.status_code, refused.get_json()["error"]["code"]) == \
        (403, "management_key")
    before = client.get("/v1/keys", headers=admin).get_json()["data"]
    bad = client.post("/v1/keys", headers=admin, data=b'{"label": ',
                      content_type="application/json")
    assert (bad.status_code, bad.get_json()["error"]["code"]) == (400, "invalid_json")
    huge = client.post("/v1/keys", headers=admin, content_type="application/json",
                       data=json.dumps({"label": "x" * 70_000}))
    assert huge.status_code == 413
    assert client.get("/v1/keys", headers=admin).get_json()["data"] == before
