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
