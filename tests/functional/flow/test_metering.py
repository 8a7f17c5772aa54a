"""Metering through gunicorn with the scripted fake upstream (README "Metering", docs/METERING.md):
Kiln stops a backend at the budget it held for, replaces malformed usage with its own count that
errs upward, and counts everything generated. Prices: 0.10 / 0.30 USD per million tokens."""
import json

import pytest
import requests

from factories import MESSAGES
from fake_upstream import chat_chunk, chat_completion, json_reply, make_usage, sse
from gateway_proc import balance_nanos, usage_event



def post(gateway, org, **body):
    return requests.post(gateway.base_url + "/v1/chat/completions", timeout=30,
                         json={"model": "fake-model", "messages": MESSAGES, **body},
                         headers=org.headers)


def sse_payloads(text):
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


def chunks_of(text):
    return [json.loads(p) for p in sse_payloads(text) if p != "[DONE]"]


def anomalies(gateway):
    text = requests.get(gateway.base_url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kiln_usage_anomalies_total{"))


def test_a_backend_that_ignores_max_tokens_is_cut_at_the_cap_and_billed_the_cap(
        gateway, fake, org, engine):
    before = anomalies(gateway)
    fake.enqueue(sse([chat_chunk("tok ") for _ in range(50)]
                     + [chat_chunk(finish_reason="length")], delay_s=0.02))
    r = post(gateway, org, stream=True, max_tokens=5, stream_options={"include_usage": True})
    chunks = chunks_of(r.text)
    content = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert content[:5] == ["tok "] * 5 and len([c for c in content if c]) == 5
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "length" and r.text.endswith("data: [DONE]\n\n")
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 5 and usage["total_tokens"] == usage["prompt_tokens"] + 5
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert event["completion_tokens"] == 5 and event["anomaly"] is True
    assert event["status"] == "completed"
    assert anomalies(gateway) == before + 1
    gid = r.headers["X-Neocloud-Generation-Id"]
    logged = [json.loads(line[line.index("{"):]) for line in gateway.log().splitlines()
              if "usage_anomaly" in line and gid in line]
    assert [(e["generation_id"], e["completion_cap"]) for e in logged] == [(gid, 5)]
    # the backend was closed at the cut, long before its 50 chunks were sent
    record = fake.wait_for(lambda rs: rs[-1].closed_at is not None and rs[-1])
    assert not record.completed


def test_a_backend_that_packs_many_tokens_into_each_delta_is_cut_by_their_bytes(
        gateway, fake, org, engine):
    # No usage, no tokenizer, max_tokens ignored: each 2,000-byte delta holds at least
    # ⌈2000 / 64⌉ = 32 tokens, so the first delta is already past a cap of 5.
    before = anomalies(gateway)
    fake.enqueue(sse([chat_chunk("w" * 2000) for _ in range(5)]
                     + [chat_chunk(finish_reason="stop")], delay_s=0.02))
    r = post(gateway, org, stream=True, max_tokens=5, stream_options={"include_usage": True})
    chunks = chunks_of(r.text)
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks if c["choices"])
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert event["completion_tokens"] == 0 and event["anomaly"] is True
    assert anomalies(gateway) == before + 1
    record = fake.wait_for(lambda rs: rs[-1].closed_at is not None and rs[-1])
    assert not record.completed


def test_a_reply_proven_past_the_cap_is_billed_its_bytes_uncapped(gateway, fake, org, engine):
    # A non-stream reply cannot be cut: 6,400 bytes hold at least 100 tokens, past the cap
    # of 5, so the cap no longer bounds Kiln's estimate and the bytes are billed.
    usage = make_usage(prompt=9, completion=0)
    del usage["completion_tokens"]
    fake.enqueue(json_reply(chat_completion("y" * 6400, usage=usage)))
    r = post(gateway, org, max_tokens=5)
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 6400
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert (event["completion_tokens"], event["anomaly"], event["estimated"]) == \
        (6400, True, True)


@pytest.mark.parametrize("completion", [None, "12", -3, 2.5, True, {}, "missing"])
def test_a_malformed_completion_count_is_replaced_by_kilns_own_from_above(
        gateway, fake, org, engine, completion):
    usage = make_usage(prompt=9, completion=0)
    if completion == "missing":
        del usage["completion_tokens"]
    else:
        usage["completion_tokens"] = completion
    text = "x" * 400  # 400 bytes of generated text, no tokenizer: 400 tokens at most
    fake.enqueue(json_reply(chat_completion(text, usage=usage)))
    r = post(gateway, org, max_tokens=1000)
    assert r.status_code == 200
    reply = r.json()["usage"]
    assert reply["prompt_tokens"] == 9 and reply["completion_tokens"] == 400
    assert reply["total_tokens"] == 409 and reply["estimated"] is True
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert (event["prompt_tokens"], event["completion_tokens"], event["estimated"]) == \
        (9, 400, True)
    # 9 × 0.10 + 400 × 0.30 = 120.9 micro-dollars, the cost the reply told
    assert event["cost_nanos"] == 120_900 and str(reply["cost"]) == "0.0001209"


@pytest.mark.parametrize("prompt", [None, "9", -1, 1e3 + 0.5])
def test_a_malformed_prompt_count_is_estimated_from_the_bytes_sent(gateway, fake, org, engine,
                                                                   prompt):
    usage = make_usage(prompt=0, completion=3)
    usage["prompt_tokens"] = prompt
    fake.enqueue(json_reply(chat_completion("abc", usage=usage)))
    r = post(gateway, org)
    reply = r.json()["usage"]
    # "Say hello" (9 bytes) + 8 template tokens for the message + 32 for the request
    assert reply["prompt_tokens"] == 49 and reply["completion_tokens"] == 3
    assert usage_event(engine, r.headers["X-Neocloud-Generation-Id"])["prompt_tokens"] == 49


def test_reasoning_without_usage_is_billed_by_its_bytes_not_one_token(gateway, fake, org,
                                                                      engine):
    delta = "r" * 2048
    events = [{"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
               "choices": [{"index": 0, "delta": {"reasoning_content": delta},
                            "finish_reason": None}]} for _ in range(3)]
    fake.enqueue(sse(events + [chat_chunk("ok", finish_reason="stop")]))
    r = post(gateway, org, stream=True)
    assert r.text.endswith("data: [DONE]\n\n")
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    # 3 × 2048 bytes of reasoning + "ok": bytes, within the model's 1024-token max output
    assert event["completion_tokens"] == 1024 and event["estimated"] is True


def test_tool_call_arguments_are_counted(gateway, fake, org, engine):
    call = {"index": 0, "id": "c1", "type": "function",
            "function": {"name": "lookup", "arguments": "{\"q\": \"" + "z" * 300 + "\"}"}}
    fake.enqueue(sse([chat_chunk(tool_calls=[call]), chat_chunk(finish_reason="tool_calls")]))
    r = post(gateway, org, stream=True)
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert event["completion_tokens"] == len("lookup") + len(call["function"]["arguments"])


def test_running_usage_is_not_shown_and_the_final_one_is_billed(gateway, fake, org, engine):
    running = [chat_chunk("a", usage=make_usage(prompt=7, completion=1)),
               chat_chunk("b", usage=make_usage(prompt=7, completion=2)),
               chat_chunk(finish_reason="stop", usage=make_usage(prompt=7, completion=2)),
               chat_chunk(choices=False, usage=make_usage(prompt=7, completion=2))]
    fake.enqueue(sse(running))
    r = post(gateway, org, stream=True)
    chunks = chunks_of(r.text)
    assert all("usage" not in c for c in chunks)  # the client did not ask for usage
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert (event["prompt_tokens"], event["completion_tokens"], event["estimated"]) == \
        (7, 2, False)
    assert balance_nanos(engine, org.id)[0] == 10 * 10**9 - 1_300  # 7 × 0.1 + 2 × 0.3 µ$


@pytest.mark.parametrize("cached", [None, "3", -1, 2.5, "missing"])
def test_a_malformed_cached_count_is_billed_as_not_cached(gateway, fake, org, engine, cached):
    # Cached tokens are cheaper: a count Kiln cannot trust is 0, which errs upward.
    usage = make_usage(prompt=100, completion=10)
    usage["prompt_tokens_details"] = {} if cached == "missing" else {"cached_tokens": cached}
    fake.enqueue(json_reply(chat_completion("hello", usage=usage)))
    r = post(gateway, org)
    reply = r.json()["usage"]
    assert (reply["prompt_tokens"], reply["completion_tokens"]) == (100, 10)
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert (event["cached_tokens"], event["cost_nanos"]) == (0, 100 * 100 + 10 * 300)


@pytest.mark.parametrize("completion", [None, "7", -2, 1.5])
def test_a_malformed_usage_chunk_in_a_stream_is_replaced_from_above(gateway, fake, org, engine,
                                                                    completion):
    usage = make_usage(prompt=9, completion=0)
    usage["completion_tokens"] = completion
    fake.enqueue(sse([chat_chunk("a" * 40), chat_chunk("b" * 40, finish_reason="stop"),
                      chat_chunk(choices=False, usage=usage)]))
    r = post(gateway, org, stream=True, stream_options={"include_usage": True})
    told = chunks_of(r.text)[-1]["usage"]
    assert told["completion_tokens"] == 80 and told["total_tokens"] == 89  # bytes, within cap
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert (event["completion_tokens"], event["estimated"]) == (80, True)
    with_events = [row for row in _events_of(engine, org.id)
                   if row == r.headers["X-Neocloud-Generation-Id"]]
    assert len(with_events) == 1  # one usage event


def test_the_prompt_estimate_counts_tool_definitions_and_the_tool_call_history(gateway, fake,
                                                                               org, engine):
    # No usage at all: the prompt is Kiln's count of everything sent, in bytes.
    tools = [{"type": "function", "function": {"name": "lookup", "description": "Look up",
                                               "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]
    history = [{"role": "user", "content": "Find it"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "c1", "type": "function",
                   "function": {"name": "lookup", "arguments": "{\"q\": \"" + "k" * 500 + "\"}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "found"}]
    fake.enqueue(json_reply(chat_completion("done", usage={})))
    r = requests.post(gateway.base_url + "/v1/chat/completions", timeout=30, headers=org.headers,
                      json={"model": "fake-model", "messages": history, "tools": tools})
    assert r.status_code == 200, r.text
    prompt = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])["prompt_tokens"]
    sent = fake.requests[-1].json
    calls = json.dumps(sent["messages"][1]["tool_calls"][0]["function"], ensure_ascii=False)
    text = "\n".join(["Find it", calls, "found", json.dumps(sent["tools"], ensure_ascii=False)])
    # its bytes, plus 8 template tokens per message and 32 per request
    assert prompt == len(text.encode()) + 3 * 8 + 32 and prompt > 500


def _events_of(engine, org_id):
    import sqlalchemy as sa
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT id FROM usage_events WHERE org_id = :o"),
                            {"o": org_id}).scalars().all()


@pytest.mark.parametrize("first", [{"error": {"message": "prompt refused by the content filter",
                                              "type": "invalid_request_error"}},
                                   {"object": "error", "message": "model is overloaded",
                                    "code": 503}])
def test_a_stream_that_begins_with_an_error_is_a_refusal_billed_nothing(
        gateway, fake, org, engine, first):
    """HTTP 200 and an error as the stream's first event, before any token: the client gets the
    error, and nothing is billed (docs/METERING.md: nothing is billed for a request the
    backend refused)."""
    start = balance_nanos(engine, org.id)[0]
    fake.enqueue(sse([first]))
    r = post(gateway, org, stream=True)
    events = sse_payloads(r.text)
    assert r.status_code == 200 and "[DONE]" not in events
    assert "error" in json.loads(events[-1])
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert (event["status"], event["cost_nanos"], event["prompt_tokens"],
            event["completion_tokens"]) == ("upstream_error", 0, 0, 0)
    assert balance_nanos(engine, org.id)[0] == start


def test_usage_that_contradicts_itself_is_billed_from_above_and_flagged(
        gateway, fake, org, engine):
    """Reasoning tokens above the completion tokens that include them: the usage event bills
    the reasoning count, is ``estimated`` and an ``anomaly``, and the client is told the
    usage billed, not the backend's."""
    before = anomalies(gateway)
    usage = {**make_usage(10, 5), "completion_tokens_details": {"reasoning_tokens": 40}}
    fake.enqueue(json_reply(chat_completion("Hello", usage=usage)))
    r = post(gateway, org)
    told = r.json()["usage"]
    assert (told["completion_tokens"], told["estimated"]) == (40, True)
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert (event["completion_tokens"], event["estimated"], event["anomaly"]) == (40, True, True)
    assert event["cost_nanos"] == 10 * 100 + 40 * 300
    assert anomalies(gateway) == before + 1
