"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` through the real gateway and the
scripted fake upstream, as the official ``anthropic`` SDK sees them: auth by ``x-api-key`` or
bearer, any ``anthropic-version`` and ``anthropic-beta``, each answer billed exactly once
(endpoint ``messages``), and each of Kiln's error statuses raised as the SDK's class for it, in
Anthropic's envelope with Kiln's code beside the type (docs/MESSAGES.md, "Errors").
"""
import threading
from decimal import Decimal

import anthropic
import pytest
import requests

from factories import fake_model_nanos
from fake_upstream import Gate, chat_chunk, chat_completion, error_reply, json_reply, \
    make_usage, sse
from gateway_proc import balance_nanos, make_org, settled_event, wait_until
from streams import GRANT, RawStream, close_raw_streams, org_events

ASK = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(autouse=True)
def raw_streams_closed():
    yield
    close_raw_streams()


def sdk(gateway, key=None, **options):
    return anthropic.Anthropic(base_url=gateway.base_url, max_retries=0, timeout=30,
                               **({"api_key": key} if key else {}), **options)


@pytest.mark.parametrize("auth", ["x-api-key", "bearer"])
def test_an_answer_is_billed_once_whatever_the_auth_and_version(gateway, fake, org, engine,
                                                                auth):
    """Any ``anthropic-version`` date and ``anthropic-beta`` list are accepted: clients send
    newer ones than any list Kiln could keep."""
    fake.enqueue(json_reply(chat_completion("Hi!", usage=make_usage(prompt=12, completion=34))))
    before = balance_nanos(engine, org.id)
    headers = {"anthropic-version": "2099-12-31", "anthropic-beta": "some-beta-2099-01-01,x"}
    options = {"api_key": org.key} if auth == "x-api-key" else {"auth_token": org.key}
    with anthropic.Anthropic(base_url=gateway.base_url, max_retries=0, timeout=30,
                             default_headers=headers, **options) as client:
        raw = client.messages.with_raw_response.create(model="fake-model", max_tokens=50,
                                                       messages=ASK)
    sent = fake.requests[-1]
    assert "x-api-key" not in sent.headers and org.key not in str(sent.headers)
    message = raw.parse()
    assert message.content[0].text == "Hi!" and message.stop_reason == "end_turn"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (12, 34)
    gid = raw.headers["X-Neocloud-Generation-Id"]
    event = settled_event(engine, gid)
    assert (event["endpoint"], event["status"], event["cost_nanos"]) == \
        ("messages", "completed", fake_model_nanos(12, 34))
    assert Decimal(str(message.usage.model_extra["cost"])) == \
        Decimal(event["cost_nanos"]) / 10**9
    assert [e["id"] for e in org_events(engine, org.id)] == [gid]
    assert balance_nanos(engine, org.id) == (before[0] - event["cost_nanos"], 0, 0)


def test_count_tokens_is_authenticated_and_never_billed(gateway, fake, org, engine):
    with sdk(gateway, org.key) as client:
        counted = client.messages.count_tokens(model="fake-model", messages=ASK,
                                               system="Be brief.")
    assert counted.input_tokens > 0
    with sdk(gateway, "kiln-nope") as client, pytest.raises(anthropic.AuthenticationError):
        client.messages.count_tokens(model="fake-model", messages=ASK)
    assert fake.requests == [] and org_events(engine, org.id) == []
    assert balance_nanos(engine, org.id) == (GRANT, 0, 0)


# -- each of Kiln's statuses, as the SDK raises it ----------------------------------------

def revoked(engine):
    from gateway.api.auth import PREFIX_LEN, revoke_key
    org = make_org(engine, "msg-revoked-" + str(id(engine)) + str(threading.get_ident()))
    with engine.begin() as conn:
        assert revoke_key(conn, org.key[:PREFIX_LEN])
    return org


def expect_error(gateway, key, error_class, status, kind, code, **create):
    """Call ``messages.create`` until it raises ``error_class`` (a key cache may answer the
    first call from before a change); return the error."""
    body = {"model": "fake-model", "max_tokens": 50, "messages": ASK, **create}

    def attempt():
        with sdk(gateway, key) as client:
            try:
                client.messages.create(**body)
            except anthropic.APIStatusError as err:
                return err if isinstance(err, error_class) else None
        return None
    err = wait_until(attempt, timeout_s=5)
    assert err.status_code == status
    assert err.body["type"] == "error"
    assert (err.body["error"]["type"], err.body["error"]["code"]) == (kind, code)
    assert err.body["error"]["message"]
    return err


def test_400_is_a_bad_request_error(gateway, fake, org, engine):
    err = expect_error(gateway, org.key, anthropic.BadRequestError, 400,
                       "invalid_request_error", "unknown_parameter", extra_body={"n": 2})
    assert "Extra inputs are not permitted" in err.body["error"]["message"]
    assert err.body["error"]["param"] == "n"
    assert fake.requests == [] and org_events(engine, org.id) == []


def test_401_is_an_authentication_error(gateway, fake):
    expect_error(gateway, "kiln-nope", anthropic.AuthenticationError, 401,
                 "authentication_error", "invalid_api_key")
    assert fake.requests == []


def test_a_request_without_a_key_is_told_both_headers(gateway, fake):
    """Anthropic's clients send ``x-api-key``, OpenAI's ``Authorization: Bearer``: the 401 of a
    request with neither names both."""
    r = requests.post(gateway.base_url + "/v1/messages", timeout=10,
                      json={"model": "fake-model", "max_tokens": 5,
                            "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401
    error = r.json()["error"]
    assert error["type"] == "authentication_error"
    assert "x-api-key" in error["message"] and "Authorization: Bearer" in error["message"]
    assert fake.requests == []


def test_402_is_a_billing_error(gateway, fake, engine):
    poor = make_org(engine, "msg-poor-" + str(id(fake)), usd="0.0000001")
    err = expect_error(gateway, poor.key, anthropic.APIStatusError, 402, "billing_error",
                       "insufficient_credits", max_tokens=1000)
    assert isinstance(err, anthropic.PaymentRequiredError)  # the SDK's class for 402
    assert fake.requests == [] and balance_nanos(engine, poor.id) == (100, 0, 0)


def test_403_is_a_permission_error(gateway, fake, engine):
    expect_error(gateway, revoked(engine).key, anthropic.PermissionDeniedError, 403,
                 "permission_error", "key_revoked")
    assert fake.requests == []


def test_404_is_a_not_found_error(gateway, fake, org):
    err = expect_error(gateway, org.key, anthropic.NotFoundError, 404, "not_found_error",
                       "model_not_found", model="claude-opus-4-8")
    assert err.body["error"]["param"] == "model"
    assert fake.requests == []


def test_413_is_request_too_large(start_gateway, fake, org, engine):
    """Over the body limit (2 KiB here; the SDK sends the whole body before it reads an
    answer, so the body is one the socket's buffers take at once)."""
    gw = start_gateway(workers=1, max_body_bytes=2048)
    big = [{"role": "user", "content": "x" * 4096}]
    err = expect_error(gw, org.key, anthropic.APIStatusError, 413, "request_too_large",
                       "request_too_large", messages=big)
    assert isinstance(err, anthropic.ContentTooLargeError)  # the SDK's class for 413
    assert fake.requests == [] and org_events(engine, org.id) == []


def test_429_is_a_rate_limit_error(gateway, fake, engine):
    """The org's in-flight limit (1) is taken by an open stream: the next request is 429."""
    busy = make_org(engine, "msg-busy-" + str(id(fake)), limit=1)
    gate = threading.Event()
    status, *frames = sse([chat_chunk("a"), chat_chunk(finish_reason="stop")])
    fake.enqueue([status, frames[0], Gate(gate), *frames[1:]])
    held = RawStream(gateway.base_url, busy.key, {"model": "fake-model", "max_tokens": 10,
                                                  "messages": ASK, "stream": True},
                     path="/v1/messages").read_head()
    try:
        expect_error(gateway, busy.key, anthropic.RateLimitError, 429, "rate_limit_error",
                     "rate_limit_exceeded")
    finally:
        gate.set()
    held.read_all()
    assert b"event: message_stop" in held.body
    events = org_events(engine, busy.id)
    assert len(events) == 1 and settled_event(engine, events[0]["id"])["status"] == "completed"


@pytest.mark.parametrize("backend,status,kind,code,error_class", [
    (error_reply(500, "boom"), 502, "api_error", "upstream_error",
     anthropic.InternalServerError),
    (error_reply(429, "busy"), 503, "overloaded_error", "service_unavailable",
     anthropic.ServiceUnavailableError),
], ids=["backend-500", "backend-429"])
def test_5xx_is_an_internal_server_error(gateway, fake, org, engine, backend, status, kind,
                                         code, error_class):
    """A backend's failure is 502 ``api_error``; a busy backend 503 ``overloaded_error`` with
    ``Retry-After`` (Anthropic's 529 class; the SDKs retry both). Neither is billed."""
    fake.enqueue(backend)
    err = expect_error(gateway, org.key, error_class, status, kind, code)
    assert isinstance(err, anthropic.InternalServerError)
    if status == 503:
        assert err.response.headers["Retry-After"] == "1"
    gid = err.response.headers["X-Neocloud-Generation-Id"]
    assert err.body["request_id"] == gid
    assert settled_event(engine, gid)["cost_nanos"] == 0
    assert balance_nanos(engine, org.id) == (GRANT, 0, 0)
