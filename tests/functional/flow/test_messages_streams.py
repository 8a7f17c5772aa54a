"""Every stream shape the chat relay handles, through ``POST /v1/messages``, billed the same as
through chat: the scripted fake upstream sends the same answer to a chat request and to the
Messages request that says the same thing, and the two usage events agree on tokens, cost and
status (docs/MESSAGES.md, "Answers"; docs/METERING.md). What the Messages client sees is
Anthropic's event sequence, and the ``anthropic`` SDK reads it.
"""
import json

import anthropic
import pytest
import requests

from factories import fake_model_nanos
from fake_upstream import Hang, Reset, chat_chunk, make_usage, sse
from gateway_proc import settled_event
from streams import RawStream, assert_books_balance, close_raw_streams, data_events

ASK = [{"role": "user", "content": "Say hello"}]
LOWERED = "X-Kiln-Max-Tokens-Lowered"


@pytest.fixture(autouse=True)
def raw_streams_closed():
    yield
    close_raw_streams()


def chat_body(**extra):
    return {"model": "fake-model", "messages": ASK, "max_tokens": 100, "stream": True,
            "stream_options": {"include_usage": True}, **extra}


def messages_body(**extra):
    return {"model": "fake-model", "messages": ASK, "max_tokens": 100, "stream": True,
            **extra}


def anthropic_events(text):
    """``[(event name, data)]`` of an Anthropic event stream."""
    out = []
    for frame in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.split("\n") if ": " in line)
        if "event" in lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


def post(gateway, org, path, body):
    r = requests.post(gateway.base_url + path, json=body, headers=org.headers, timeout=30)
    assert r.status_code == 200, r.text
    return r


def both(gateway, fake, org, engine, script, chat=None, messages=None):
    """Send ``script``'s answer to a chat request and to a Messages request; return the
    Messages response, its event stream and usage event, having checked the two usage events
    agree (tokens, cost, status, estimated) and the books balance."""
    fake.enqueue(script)
    c = post(gateway, org, "/v1/chat/completions", chat or chat_body())
    fake.enqueue(script)
    m = post(gateway, org, "/v1/messages", messages or messages_body())
    assert m.headers["Content-Type"].startswith("text/event-stream")
    ce = settled_event(engine, c.headers["X-Neocloud-Generation-Id"])
    me = settled_event(engine, m.headers["X-Neocloud-Generation-Id"])
    assert_same_bill(ce, me)
    assert fake.requests[-1].json == fake.requests[-2].json  # the backend was sent the same
    assert_books_balance(engine, org.id)
    return m, anthropic_events(m.text), me


# The bill; not the hold, which bounds the prompt by the body's bytes (docs/METERING.md), and a
# Messages body is not a chat body's bytes.
KEYS = ("status", "http_status", "prompt_tokens", "completion_tokens", "cached_tokens",
        "cost_nanos", "estimated", "anomaly")


def assert_same_bill(chat_event, messages_event):
    assert (chat_event["endpoint"], messages_event["endpoint"]) == ("chat", "messages")
    assert {k: messages_event[k] for k in KEYS} == {k: chat_event[k] for k in KEYS}
    assert messages_event["cost_nanos"] == fake_model_nanos(
        messages_event["prompt_tokens"], messages_event["completion_tokens"],
        messages_event["cached_tokens"])


def final_delta(evs):
    """The ``message_delta`` of a complete stream (then ``message_stop``, nothing after)."""
    names = [n for n, _ in evs]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta",
                                                                        "message_stop"]
    return evs[-2][1]


