"""``GET /openapi.json`` documents the key, activity and generations endpoints as they answer:
real responses of the running gateway, JSON and CSV, validate against the document (the checks
of test_openapi.py), and a key over its spend limit is a documented 402."""
import uuid

import requests
import sqlalchemy as sa

from gateway_proc import make_org
from openapi_checks import check_response

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "Say hello"}]}


def test_key_and_activity_endpoints_match_the_document(gateway, fake, engine, document):
    org = make_org(engine, f"doc-{uuid.uuid4().hex[:8]}")
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE api_keys SET limit_usd = 0.000001, limit_reset = 'weekly', "
                             "rpm_limit = 50 WHERE org_id = :o"), {"o": org.id})
    base = gateway.base_url
    limited = requests.post(base + "/v1/chat/completions", json=BODY, headers=org.headers,
                            timeout=30)
    assert limited.json()["error"]["code"] == "key_limit_exceeded"
    check_response(document, "/v1/chat/completions", limited, "post")
    assert {"/v1/key", "/v1/keys", "/v1/activity", "/v1/generations"} <= set(document["paths"])
    for path, params, headers, status in [
        ("/v1/key", None, org.headers, 200), ("/v1/keys", None, org.headers, 200),
        ("/v1/activity", None, org.headers, 200),
        ("/v1/activity", {"date": "2026-11-30"}, org.headers, 200),
        ("/v1/activity", {"date": "2026-11-31"}, org.headers, 400),
        ("/v1/key", None, {}, 401), ("/v1/activity", None, {}, 401),
        ("/v1/activity", {"format": "csv"}, org.headers, 200),
        ("/v1/activity", None, {**org.headers, "Accept": "text/csv"}, 200),
        ("/v1/activity", {"format": "pdf"}, org.headers, 400),
        ("/v1/generations", None, org.headers, 200),
        ("/v1/generations", {"limit": "1", "status": "rejected"}, org.headers, 200),
        ("/v1/generations", {"format": "csv", "model": "fake-model"}, org.headers, 200),
        ("/v1/generations", {"limit": "501"}, org.headers, 400),
        ("/v1/generations", {"to": "2026-12-01"}, org.headers, 400),
        ("/v1/generations", {"after": "gen-1"}, org.headers, 400),
        ("/v1/generations", None, {}, 401),
        ("/v1/generations", {"model": "m" * 5000}, org.headers, 414),  # gunicorn's, enveloped
    ]:
        resp = requests.get(base + path, params=params, headers=headers, timeout=30)
        assert resp.status_code == status, (path, resp.text)
        media = check_response(document, path, resp)
        assert media == ("text/csv" if "csv" in str(params) + str(headers) and status == 200
                         else "application/json"), (path, params)


def test_the_keys_api_answers_as_documented(gateway, fake, engine, document):
    """Every answer of the keys API, successes and refusals, validates against the document;
    so do a 401 ``key_expired`` and a 403 ``management_key``."""
    from gateway.ledger.key_admin import create_key_row
    org = make_org(engine, f"doc-keys-{uuid.uuid4().hex[:8]}")
    with engine.begin() as conn:
        admin = create_key_row(conn, org.id, name="admin", manage=True)[1]
    base, headers = gateway.base_url, {"Authorization": f"Bearer {admin}"}

    def send(method, path, template, body=None, key_headers=headers, status=200):
        resp = requests.request(method, base + path, json=body, headers=key_headers, timeout=30)
        assert resp.status_code == status, resp.text
        check_response(document, template, resp, method.lower())
        return resp
    made = send("POST", "/v1/keys", "/v1/keys", {"label": "bot", "models": ["fake-model"],
                                                 "in_flight_limit": 2}, status=201).json()
    one = "/v1/keys/{key_id}"
    path = f"/v1/keys/{made['id']}"
    send("GET", path, one)
    send("PATCH", path, one, {"limit_usd": "3", "limit_reset": "never"})
    send("POST", path + "/rotate", one + "/rotate", {"grace_period_s": 5})
    send("GET", "/v1/keys", "/v1/keys")
    send("POST", "/v1/keys", "/v1/keys", {"models": ["nope"]}, status=400)
    send("POST", "/v1/keys", "/v1/keys", {"manage": True}, status=403)
    send("PATCH", path, one, {"label": "x"}, key_headers=org.headers, status=403)
    send("GET", "/v1/keys/999999999", one, status=404)
    send("POST", path + "/rotate", one + "/rotate", {"grace_period_s": 10**6}, status=400)
    send("DELETE", path, one)
    expiring = send("POST", "/v1/keys", "/v1/keys", {"expires_at": "2099-01-01T00:00:00Z"},
                    status=201).json()
    with engine.begin() as conn:  # as if that time had come
        conn.execute(sa.text("UPDATE api_keys SET expires_at = now() WHERE id = :k"),
                     {"k": expiring["id"]})
    expired = {"Authorization": f"Bearer {expiring['key']}"}
    assert send("GET", "/v1/key", "/v1/key", key_headers=expired,
                status=401).json()["error"]["code"] == "key_expired"
    refused = requests.post(base + "/v1/chat/completions", json=BODY, headers=headers,
                            timeout=30)
    assert refused.json()["error"]["code"] == "management_key"
    check_response(document, "/v1/chat/completions", refused, "post")
