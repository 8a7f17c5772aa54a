"""Opt-in CORS (``KILN_CORS_ORIGINS``) through gunicorn: preflights answered without a key or a
charge, and the allowed origin named on every API response, errors and streams included."""
import uuid

import openai
import pytest
import requests
import sqlalchemy as sa

from fake_upstream import Hang, Status, error_reply
from gateway_proc import balance_nanos, make_org

ORIGIN = "https://chat.example.com"
OTHER_ORIGIN = "http://localhost:5173"
MESSAGES = [{"role": "user", "content": "Hello"}]
# Set by the browser itself, never named in Access-Control-Request-Headers.
BROWSER_HEADERS = {"host", "connection", "content-length", "accept-encoding"}
API_PATHS = ("/v1/chat/completions", "/v1/models", "/v1/credits", "/v1/generation")


def sdk_header_names(fake):
    """The request headers the official openai SDK really sends, lowercase, as a browser app
    built on an OpenAI SDK would name them in a preflight (plus the JavaScript SDK's
    ``x-stainless-timeout``)."""
    with openai.OpenAI(base_url=fake.base_url, api_key="sk-test", max_retries=0) as client:
        client.chat.completions.create(model="fake-model", messages=MESSAGES)
    names = {name.lower() for name in fake.requests[-1].headers} - BROWSER_HEADERS
    assert {"authorization", "content-type", "x-stainless-os", "x-stainless-lang"} <= names
    return sorted(names | {"x-stainless-timeout"})


def preflight(gateway, path, origin, requested=None, method="POST"):
    headers = {"Origin": origin, "Access-Control-Request-Method": method}
    if requested:
        headers["Access-Control-Request-Headers"] = ",".join(requested)
    return requests.options(gateway.base_url + path, headers=headers, timeout=30)


def usage_event_count(engine):
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT count(*) FROM usage_events")).scalar_one()


def sdk(gateway, key, origin=ORIGIN):
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0,
                         timeout=30, default_headers={"Origin": origin})


def test_preflights_are_answered_without_key_or_charge(start_gateway, fake, engine):
    gw = start_gateway(cors_origins=f"{ORIGIN}, {OTHER_ORIGIN}/")
    requested = sdk_header_names(fake)
    fake.clear()
    events_before = usage_event_count(engine)
    for path in API_PATHS:
        for origin in (ORIGIN, OTHER_ORIGIN):
            r = preflight(gw, path, origin, requested)
            assert r.status_code == 204 and r.content == b"", (path, r.status_code, r.text)
            assert r.headers["Access-Control-Allow-Origin"] == origin
            assert {"GET", "POST"} <= {m.strip() for m in
                                       r.headers["Access-Control-Allow-Methods"].split(",")}
            allowed = {h.strip() for h in r.headers["Access-Control-Allow-Headers"].split(",")}
            assert set(requested) <= allowed, set(requested) - allowed
            assert int(r.headers["Access-Control-Max-Age"]) >= 60
            assert "Origin" in r.headers["Vary"]
    # A page from another origin learns nothing it may use.
    refused = preflight(gw, "/v1/chat/completions", "https://evil.example", requested)
    assert "Access-Control-Allow-Origin" not in refused.headers
    assert "Access-Control-Allow-Headers" not in refused.headers
    # No header requested: still answered.
    bare = preflight(gw, "/v1/models", ORIGIN, method="GET")
    assert bare.status_code == 204 and bare.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert fake.requests == [] and usage_event_count(engine) == events_before