def assert_usage_told(delta, event):
    """The message_delta's cumulative usage is the usage event's, with its cost."""
    usage = delta["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == event["prompt_tokens"]
    assert usage["output_tokens"] == event["completion_tokens"]
    assert usage.get("estimated", False) is event["estimated"]
    assert round(usage["cost"] * 10**9) == event["cost_nanos"]


def blocks(evs):
    """``[(block type, joined delta text)]`` of a stream, checking each block is started,
    delta'd and stopped in order, at increasing indexes."""
    out, index = [], -1
    for name, data in evs:
        if name == "content_block_start":
            index += 1
            assert data["index"] == index
            block = data["content_block"]
            out.append([block["type"], "", block])
        elif name == "content_block_delta":
            assert data["index"] == index
            delta = data["delta"]
            out[-1][1] += delta.get("text") or delta.get("thinking") or delta.get(
                "partial_json") or ""
        elif name == "content_block_stop":
            assert data["index"] == index
    return out


# -- usage ----------------------------------------------------------------------------------

def test_usage_reported_by_the_backend(gateway, fake, org, engine):
    script = sse([chat_chunk("Hello", role="assistant"), chat_chunk(" world"),
                  chat_chunk(finish_reason="stop"),
                  chat_chunk(choices=False, usage=make_usage(prompt=21, completion=7))])
    _, evs, event = both(gateway, fake, org, engine, script)
    assert (event["prompt_tokens"], event["completion_tokens"], event["estimated"]) == \
        (21, 7, False)
    delta = final_delta(evs)
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert_usage_told(delta, event)
    assert [b[:2] for b in blocks(evs)] == [["text", "Hello world"]]


def test_usage_missing_is_kilns_count_the_same_as_chat(gateway, fake, org, engine):
    script = sse([chat_chunk("Hello", role="assistant"), chat_chunk(" world"),
                  chat_chunk(finish_reason="stop")])
    _, evs, event = both(gateway, fake, org, engine, script)
    assert event["estimated"] is True and event["completion_tokens"] == len("Hello world")
    assert_usage_told(final_delta(evs), event)


# -- reasoning and tool calls ---------------------------------------------------------------

def reasoning(text):
    return {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": {"reasoning_content": text},
                         "finish_reason": None}]}


def test_reasoning_deltas_are_a_thinking_block(gateway, fake, org, engine):
    script = sse([reasoning("The user"), reasoning(" greets."), chat_chunk("Hello!"),
                  chat_chunk(finish_reason="stop")])
    _, evs, event = both(gateway, fake, org, engine, script)
    got = blocks(evs)
    assert [b[:2] for b in got] == [["thinking", "The user greets."], ["text", "Hello!"]]
    assert got[0][2] == {"type": "thinking", "thinking": "", "signature": ""}
    # reasoning is generated output: counted and billed as chat counts it
    assert event["completion_tokens"] == len("The user greets.Hello!")
    assert_usage_told(final_delta(evs), event)


def call_fragments(index, call_id, name, arguments):
    head = {"index": index, "id": call_id, "type": "function",
            "function": {"name": name, "arguments": ""}}
    cut = len(arguments) // 2
    return [chat_chunk(tool_calls=[head]),
            chat_chunk(tool_calls=[{"index": index, "function": {"arguments": arguments[:cut]}}]),
            chat_chunk(tool_calls=[{"index": index, "function": {"arguments": arguments[cut:]}}])]


TOOL = {"name": "lookup", "description": "Look it up.",
        "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}
CHAT_TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look it up.",
                                              "parameters": TOOL["input_schema"]}}


@pytest.mark.parametrize("same_index", [False, True], ids=["index-per-call", "all-at-index-0"])
def test_tool_call_fragments_are_input_json_deltas(gateway, fake, org, engine, same_index):
    """Each call a tool_use block whose input_json_delta fragments join to its arguments; a
    server that sends every call at index 0, each with its own id, gives as many blocks."""
    first, second = '{"q": "Paris weather"}', '{"q": "Rome weather"}'
    script = sse(call_fragments(0, "call_a", "lookup", first)
                 + call_fragments(0 if same_index else 1, "call_b", "lookup", second)
                 + [chat_chunk(finish_reason="tool_calls")])
    m, evs, event = both(gateway, fake, org, engine, script,
                         chat=chat_body(tools=[CHAT_TOOL]), messages=messages_body(tools=[TOOL]))
    got = blocks(evs)
    assert [(b[0], b[2]["id"], b[2]["name"], json.loads(b[1])) for b in got] == [
        ("tool_use", "call_a", "lookup", {"q": "Paris weather"}),
        ("tool_use", "call_b", "lookup", {"q": "Rome weather"})]
    delta = final_delta(evs)
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert event["completion_tokens"] == 2 * len("lookup") + len(first) + len(second)
    assert_usage_told(delta, event)
    # and the SDK builds the same message from the events
    with anthropic.Anthropic(base_url=gateway.base_url, api_key=org.key, max_retries=0,
                             timeout=30) as client:
        fake.enqueue(script)
        with client.messages.stream(model="fake-model", max_tokens=100, messages=ASK,
                                    tools=[TOOL]) as stream:
            final = stream.get_final_message()
    assert [(b.type, b.id, b.input) for b in final.content] == [
        ("tool_use", "call_a", {"q": "Paris weather"}), ("tool_use", "call_b",
                                                          {"q": "Rome weather"})]
    assert final.stop_reason == "tool_use"


# -- Kiln's cuts ----------------------------------------------------------------------------

