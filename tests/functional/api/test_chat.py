"""The chat endpoint through gunicorn (gevent workers) in front of the scripted fake upstream:
metering, pricing, the generation header, the usage event and the debit agree exactly."""
import uuid
from decimal import Decimal

import openai
import pytest
import requests

from fake_upstream import Hang, Reset, Send, Status, chat_chunk, chat_completion, error_reply, \
    json_reply, make_usage, sse
from factories import MESSAGES, fake_model_nanos
from gateway_proc import balance_nanos, make_org, settled_event, usage_event, wait_until



def nanos(prompt, completion, cached=0):
    """fake-model's price of these tokens, by literal arithmetic (tests/support/factories.py)."""
    return fake_model_nanos(prompt=prompt, completion=completion, cached=cached)


def test_non_stream_is_metered_priced_and_debited(client, fake, org, engine):
    fake.enqueue(json_reply(chat_completion("Hi!", usage=make_usage(prompt=12, completion=34))))
    before = balance_nanos(engine, org.id)
    raw = client.chat.completions.with_raw_response.create(model="fake-model",
                                                           messages=MESSAGES, max_tokens=50)
    resp = raw.parse()
    gid = raw.headers["X-Neocloud-Generation-Id"]
    assert resp.choices[0].message.content == "Hi!"
    expected = nanos(12, 34)
    assert Decimal(str(resp.usage.model_extra["cost"])) == Decimal(expected) / 10**9
    event = usage_event(engine, gid)
    assert event["status"] == "completed" and event["cost_nanos"] == expected
    assert (event["prompt_tokens"], event["completion_tokens"]) == (12, 34)
    assert not event["estimated"]
    after = balance_nanos(engine, org.id)
    assert before[0] - after[0] == expected
    assert after[1:] == (0, 0)  # hold released, no lease left


def test_usage_above_the_hold_is_billed_in_full_and_flagged(client, fake, org, engine):
    """A backend reporting more than the request was held for is billed what it reported (the
    org's balance covers it), never silently capped; the event is flagged as an anomaly.
    Prices: 0.10 and 0.30 USD per million tokens."""
    fake.enqueue(json_reply(chat_completion("Hi!", usage=make_usage(prompt=100000,
                                                                     completion=900))))
    raw = client.chat.completions.with_raw_response.create(model="fake-model",
                                                           messages=MESSAGES, max_tokens=10)
    event = usage_event(engine, raw.headers["X-Neocloud-Generation-Id"])
    # 100000 × 0.10 + 900 × 0.30 = 10,270 micro-dollars
    assert event["cost_nanos"] == 10_270_000 > event["hold_nanos"]
    assert event["anomaly"] is True and event["completion_tokens"] == 900
    assert Decimal(str(raw.parse().usage.model_extra["cost"])) == Decimal("0.01027")
    assert balance_nanos(engine, org.id) == (10 * 10**9 - 10_270_000, 0, 0)


def test_usage_above_what_the_org_has_is_debited_to_zero_not_below(client, fake, engine):
    """With less left than a lying backend reports, the debit stops at the balance: the event
    records what was debited and is flagged."""
    poor = make_org(engine, f"poor-{uuid.uuid4().hex[:8]}", usd="0.001")
    fake.enqueue(json_reply(chat_completion("Hi!", usage=make_usage(prompt=100000,
                                                                     completion=900))))
    with openai.OpenAI(base_url=client.base_url, api_key=poor.key, max_retries=0) as c:
        raw = c.chat.completions.with_raw_response.create(model="fake-model",
                                                          messages=MESSAGES, max_tokens=10)
    event = usage_event(engine, raw.headers["X-Neocloud-Generation-Id"])
    assert event["cost_nanos"] == 1_000_000 and event["anomaly"] is True
    assert balance_nanos(engine, poor.id) == (0, 0, 0)
    # the reply tells the cost that was charged, not a price nobody paid
    assert Decimal(str(raw.parse().usage.model_extra["cost"])) == Decimal("0.001")