def test_every_api_answer_names_the_allowed_origin(start_gateway, fake, engine):
    gw = start_gateway(cors_origins=f"{ORIGIN},{OTHER_ORIGIN}")
    org = make_org(engine, f"cors-{uuid.uuid4().hex[:8]}", limit=1)
    broke = make_org(engine, f"cors-broke-{uuid.uuid4().hex[:8]}", usd="0")
    seen = {}

    def answer(label, call, client):
        try:
            raw = call(client)
            seen[label] = (raw.status_code, raw.headers)
            if label.startswith("stream"):
                list(raw.parse())
        except openai.APIStatusError as err:
            seen[label] = (err.status_code, err.response.headers)

    chat = lambda **kw: lambda c: c.chat.completions.with_raw_response.create(  # noqa: E731
        model=kw.pop("model", "fake-model"), messages=kw.pop("messages", MESSAGES), **kw)
    with sdk(gw, org.key) as client, sdk(gw, "kiln-unknown") as stranger, \
            sdk(gw, broke.key) as poor:
        answer("200", chat(), client)
        answer("stream 200", chat(stream=True), client)
        answer("400", chat(messages=[]), client)
        answer("401", chat(), stranger)
        answer("402", chat(), poor)
        answer("404", chat(model="no-such-model"), client)
        fake.enqueue(error_reply(500, "Internal Server Error", plain=True))
        answer("502", chat(), client)
        fake.enqueue(error_reply(500, "Internal Server Error", plain=True))
        answer("stream 502", chat(stream=True), client)
        fake.enqueue(error_reply(429, "busy"))
        answer("503", chat(), client)
        fake.enqueue([Status(200, {"Content-Type": "text/event-stream"}), Hang()])
        with requests.post(gw.base_url + "/v1/chat/completions", headers=org.headers,
                           stream=True, timeout=30,
                           json={"model": "fake-model", "messages": MESSAGES, "stream": True}):
            answer("429", chat(), client)
        answer("models 200", lambda c: c.models.with_raw_response.list(), client)
    assert {label: status for label, (status, _) in seen.items()} == {
        "200": 200, "stream 200": 200, "400": 400, "401": 401, "402": 402, "404": 404,
        "502": 502, "stream 502": 502, "503": 503, "429": 429, "models 200": 200}
    for label, (_, headers) in seen.items():
        assert headers.get("access-control-allow-origin") == ORIGIN, label
        assert "X-Neocloud-Generation-Id" in headers["access-control-expose-headers"], label
        assert "Origin" in headers["vary"], label
    assert seen["502"][1]["content-type"].startswith("text/plain")
    assert "Retry-After" in seen["503"][1]["access-control-expose-headers"]
    for path in ("/v1/generation?id=%00", "/v1/generation?id=gen-0", "/v1/credits"):
        r = requests.get(gw.base_url + path, timeout=30,
                         headers={**org.headers, "Origin": OTHER_ORIGIN})
        assert r.headers["Access-Control-Allow-Origin"] == OTHER_ORIGIN, path
    # Another origin, or a probe: no CORS header at all.
    r = requests.get(gw.base_url + "/v1/credits", timeout=30,
                     headers={**org.headers, "Origin": "https://evil.example"})
    assert r.status_code == 200 and "Access-Control-Allow-Origin" not in r.headers
    for path in ("/healthz", "/metrics"):
        r = requests.get(gw.base_url + path, headers={"Origin": ORIGIN}, timeout=30)
        assert "Access-Control-Allow-Origin" not in r.headers, path
    assert balance_nanos(engine, broke.id) == (0, 0, 0)


def test_any_origin(start_gateway, fake, engine):
    gw = start_gateway(cors_origins="*")
    org = make_org(engine, f"cors-any-{uuid.uuid4().hex[:8]}")
    r = preflight(gw, "/v1/chat/completions", "https://anywhere.example",
                  ["authorization", "content-type"])
    assert r.status_code == 204 and r.headers["Access-Control-Allow-Origin"] == "*"
    assert set(r.headers["Access-Control-Allow-Headers"].split(", ")) == {
        "authorization", "content-type"}
    with sdk(gw, org.key, origin="https://anywhere.example") as client:
        raw = client.chat.completions.with_raw_response.create(model="fake-model",
                                                                messages=MESSAGES)
    assert raw.headers["access-control-allow-origin"] == "*"


def test_cors_is_off_by_default(gateway, fake, org):
    r = preflight(gateway, "/v1/chat/completions", ORIGIN, ["authorization"])
    assert "Access-Control-Allow-Origin" not in r.headers
    with sdk(gateway, org.key) as client:
        raw = client.chat.completions.with_raw_response.create(model="fake-model",
                                                                messages=MESSAGES)
    assert "access-control-allow-origin" not in raw.headers


@pytest.mark.parametrize("setting", ["ftp://files.example", "https://app.example/path",
                                     "*, https://app.example", "app.example"])
def test_a_malformed_origin_setting_stops_the_gateway_at_boot(start_gateway, setting):
    with pytest.raises(RuntimeError, match="KILN_CORS_ORIGINS"):
        start_gateway(cors_origins=setting)


def test_preflights_allow_what_the_anthropic_sdk_and_the_responses_paths_need(
        start_gateway, fake):
    """A browser app on Anthropic's JavaScript SDK names its headers in the preflight of
    ``/v1/messages``; one deleting a stored response asks for DELETE. Both are allowed, and the
    lowered max_tokens header is readable."""
    gw = start_gateway(cors_origins=ORIGIN)
    requested = ["content-type", "x-api-key", "anthropic-version", "anthropic-beta",
                 "anthropic-dangerous-direct-browser-access", "x-stainless-lang"]
    r = preflight(gw, "/v1/messages", ORIGIN, requested)
    assert r.status_code == 204
    allowed = {h.strip() for h in r.headers["Access-Control-Allow-Headers"].split(",")}
    assert set(requested) <= allowed, set(requested) - allowed
    gone = preflight(gw, "/v1/responses/resp_abc", ORIGIN, method="DELETE")
    assert "DELETE" in {m.strip() for m in gone.headers["Access-Control-Allow-Methods"].split(",")}
    answered = requests.post(gw.base_url + "/v1/messages", json={}, timeout=30,
                             headers={"Origin": ORIGIN})
    assert "X-Kiln-Max-Tokens-Lowered" in answered.headers["Access-Control-Expose-Headers"]