def test_kilns_budget_cut_is_max_tokens(gateway, fake, org, engine):
    """A backend that ignores max_tokens is cut at the cap Kiln held for: stop_reason
    max_tokens, billed the cap, on both endpoints."""
    script = sse([chat_chunk("tok ") for _ in range(50)] + [chat_chunk(finish_reason="length")])
    _, evs, event = both(gateway, fake, org, engine, script, chat=chat_body(max_tokens=5),
                         messages=messages_body(max_tokens=5))
    assert [b[:2] for b in blocks(evs)] == [["text", "tok " * 5]]
    delta = final_delta(evs)
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert event["completion_tokens"] == 5
    assert_usage_told(delta, event)


def test_kilns_stop_cut_is_stop_sequence_with_the_string(gateway, fake, org, engine):
    script = sse([chat_chunk("Hello"), chat_chunk(" wor"), chat_chunk("ld END and more"),
                  chat_chunk(finish_reason="stop")])
    _, evs, event = both(gateway, fake, org, engine, script, chat=chat_body(stop=["END"]),
                         messages=messages_body(stop_sequences=["END"]))
    assert [b[:2] for b in blocks(evs)] == [["text", "Hello world "]]
    delta = final_delta(evs)
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert_usage_told(delta, event)


def test_max_tokens_above_the_models_maximum_is_lowered_with_the_header(gateway, fake, org,
                                                                         engine):
    """fake-model's maximum output is 1024: a Messages request for 32,000 is held for and sent
    as 1024, as a chat request for 1024 is (chat refuses more), and says so in a header."""
    script = sse([chat_chunk("Hi"), chat_chunk(finish_reason="stop")])
    m, evs, event = both(gateway, fake, org, engine, script, chat=chat_body(max_tokens=1024),
                         messages=messages_body(max_tokens=32000))
    assert m.headers[LOWERED] == "32000->1024"
    assert fake.requests[-1].json["max_tokens"] == 1024
    assert event["hold_nanos"] > 1024 * 300  # 1024 output tokens at 0.30 USD per million


# -- failures and disconnects ---------------------------------------------------------------

@pytest.mark.parametrize("failure", [Reset(), None], ids=["reset", "ended-early"])
def test_mid_stream_failure_is_an_error_event_and_nothing_looks_complete(
        gateway, fake, org, engine, failure):
    script = sse([chat_chunk("a")], done=False) + ([failure] if failure else [])
    fake.enqueue(script)
    c = RawStream(gateway.base_url, org.key, chat_body()).read_all()
    fake.enqueue(script)
    m = RawStream(gateway.base_url, org.key, messages_body(), path="/v1/messages").read_all()
    assert m.status == 200 and m.ended
    evs = anthropic_events(m.body.decode())
    names = [n for n, _ in evs]
    assert names[-1] == "error" and names.count("error") == 1
    assert "message_stop" not in names and "message_delta" not in names
    error = evs[-1][1]
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert error["error"]["code"] == "upstream_error"
    assert [b[:2] for b in blocks(evs)] == [["text", "a"]]
    ce, me = settled_event(engine, c.gid), settled_event(engine, m.gid)
    assert_same_bill(ce, me)
    assert me["status"] == "upstream_error" and me["completion_tokens"] == 1
    assert_books_balance(engine, org.id)
    # the SDK raises, rather than handing back a message that looks whole
    fake.enqueue(script)
    with anthropic.Anthropic(base_url=gateway.base_url, api_key=org.key, max_retries=0,
                             timeout=30) as client, pytest.raises(anthropic.APIError):
        with client.messages.stream(model="fake-model", max_tokens=100, messages=ASK) as s:
            s.get_final_message()


def test_client_disconnect_is_client_cancelled_billed_what_was_relayed(gateway, fake, org,
                                                                       engine):
    script = sse([chat_chunk("a"), chat_chunk("b")], done=False) + [Hang()]
    gids = []
    for path, body, relayed in (
            ("/v1/chat/completions", chat_body(), lambda s: len(data_events(s.body)) == 2),
            ("/v1/messages", messages_body(), lambda s: s.body.count(b"text_delta") == 2)):
        fake.enqueue(script)
        raw = RawStream(gateway.base_url, org.key, body, path=path).read_head()
        raw.read_until(relayed)
        raw.close()
        fake.wait_for(lambda rs: rs[-1].closed_at, timeout=15)  # Kiln closed the backend
        gids.append(raw.gid)
    ce, me = (settled_event(engine, g) for g in gids)
    assert_same_bill(ce, me)
    assert (me["status"], me["http_status"], me["completion_tokens"]) == \
        ("client_cancelled", 499, 2)
    assert me["cost_nanos"] > 0
    assert_books_balance(engine, org.id)