def test_stream_usage_chunk_has_cost_when_asked(client, fake, org, engine):
    usage = make_usage(prompt=50, completion=3)
    fake.enqueue(sse([chat_chunk("a"), chat_chunk("b"), chat_chunk("c"),
                      chat_chunk(finish_reason="stop"), chat_chunk(usage=usage, choices=False)]))
    raw = client.chat.completions.with_raw_response.create(
        model="fake-model", messages=MESSAGES, stream=True,
        stream_options={"include_usage": True})
    gid = raw.headers["X-Neocloud-Generation-Id"]
    chunks = list(raw.parse())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "abc"
    assert chunks[-1].usage.completion_tokens == 3
    assert Decimal(str(chunks[-1].usage.model_extra["cost"])) == Decimal(nanos(50, 3)) / 10**9
    event = settled_event(engine, gid)
    assert event["status"] == "completed" and event["cost_nanos"] == nanos(50, 3)
    # The upstream was asked for usage even though it is the gateway that meters.
    assert fake.requests[-1].json["stream_options"] == {"include_usage": True}


def test_stream_usage_is_stripped_when_not_asked(client, fake, org, engine):
    fake.enqueue(sse([chat_chunk("x", usage=make_usage(5, 1)), chat_chunk(finish_reason="stop"),
                      chat_chunk(usage=make_usage(5, 1), choices=False)]))
    raw = client.chat.completions.with_raw_response.create(model="fake-model", messages=MESSAGES,
                                                           stream=True)
    gid = raw.headers["X-Neocloud-Generation-Id"]
    chunks = list(raw.parse())
    assert all(c.usage is None for c in chunks)
    assert len(chunks) == 2
    assert fake.requests[-1].json["stream_options"] == {"include_usage": True}
    event = settled_event(engine, gid)
    assert event["cost_nanos"] == nanos(5, 1)


def test_stream_without_upstream_usage_is_metered_and_flagged_estimated(client, fake, engine):
    fake.enqueue(sse([chat_chunk("one"), chat_chunk(" two"), chat_chunk(finish_reason="stop")]))
    raw = client.chat.completions.with_raw_response.create(
        model="fake-model", messages=MESSAGES, stream=True,
        stream_options={"include_usage": True})
    gid = raw.headers["X-Neocloud-Generation-Id"]
    chunks = list(raw.parse())
    usage = chunks[-1].usage
    # No tokenizer for this backend: the generated text's bytes ("one two" is 7), which errs
    # upward (docs/METERING.md); the prompt is "Say hello" (9 bytes) + 8 + 32 template tokens.
    assert usage.completion_tokens == 7 and usage.prompt_tokens == 49
    assert usage.model_extra["estimated"] is True
    event = settled_event(engine, gid)
    assert event["estimated"] and event["completion_tokens"] == 7
    assert event["cost_nanos"] == 7_000  # 49 × 0.10 + 7 × 0.30 micro-dollars
    assert Decimal(str(usage.model_extra["cost"])) == Decimal(event["cost_nanos"]) / 10**9


def test_missing_and_unknown_key_are_401(gateway, fake):
    url = gateway.base_url + "/v1/chat/completions"
    body = {"model": "fake-model", "messages": MESSAGES}
    for headers in ({}, {"Authorization": "Bearer kiln-nope"}, {"Authorization": "Basic x"}):
        r = requests.post(url, json=body, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert fake.requests == []


def test_revoked_key_and_suspended_org_are_403(gateway, fake, engine):
    from gateway.api.auth import PREFIX_LEN, revoke_key
    url = gateway.base_url + "/v1/chat/completions"
    body = {"model": "fake-model", "messages": MESSAGES}
    revoked = make_org(engine, "revoked-" + str(id(body)))
    with engine.begin() as conn:
        assert revoke_key(conn, revoked.key[:PREFIX_LEN])
    r, = wait_until(lambda: (x := requests.post(url, json=body, headers=revoked.headers))
                    .status_code == 403 and (x,), timeout_s=5)
    assert r.json()["error"]["code"] == "key_revoked"
    suspended = make_org(engine, "suspended-" + str(id(body)))
    with engine.begin() as conn:
        conn.exec_driver_sql(f"UPDATE orgs SET status = 'suspended' WHERE id = {suspended.id}")
    r, = wait_until(lambda: (x := requests.post(url, json=body, headers=suspended.headers))
                    .status_code == 403 and (x,), timeout_s=5)
    assert r.json()["error"]["code"] == "org_suspended"
    assert fake.requests == []


def test_unknown_model_is_404_model_not_found(client, fake):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    assert fake.requests == []


def test_models_list_publishes_catalog(client):
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {"fake-model", "fake-vision", "gpt-oss-fake", "fake-embed"}
    vision = models["fake-vision"].model_extra
    assert vision["input_modalities"] == ["text", "image"]
    assert vision["pricing"]["output"] == "10"
    assert vision["capabilities"]["forced_tool_choice"] is True
    assert models["fake-model"].model_extra["context_window"] == 8192
    assert models["fake-model"].model_extra["endpoints"] == ["chat", "completions"]


def test_insufficient_credits_is_402(gateway, fake, engine):
    poor = make_org(engine, "poor-" + str(id(fake)), usd="0.0000001")
    with openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=poor.key,
                       max_retries=0) as c, pytest.raises(openai.APIStatusError) as err:
        c.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=1000)
    assert err.value.status_code == 402
    assert err.value.body["code"] == "insufficient_credits"
    assert "max_tokens" in err.value.body["message"]
    assert fake.requests == []
    assert balance_nanos(engine, poor.id) == (100, 0, 0)


