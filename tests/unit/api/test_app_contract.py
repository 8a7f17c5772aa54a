"""The request contract in process: Flask's test client on a Kiln over SQLite, no gunicorn.

Every row of the contract table (``contract_table.REJECTED``, which the real gateway also
runs) is refused here with its status, ``error.code`` and ``param``, and leaves nothing behind:
no usage event, no lease, no change to the balance. The catalog's backend is a port where
nothing listens, so a row that reached a backend would fail loudly.
"""
import json

import pytest
import sqlalchemy as sa

import factories
from contract_table import REJECTED, START_NANOS, trace
from factories import CATALOG

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("body,status,code,param",
                         [pytest.param(*case[1:], id=case[0]) for case in REJECTED])
def test_rejected_in_process(kiln, org, body, status, code, param):
    app, engine = kiln
    r = app.test_client().post("/v1/chat/completions", json=body, headers=org.headers)
    assert r.headers["Content-Type"].startswith("application/json")
    error = r.get_json()["error"]
    assert (r.status_code, error["code"], error["param"]) == (status, code, param)
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert trace(engine, org.id) == (0, 0, START_NANOS, 0, 0)


def test_a_valid_body_reaches_admission_and_the_backend(kiln, org):
    """The control row: the same client and app do admit a valid body (and then find no
    backend), so the refusals above are the contract's, not the harness's."""
    app, engine = kiln
    other = factories.org(engine)
    r = app.test_client().post("/v1/chat/completions", json=factories.chat_body(),
                               headers=other.headers)
    assert r.status_code == 502 and r.headers.get("X-Neocloud-Generation-Id")
    events, leases, balance, held, in_flight = trace(engine, other.id)
    assert (events, leases, balance, held, in_flight) == (1, 0, START_NANOS, 0, 0)


@pytest.mark.parametrize("headers,status,code", [
    ({}, 401, "invalid_api_key"),
    ({"Authorization": "Bearer kiln-not-a-key"}, 401, "invalid_api_key"),
])
def test_a_missing_or_unknown_key_is_401(client, headers, status, code):
    r = client.post("/v1/chat/completions", json=factories.chat_body(),
                                   headers=headers)
    assert (r.status_code, r.get_json()["error"]["code"]) == (status, code)


def test_credits_in_process(client, org):
    r = client.get("/v1/credits", headers=org.headers)
    assert r.status_code == 200
    assert (r.get_json()["balance_usd"], r.get_json()["in_flight"]) == ("10", 0)


def test_an_integer_too_long_for_python_is_a_400_that_names_no_internals(kiln, org):
    app, engine = kiln
    raw = b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "seed": ' \
        + b"9" * 5000 + b"}"
    r = app.test_client().post("/v1/chat/completions", data=raw, headers=org.headers,
                               content_type="application/json")
    error = r.get_json()["error"]
    assert (r.status_code, error["code"]) == (400, "invalid_value")
    assert "sys." not in error["message"] and "digits" not in error["message"]
    assert trace(engine, org.id) == (0, 0, START_NANOS, 0, 0)


def test_escaped_surrogate_pairs_are_text_and_are_forwarded_as_utf8():
    """Clients with ``ensure_ascii`` (Python's json) send an emoji as ``\\ud83d\\ude00``: a
    pair, so valid text, unlike the lone surrogates the contract table refuses."""
    from gateway.backends.upstream import encode_body
    from gateway.contract.json_body import parse_json_body
    raw = json.dumps({"messages": [{"role": "user", "content": "hi \U0001F600"}]}).encode()
    assert b"\\ud83d\\ude00" in raw
    body = parse_json_body(raw, "application/json", 10**6)
    assert body["messages"][0]["content"] == "hi \U0001F600"
    assert "hi \U0001F600".encode() in encode_body(body)


def test_an_expired_key_is_looked_up_once_however_many_requests_use_it(tmp_path, monkeypatch):
    """When a cached key expires, the requests arriving during its new lookup keep the last
    answer: one database query, not one per request (a burst on one key at each expiry)."""
    import gevent

    import gateway.api.auth
    app, engine = factories.sqlite_app(tmp_path, CATALOG.format(url=factories.UNREACHABLE_BACKEND),
                                       key_cache_ttl_s=1.0)
    org = factories.org(engine)
    real, lookups = gateway.api.auth.lookup, []

    def slow_lookup(*args):
        lookups.append(args)
        gevent.sleep(0.1)  # a database round trip, during which the others arrive
        return real(*args)
    monkeypatch.setattr(gateway.api.auth, "lookup", slow_lookup)

    def credits():
        return app.test_client().get("/v1/credits", headers=org.headers).status_code
    assert credits() == 200 and len(lookups) == 1
    gevent.sleep(1.1)  # the entry expires (a second: 20 requests on a slow machine fit in it)
    assert [g.get() for g in [gevent.spawn(credits) for _ in range(20)]] == [200] * 20
    assert len(lookups) == 2
    with engine.begin() as conn:  # a deleted key is forgotten at its next lookup
        conn.execute(sa.text("DELETE FROM api_keys WHERE org_id = :o"), {"o": org.id})
    gevent.sleep(1.1)
    assert credits() == 401  # the request that looks it up again learns it is gone
    assert credits() == 401 and len(lookups) == 3  # remembered as unknown, not asked again
    engine.dispose()


def test_a_worker_tries_to_write_last_used_once_per_key_per_interval(tmp_path, monkeypatch,
                                                                     caplog):
    """Twenty calls with one key: one write of ``last_used_at`` is started (off the request, in
    a greenlet), and the next only after the interval; a write that fails is logged and the
    request is still answered."""
    import gevent

    import gateway.api.auth
    app, engine = factories.sqlite_app(tmp_path, CATALOG.format(url=factories.UNREACHABLE_BACKEND),
                                       key_last_used_interval_s=60)
    org = factories.org(engine)
    real, touches, broken = gateway.api.auth.touch_last_used, [], sa.create_engine(
        f"sqlite:///{tmp_path}/missing/kiln.db")

    def touch(db, key_id, interval_s):
        touches.append(key_id)
        return real(broken if len(touches) > 1 else db, key_id, interval_s)
    monkeypatch.setattr(gateway.api.auth, "touch_last_used", touch)
    client = app.test_client()
    paths = ["/v1/credits", "/v1/key", "/v1/generation?id=gen-none"] * 7
    assert {client.get(p, headers=org.headers).status_code for p in paths[:20]} == {200, 404}
    gevent.sleep(0)  # the spawned write runs
    with engine.connect() as conn:
        key_id, used = conn.execute(sa.text("SELECT id, last_used_at FROM api_keys WHERE "
                                            "org_id = :o"), {"o": org.id}).one()
    assert touches == [key_id] and used is not None
    app.extensions["kiln.key_used"][key_id] -= 60  # the interval has passed
    assert client.get("/v1/key", headers=org.headers).status_code == 200
    gevent.sleep(0)
    assert touches == [key_id, key_id]
    assert f"writing last_used_at of key {key_id} failed" in caplog.text
    engine.dispose()