def test_upstream_unreachable_or_5xx_is_502_plain_text(gateway, fake, org, engine):
    url = gateway.base_url + "/v1/chat/completions"
    body = {"model": "fake-model", "messages": MESSAGES}
    for script in (error_reply(500, "boom"), [Reset()], error_reply(503, "down", plain=True)):
        fake.enqueue(script)
        r = requests.post(url, json=body, headers=org.headers)
        assert r.status_code == 502
        assert r.headers["Content-Type"].startswith("text/plain")
        event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
        assert event["status"] == "upstream_error" and event["cost_nanos"] == 0
    assert balance_nanos(engine, org.id) == (10 * 10**9, 0, 0)


def test_upstream_400_is_passed_on_as_400_envelope(client, fake, org, engine):
    fake.enqueue(error_reply(400, "This model's maximum context length is 8192 tokens"))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="fake-model", messages=MESSAGES)
    assert "maximum context length" in err.value.body["message"]
    assert err.value.body["type"] == "invalid_request_error"
    assert balance_nanos(engine, org.id) == (10 * 10**9, 0, 0)


def test_ninth_concurrent_request_is_429_without_rate_limit_headers(gateway, fake, org, engine):
    import threading
    hold = [Status(200, {"Content-Type": "text/event-stream"}), Hang()]
    for _ in range(8):
        fake.enqueue(hold)
    url = gateway.base_url + "/v1/chat/completions"
    body = {"model": "fake-model", "messages": MESSAGES, "stream": True}
    responses = []

    def open_stream():
        responses.append(requests.post(url, json=body, headers=org.headers, stream=True))
    threads = [threading.Thread(target=open_stream) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_until(lambda: fake.active == 8)
    r = requests.post(url, json=body, headers=org.headers)
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert not [h for h in r.headers if h.lower().startswith(("x-ratelimit", "retry-after"))]
    for resp in responses:
        resp.close()
    wait_until(lambda: balance_nanos(engine, org.id)[2] == 0)


@pytest.mark.parametrize("ending,status", [(Reset(), "upstream_error"), (Hang(), "timeout")])
def test_non_stream_reply_failing_mid_body_is_502_and_recorded(start_gateway, fake, org, engine,
                                                             ending, status):
    """The status line came, then the body broke (reset) or stopped (read timeout)."""
    gw = start_gateway(upstream_read_timeout_s=1)
    fake.enqueue([Status(200, {"Content-Type": "application/json", "Content-Length": "500"}),
                  Send(b'{"id": "chatcmpl-1", "choices": ['), ending])
    r = requests.post(gw.base_url + "/v1/chat/completions", headers=org.headers, timeout=30,
                      json={"model": "fake-model", "messages": MESSAGES})
    assert r.status_code == 502 and r.headers["Content-Type"].startswith("text/plain")
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert event["status"] == status and event["http_status"] == 502
    assert event["error"] and event["cost_nanos"] == 0
    assert balance_nanos(engine, org.id) == (10 * 10**9, 0, 0)


def test_key_allow_list_refuses_other_models_with_403(gateway, fake, engine):
    from gateway.api import auth
    org = make_org(engine, "allow-" + uuid.uuid4().hex[:8])
    with engine.begin() as conn:
        key = auth.create_key(conn, org.id, allowed_models=["fake-vision"])
    url = gateway.base_url + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {key}"}
    r = requests.post(url, headers=headers, json={"model": "fake-model", "messages": MESSAGES})
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
    assert r.json()["error"]["param"] == "model"
    assert fake.requests == [] and balance_nanos(engine, org.id) == (10 * 10**9, 0, 0)
    ok = requests.post(url, headers=headers, json={"model": "fake-vision", "messages": MESSAGES})
    assert ok.status_code == 200
