"""Streams that hold up, through gunicorn with gevent workers on Postgres, with the
scripted fake upstream for faults and the real llama.cpp server for the disconnect case.

Raw sockets where bytes or timing matter (:class:`RawStream`), the ``openai`` SDK where a client's
view matters. Every admitted request must end with exactly one settled usage event whose cost is
exactly what left the org's balance, no hold and no lease.
"""
import importlib.util
import json
import os
import re
import sys
import tempfile
import threading
import time
from decimal import Decimal
from pathlib import Path

import openai
import pytest
import requests
import sqlalchemy as sa

from factories import MESSAGES, fake_model_nanos
from fake_upstream import Close, Gate, Hang, Reset, Send, Sleep, Status, chat_chunk, \
    chat_completion, error_reply, json_reply, make_usage, sse
from gateway_proc import (ROOT, Gateway, balance_nanos, free_port, make_org, settled_event,
                          usage_event, wait_until)
from streams import (GRANT, SSE_HEAD, RawStream, assert_books_balance, close_raw_streams,
                     data_events, events, org_events, relay_event_by_event, stream_body)


def nanos(prompt, completion):
    return fake_model_nanos(prompt=prompt, completion=completion)


@pytest.fixture(autouse=True)
def raw_streams_closed():
    yield
    close_raw_streams()


@pytest.fixture
def start_gw(start_gateway):
    """``start_gateway``, with this test's raw sockets closed before the gateway stops."""
    yield start_gateway
    close_raw_streams()


# -- byte-exact relay -----------------------------------------------------------------------

def tricky_payloads():
    """Payloads a re-serialisation would change: spaces, \\u escapes, raw UTF-8, tool calls."""
    return [
        b'{"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": '
        b'{"role": "assistant", "content": "caf\\u00e9 "}, "finish_reason": null}]}',
        ('{"id":"c1","choices":[{"index":0,"delta":{"content":"\u65e5\u672c \U0001F642 '
         '\u2013"},"finish_reason":null}],"x_vendor":{"k":1.50}}').encode(),
        b'{"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1",'
        b'"type":"function","function":{"name":"get_weather","arguments":""}}]},'
        b'"finish_reason":null}]}',
        b'{"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":'
        b'{"arguments":"{\\"city\\": \\"Par"}}]},"finish_reason":null}]}',
        b'{"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":'
        b'{"arguments":"is\\"}"}}]},"finish_reason":null}]}',
        b'{"id":"c1","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}',
    ]


def awkward_pieces(payloads):
    """The upstream bytes of ``payloads``, with comment/event/retry lines and CRLF framing, cut
    inside multi-byte characters, between the two newlines, and one byte at a time."""
    p = payloads
    stream = (b": ping\n\nretry: 3000\n\n"
              + b"event: message\nid: 1\ndata: " + p[0] + b"\n\n"
              + b"data: " + p[1] + b"\r\n\r\n"
              + b"data: " + p[2] + b"\n: a comment inside an event\n\n"
              + b"data: " + p[3] + b"\r\r"
              + b"data: " + p[4] + b"\n\n"
              + b": keepalive from the server\n\nevent: ping\n\n"
              + b"data: " + p[5] + b"\n\ndata: [DONE]\n\n")
    cuts = sorted({stream.index("\U0001F642".encode()) + 1, stream.index("\u65e5".encode()) + 2,
                   stream.index(p[0]) + len(p[0]) + 1,  # between the two newlines
                   stream.index(p[3]) + len(p[3]) + 1,  # between the two CRs
                   stream.index(p[1]) + len(p[1]) + 2}  # inside CRLF CRLF
                  | set(range(stream.index(p[4]) - 6, stream.index(p[4]) + len(p[4]) + 2)))
    return [stream[a:b] for a, b in zip([0] + cuts, cuts + [len(stream)], strict=False)]


def test_events_split_at_any_byte_reach_the_client_exact(gateway, fake, org, engine):
    payloads = tricky_payloads()
    fake.enqueue([Status(200, SSE_HEAD)] + [Send(piece) for piece in awkward_pieces(payloads)])
    raw = RawStream(gateway.base_url, org.key, stream_body()).read_all()
    assert raw.status == 200 and raw.ended
    assert raw.body == b"".join(b"data: " + p + b"\n\n" for p in payloads) + b"data: [DONE]\n\n"
    event = settled_event(engine, raw.gid)
    # No usage from this backend and no tokenizer: the UTF-8 bytes of everything generated
    # (content "café " and "日本 🙂 –", tool name and arguments), docs/METERING.md
    assert event["status"] == "completed" and event["completion_tokens"] == 49
    assert_books_balance(engine, org.id)


def test_all_choices_of_n_and_tool_calls_reach_the_sdk(client, fake):
    args = ['{"city": ', '"Paris"}']
    fake.enqueue(sse(
        [chat_chunk("A", index=0, role="assistant"), chat_chunk("B", index=1),
         chat_chunk(" a", index=0), chat_chunk(" b", index=1),
         chat_chunk(tool_calls=[{"index": 0, "id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": args[0]}}],
                    index=2),
         chat_chunk(tool_calls=[{"index": 0, "function": {"arguments": args[1]}}], index=2),
         chat_chunk(finish_reason="stop", index=0), chat_chunk(finish_reason="stop", index=1),
         chat_chunk(finish_reason="tool_calls", index=2)]))
    text, calls = {}, ""
    for chunk in client.chat.completions.create(model="fake-model", messages=MESSAGES, n=3,
                                                stream=True):
        for choice in chunk.choices:
            text[choice.index] = text.get(choice.index, "") + (choice.delta.content or "")
            for call in choice.delta.tool_calls or []:
                calls += call.function.arguments
    assert text == {0: "A a", 1: "B b", 2: ""}
    assert calls == "".join(args)


# -- usage ----------------------------------------------------------------------------------

def test_usage_on_a_chunk_with_choices_is_billed_and_priced(client, fake, org, engine):
    fake.enqueue(sse([chat_chunk("a"), chat_chunk("b"),
                      chat_chunk(finish_reason="stop", usage=make_usage(20, 2))]))
    raw = client.chat.completions.with_raw_response.create(
        model="fake-model", messages=MESSAGES, stream=True,
        stream_options={"include_usage": True})
    chunks = list(raw.parse())
    with_usage = [c for c in chunks if c.usage is not None]
    # The usage a backend put on its last chunk with choices comes as the usage chunk the
    # client asked for (choices empty), with the cost; the finish chunk keeps its choices.
    assert len(with_usage) == 1 and not with_usage[0].choices
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert with_usage[0].usage.completion_tokens == 2
    assert Decimal(str(with_usage[0].usage.model_extra["cost"])) == Decimal(nanos(20, 2)) / 10**9
    event = settled_event(engine, raw.headers["X-Neocloud-Generation-Id"])
    assert event["cost_nanos"] == nanos(20, 2) and not event["estimated"]
    assert_books_balance(engine, org.id)


@pytest.mark.parametrize("include_usage", [True, False])
def test_running_totals_last_value_counts_never_summed(gateway, fake, org, engine,
                                                       include_usage):
    fake.enqueue(sse([chat_chunk("a", usage=make_usage(30, 1)),
                      chat_chunk("b", usage=make_usage(30, 2)),
                      chat_chunk("c", usage=make_usage(30, 3)),
                      chat_chunk(finish_reason="stop", usage=make_usage(30, 3))]))
    body = stream_body(stream_options={"include_usage": include_usage})
    raw = RawStream(gateway.base_url, org.key, body).read_all()
    event = settled_event(engine, raw.gid)
    assert (event["prompt_tokens"], event["completion_tokens"]) == (30, 3)
    assert event["cost_nanos"] == nanos(30, 3) and not event["estimated"]
    assert (b'"usage"' in raw.body) is include_usage
    assert raw.body.endswith(b"data: [DONE]\n\n")
    assert_books_balance(engine, org.id)


def test_no_usage_field_reaches_a_client_that_did_not_ask(gateway, fake, org, engine):
    """Null usage on every chunk (as SGLang sends it), usage on a content chunk, and the usage
    chunk: all usage leaves, every other byte stays."""
    kept = [b'{"id": "c", "choices": [{"index": 0, "delta": {"content": "caf\\u00e9"}}]}',
            b'{"id":"c","choices":[{"index":0,"delta":{"content":"!"},"finish_reason":"stop"}]}']
    sent = [kept[0][:-1] + b', "usage": null}',
            kept[1][:-1] + b',"usage":{"prompt_tokens":8,"completion_tokens":2}}',
            b'{"id":"c","choices":[],"usage":{"prompt_tokens":8,"completion_tokens":2}}']
    fake.enqueue(sse([b"data: " + s + b"\n\n" for s in sent]))
    raw = RawStream(gateway.base_url, org.key, stream_body()).read_all()
    assert raw.body == b"".join(b"data: " + k + b"\n\n" for k in kept) + b"data: [DONE]\n\n"
    assert settled_event(engine, raw.gid)["cost_nanos"] == nanos(8, 2)


# -- keepalive and no buffering ---------------------------------------------------------------

@pytest.fixture
def keepalive_gateway(start_gw):
    """A gateway that sends ``: keepalive`` after 1 s of upstream silence."""
    return start_gw(keepalive_s=1)


def silent_script(before_status_s=0.0, silence_s=3.4):
    steps = [Sleep(before_status_s)] if before_status_s else []
    return steps + [Status(200, SSE_HEAD), Sleep(silence_s),
                    Send(b"data: " + json.dumps(chat_chunk("a")).encode() + b"\n\n"),
                    Sleep(silence_s),
                    Send(b"data: " + json.dumps(chat_chunk("b", finish_reason="stop")).encode()
                         + b"\n\ndata: [DONE]\n\n")]


@pytest.mark.parametrize("before_status_s", [0.0, 2.6], ids=["slow-prefill", "queued"])
def test_keepalives_while_the_upstream_is_silent(keepalive_gateway, fake, org, engine,
                                                 before_status_s):
    fake.enqueue(silent_script(before_status_s))
    raw = RawStream(keepalive_gateway.base_url, org.key, stream_body()).read_all()
    sent_at = fake.requests[-1].sent_at
    assert raw.status == 200 and raw.head_at < sent_at[0]  # headers before the first token
    first, second, done = data_events(raw.body)
    assert done == b"data: [DONE]"
    before, between, after = keepalives_around_data(raw.body)
    assert before >= 2 + (before_status_s > 0) and between >= 2 and after == 0
    assert all(e.startswith((b"data: ", b": keepalive")) for e in events(raw.body))
    assert settled_event(engine, raw.gid)["status"] == "completed"


def keepalives_around_data(body):
    """Return the numbers of keepalive lines before, between and after the data events."""
    counts = [0]
    for event in events(body):
        if event.startswith(b"data: "):
            counts.append(0)
        else:
            assert event == b": keepalive"
            counts[-1] += 1
    return counts[0], counts[1], counts[-1]


def test_the_openai_sdk_reads_a_stream_with_keepalives(keepalive_gateway, fake, org):
    fake.enqueue(silent_script(silence_s=1.6))
    with openai.OpenAI(base_url=keepalive_gateway.base_url + "/v1", api_key=org.key,
                       max_retries=0, timeout=30) as client:
        chunks = list(client.chat.completions.create(model="fake-model", messages=MESSAGES,
                                                     stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "ab"


def test_stream_headers_forbid_buffering(gateway, fake, org):
    fake.enqueue(sse([chat_chunk("a", finish_reason="stop")]))
    with requests.post(gateway.base_url + "/v1/chat/completions", json=stream_body(),
                       headers=org.headers, stream=True, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert r.headers["Cache-Control"] == "no-cache"
        assert r.headers["X-Accel-Buffering"] == "no"
        assert "Content-Length" not in r.headers
        assert r.headers["Transfer-Encoding"] == "chunked"
        assert r.content.endswith(b"data: [DONE]\n\n")


def test_each_event_leaves_as_soon_as_it_arrives(gateway, fake, org):
    raw = relay_event_by_event(gateway.base_url, fake, org)
    assert raw.ended and raw.body.endswith(b"data: [DONE]\n\n")


def test_each_event_leaves_as_it_arrives_inside_one_slow_http_chunk(gateway, fake, org):
    # A reader that returns an HTTP chunk only once it is whole (urllib3's read_chunked)
    # would hold the first event until the last had come: the client would wait forever.
    raw = relay_event_by_event(gateway.base_url, fake, org, one_chunk=True)
    assert raw.ended and raw.body.endswith(b"data: [DONE]\n\n")
    assert len(data_events(raw.body)) == 8 + 2  # the content, the finish chunk, [DONE]


# -- client disconnect ----------------------------------------------------------------------

def assert_cancelled_and_billed(engine, org, gid, completion, closed_at, record,
                                estimated=True, before=GRANT):
    # Closed because the client left, not before: the backend would otherwise hang until
    # its read timeout (minutes), far past the 15 s the callers' wait_for allows.
    assert record.closed_at is not None and record.closed_at > closed_at
    event = settled_event(engine, gid)
    assert event["status"] == "client_cancelled" and event["http_status"] == 499
    assert event["prompt_tokens"] > 0 and event["completion_tokens"] == completion
    assert event["estimated"] is estimated
    assert event["cost_nanos"] == nanos(event["prompt_tokens"], completion) > 0
    assert before - balance_nanos(engine, org.id)[0] == event["cost_nanos"]
    assert balance_nanos(engine, org.id)[1:] == (0, 0)  # hold and lease released


@pytest.mark.parametrize("tokens", [0, 2], ids=["before-first-token", "after-two-tokens"])
def test_stream_client_disconnect_closes_the_upstream_and_bills(gateway, fake, org, engine,
                                                                tokens):
    chunks = [chat_chunk(t) for t in ("a", "b")[:tokens]]
    fake.enqueue(sse(chunks, done=False)[:tokens + 1] + [Hang()])
    raw = RawStream(gateway.base_url, org.key, stream_body()).read_head()
    raw.read_until(lambda s: len(data_events(s.body)) == tokens)
    closed_at = raw.close()
    record = fake.wait_for(lambda rs: rs[-1].closed_at and rs[-1], timeout=15)
    assert_cancelled_and_billed(engine, org, raw.gid, tokens, closed_at, record)


def test_stream_disconnect_with_running_totals_bills_the_last_total(gateway, fake, org,
                                                                    engine):
    fake.enqueue(sse([chat_chunk("a", usage=make_usage(9, 1)),
                      chat_chunk("b", usage=make_usage(9, 2))], done=False) + [Hang()])
    raw = RawStream(gateway.base_url, org.key, stream_body()).read_head()
    raw.read_until(lambda s: len(data_events(s.body)) == 2)
    closed_at = raw.close()
    record = fake.wait_for(lambda rs: rs[-1].closed_at and rs[-1], timeout=15)
    assert_cancelled_and_billed(engine, org, raw.gid, 2, closed_at, record, estimated=False)


def test_stream_disconnect_before_the_upstream_answers_closes_it_and_bills_nothing(
        gateway, fake, org, engine):
    """The backend never answered: it is closed at once, and nothing it did not answer is
    billed (docs/METERING.md, "A client that leaves")."""
    fake.enqueue([Hang()])
    raw = RawStream(gateway.base_url, org.key, stream_body())
    fake.wait_for(lambda rs: rs, timeout=15)
    time.sleep(0.3)  # the gateway waits on the upstream's status line
    closed_at = raw.close()
    record = fake.wait_for(lambda rs: rs[-1].closed_at and rs[-1], timeout=15)
    assert record.closed_at > closed_at  # within the 15 s wait above, not at a read timeout
    gid, = [e["id"] for e in org_events(engine, org.id)]
    event = settled_event(engine, gid)
    assert (event["status"], event["http_status"], event["cost_nanos"]) == \
        ("client_cancelled", 499, 0)
    assert balance_nanos(engine, org.id) == (GRANT, 0, 0)


def test_non_stream_disconnect_still_reads_and_bills_the_whole_reply(gateway, fake, org,
                                                                     engine):
    """A model server keeps generating a non-stream reply whose client left (llama-cpp-python
    does): Kiln reads it to its end and bills its real usage (docs/METERING.md, "A client
    that leaves")."""
    fake.enqueue([Sleep(1.0)] + json_reply(chat_completion("late", usage=make_usage(8, 3))))
    raw = RawStream(gateway.base_url, org.key, {**stream_body(), "stream": False})
    fake.wait_for(lambda rs: rs, timeout=15)
    time.sleep(0.2)
    raw.close()
    record = fake.wait_for(lambda rs: rs[-1].completed and rs[-1], timeout=15)
    assert record.closed_at is None  # the reply was read, not cut
    gid, = [e["id"] for e in org_events(engine, org.id)]
    event = settled_event(engine, gid)
    assert (event["prompt_tokens"], event["completion_tokens"], event["estimated"]) == \
        (8, 3, False)
    assert event["cost_nanos"] == 1_700  # 8 × 0.10 + 3 × 0.30 micro-dollars
    assert GRANT - balance_nanos(engine, org.id)[0] == 1_700


def test_pipelined_bytes_do_not_fire_the_watcher_but_a_close_still_does(gateway, fake, org,
                                                                         engine):
    """Bytes of a next request waiting in the socket are not a disconnect; a close behind them
    still is."""
    fake.enqueue(sse([chat_chunk("a"), chat_chunk("b", finish_reason="stop")], delay_s=0.6))
    raw = RawStream(gateway.base_url, org.key, stream_body())
    raw.sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    raw.read_until(lambda s: b"data: [DONE]\n\n" in s.body)
    assert settled_event(engine, raw.gid)["status"] == "completed"
    raw.close()
    before = balance_nanos(engine, org.id)[0]
    fake.enqueue([Status(200, SSE_HEAD), Hang()])
    raw = RawStream(gateway.base_url, org.key, stream_body()).read_head()
    raw.sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.5)
    closed_at = raw.close()
    record = fake.wait_for(lambda rs: rs[-1].closed_at and rs[-1], timeout=15)
    assert_cancelled_and_billed(engine, org, raw.gid, 0, closed_at, record, before=before)


# -- upstream failures ----------------------------------------------------------------------

def test_failures_before_the_stream_began_are_plain_errors(client, gateway, fake, org, engine):
    """A 5xx is our 502 (plain text, as the endpoint reference documents), a 400 is passed on
    in the JSON envelope; neither is an event stream, neither is charged."""
    for script in (error_reply(500, "boom"), [Reset()]):
        fake.enqueue(script)
        r = requests.post(gateway.base_url + "/v1/chat/completions", json=stream_body(),
                          headers=org.headers, timeout=30)
        assert r.status_code == 502 and r.headers["Content-Type"].startswith("text/plain")
        assert settled_event(engine, r.headers["X-Neocloud-Generation-Id"])["status"] == \
            "upstream_error"
    fake.enqueue(error_reply(400, "This model's maximum context length is 8192 tokens"))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True)
    assert "maximum context length" in err.value.body["message"]
    assert balance_nanos(engine, org.id) == (GRANT, 0, 0)
    events = org_events(engine, org.id)
    assert [e["status"] for e in events] == ["upstream_error", "upstream_error", "rejected"]
    assert all(e["cost_nanos"] == 0 for e in events)


def one_token_then(*steps):
    return sse([chat_chunk("a")], done=False) + list(steps)


MID_STREAM = {
    "error-frame": (one_token_then(Send(b'data: {"error": {"message": "CUDA out of memory", '
                                        b'"type": "server_error", "code": 500}}\n\n')),
                    "upstream_error", "upstream_error", "CUDA out of memory"),
    "reset": (one_token_then(Reset()), "upstream_error", "upstream_error", "connection"),
    "fin-mid-body": (one_token_then(Send(b'data: {"id":"c","choi'), Close()),
                     "upstream_error", "upstream_error", "connection"),
    "ended-early": (one_token_then(), "upstream_error", "upstream_error", "before it was"),
    # A choice's index that is not an integer says no choice: malformed, like a non-object
    # (it once reached the rules' state as a key: an internal error, not the backend's).
    "index-not-integer": (one_token_then(Send(b'data: {"id":"c","choices":[{"index":[1],'
                                              b'"delta":{"content":"b"},'
                                              b'"finish_reason":"stop"}]}\n\n')),
                          "upstream_error", "upstream_error", "index is not an integer"),
}


@pytest.mark.parametrize("case", MID_STREAM, ids=list(MID_STREAM))
def test_failure_after_the_stream_began_is_one_error_event(gateway, fake, org, engine, case):
    script, status, code, words = MID_STREAM[case]
    fake.enqueue(script)
    raw = RawStream(gateway.base_url, org.key, stream_body()).read_all()
    assert_one_error_event(raw, code, words)
    event = settled_event(engine, raw.gid)
    assert event["status"] == status and words in event["error"]
    assert event["completion_tokens"] == 1 and event["estimated"]
    assert event["cost_nanos"] == nanos(event["prompt_tokens"], 1) > 0
    assert_books_balance(engine, org.id)


@pytest.mark.parametrize("end", [Close(), Reset()], ids=["fin", "reset"])
def test_a_stream_that_said_done_is_whole_though_its_body_was_cut(gateway, fake, org, engine,
                                                                   end):
    # [DONE], then the connection ends before the chunked body's last chunk: nothing the
    # backend meant to send is missing, so the client gets a complete stream.
    fake.enqueue(sse([chat_chunk("a"), chat_chunk(finish_reason="stop")]) + [end])
    raw = RawStream(gateway.base_url, org.key, stream_body()).read_all()
    assert raw.status == 200 and raw.ended and raw.body.endswith(b"data: [DONE]\n\n")
    assert b'"error"' not in raw.body
    event = settled_event(engine, raw.gid)
    assert event["status"] == "completed" and event["completion_tokens"] == 1
    assert_books_balance(engine, org.id)


def test_a_backend_connection_serves_the_next_stream_once_one_is_read_to_its_end(
        start_gw, fake, org):
    # The chunked body read to its last chunk and trailer section leaves the connection
    # ready for the next request (gateway/backends/chunked.py closes http.client's response).
    gw = start_gw(workers=1)
    for ext, trailer in ((b"", b""), (b";note=1", b"X-Checksum: 0\r\n")):
        events = b"".join(b"data: %s\n\n" % json.dumps(c).encode() for c in (
            chat_chunk("a"), chat_chunk(finish_reason="stop"))) + b"data: [DONE]\n\n"
        body = b"%x%s\r\n%s\r\n0\r\n%s\r\n" % (len(events), ext, events, trailer)
        fake.enqueue([Status(200, {"Content-Type": "text/event-stream",
                                   "Transfer-Encoding": "chunked"}, chunked=False),
                      Send(body)])
        raw = RawStream(gw.base_url, org.key, stream_body()).read_all()
        assert raw.status == 200 and raw.body.endswith(b"data: [DONE]\n\n"), raw.body
    chats = [r for r in fake.requests if r.path == "/v1/chat/completions"][-2:]
    assert chats[0].conn_id == chats[1].conn_id


def test_a_whole_reply_whose_choice_index_is_not_an_integer_is_the_backends_error(
        gateway, fake, org, engine):
    reply = chat_completion("a")
    reply["choices"][0]["index"] = [1]
    fake.enqueue(json_reply(reply))
    resp = requests.post(f"{gateway.base_url}/v1/chat/completions", timeout=30,
                         headers={"Authorization": f"Bearer {org.key}"},
                         json={"model": "fake-model", "messages": MESSAGES, "stop": ["x"]})
    assert resp.status_code == 502, resp.text
    assert "index is not an integer" in resp.text  # a 502 is plain text (README, "API")
    event = settled_event(engine, resp.headers["X-Neocloud-Generation-Id"])
    assert event["status"] == "upstream_error"
    assert_books_balance(engine, org.id)


def assert_one_error_event(raw, code, words):
    """The relayed token, then exactly one error event in the envelope, no [DONE], closed."""
    assert raw.status == 200 and raw.ended
    first, last = data_events(raw.body)
    assert json.loads(first[6:])["choices"][0]["delta"]["content"] == "a"
    error = json.loads(last[6:])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and words in error["message"]
    assert b"[DONE]" not in raw.body


def test_no_byte_for_the_read_timeout_is_an_error_event(start_gw, fake, org, engine):
    gw = start_gw(upstream_read_timeout_s=1)
    fake.enqueue(one_token_then(Hang()))
    raw = RawStream(gw.base_url, org.key, stream_body()).read_all()
    assert_one_error_event(raw, "upstream_idle_timeout", "idle timeout")
    event = settled_event(engine, raw.gid)
    assert event["status"] == "timeout" and event["completion_tokens"] == 1
    assert "idle timeout" in event["error"]
    assert fake.wait_for(lambda rs: rs[-1].closed_at, timeout=15)  # we hung up on it
    assert_books_balance(engine, org.id)


def test_the_sdk_sees_a_mid_stream_failure_as_an_error(client, fake):
    fake.enqueue(one_token_then(Reset()))
    stream = client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True)
    with pytest.raises(openai.APIError, match="connection failed"):
        list(stream)


# -- settlement exactly once ----------------------------------------------------------------

def kiln_requests_total(gw):
    text = requests.get(gw.base_url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r'^kiln_requests_total\{[^}]*\} (\S+)$', text,
                                            re.M))


def test_every_request_is_settled_exactly_once(start_gw, fake, engine):
    """Successes, cancels and failures of every kind: one usage event each, none pending, the
    settlement counter moved once per request, and the books balance to the nano-dollar."""
    gw = start_gw(workers=1)
    org = make_org(engine, f"once-{time.monotonic_ns()}")
    url = gw.base_url + "/v1/chat/completions"
    made = []

    def post(script, **body):
        fake.enqueue(script)
        made.append(script)
        r = requests.post(url, json={**stream_body(), **body}, headers=org.headers, timeout=30)
        assert r.status_code in (200, 400, 502), r.text

    def cancel(script, after=lambda raw: raw.read_head(), **body):
        fake.enqueue(script)
        made.append(script)
        seen = len(fake.requests)
        raw = RawStream(gw.base_url, org.key, {**stream_body(), **body})
        record = fake.wait_for(lambda rs: len(rs) > seen and rs[-1], timeout=15)
        after(raw)
        raw.close()
        # a stream's backend is closed; a non-stream reply is still read to its end
        wait_until(lambda: record.closed_at or record.completed, timeout_s=15)

    post(sse([chat_chunk("a", finish_reason="stop")]))
    post(json_reply({"choices": [{"index": 0, "message": {"content": "x"}}],
                     "usage": make_usage(3, 1)}), stream=False)
    for _, (script, *_) in MID_STREAM.items():
        post(script)
    post(error_reply(400, "too long"))
    post(error_reply(500, "boom"))
    cancel(one_token_then(Hang()))
    cancel([Hang()], after=lambda raw: time.sleep(0.3))
    cancel([Sleep(1.0)] + json_reply(chat_completion("late")), after=lambda raw: time.sleep(0.3),
           stream=False)
    requests_made = len(made)
    assert requests_made == 7 + len(MID_STREAM)
    wait_until(lambda: balance_nanos(engine, org.id)[2] == 0)
    evts = org_events(engine, org.id)
    assert len(evts) == requests_made and all(e["status"] != "pending" for e in evts)
    assert kiln_requests_total(gw) == requests_made
    assert_books_balance(engine, org.id)


# -- the real model server ------------------------------------------------------------------

def llama_available():
    # Found, not imported: importing loads the native library into the test process.
    return importlib.util.find_spec("llama_cpp") is not None


@pytest.fixture(scope="module")
def llama_gateway(pg_url):
    """The real llama.cpp server (SmolLM2-135M) and a gateway in front of it.

    The server is started with ``INTERRUPT_REQUESTS=false``: by default llama-cpp-python ends a
    running stream when another request arrives, which would hide a generation left running.
    """
    from model_server import start_model_server, stop, wait_ready
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="kiln-llama-"))
    saved = os.environ.get("INTERRUPT_REQUESTS")
    os.environ["INTERRUPT_REQUESTS"] = "false"  # read by the server's settings (pydantic)
    try:
        proc = start_model_server(sys.executable, port, work / "llama.log")
    finally:
        if saved is None:
            del os.environ["INTERRUPT_REQUESTS"]
        else:
            os.environ["INTERRUPT_REQUESTS"] = saved
    gw = None
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout_s=180, proc=proc)
        catalog = work / "models.toml"
        catalog.write_text((ROOT / "gateway" / "demo_models.toml").read_text().replace(
            "http://127.0.0.1:8081", f"http://127.0.0.1:{port}"))
        gw = Gateway({"KILN_DATABASE_URL": pg_url, "KILN_MODELS": str(catalog)},
                     workers=1).start()
        yield gw
    finally:
        if gw is not None:
            gw.stop()
        stop(proc)


@pytest.mark.llama
@pytest.mark.skipif(not llama_available(), reason="llama_cpp is not installed")
def test_real_model_server_stops_generating_when_the_client_leaves(llama_gateway, engine):
    """The model server runs one generation at a time: if it kept generating for a client that
    left, the next request would wait for it. End-of-sequence is banned so that the abandoned
    generation would run to ``max_tokens``."""
    org = make_org(engine, f"llama-cancel-{time.monotonic_ns()}")
    long_body = {"model": "smollm2-135m", "stream": True, "max_tokens": 1000, "temperature": 0,
                 "logit_bias": {"0": -100, "1": -100, "2": -100},
                 "messages": [{"role": "user", "content": "Count from 1 to 1000."}]}
    t0 = time.monotonic()
    full = RawStream(llama_gateway.base_url, org.key, {**long_body, "max_tokens": 200})
    full.read_all(timeout_s=120)
    full_s_per_token = (time.monotonic() - t0) / 200
    raw = RawStream(llama_gateway.base_url, org.key, long_body).read_head(timeout_s=60)
    raw.read_until(lambda s: len(data_events(s.body)) >= 5, timeout_s=60)
    raw.close()
    t0 = time.monotonic()
    with openai.OpenAI(base_url=llama_gateway.base_url + "/v1", api_key=org.key,
                       max_retries=0, timeout=120) as client:
        client.chat.completions.create(model="smollm2-135m", max_tokens=5, messages=MESSAGES)
    next_s = time.monotonic() - t0
    # The rest of the abandoned generation would take ~ (1000 - 5) tokens of time.
    assert next_s < 0.25 * 995 * full_s_per_token, (next_s, full_s_per_token)
    event = settled_event(engine, raw.gid)
    assert event["status"] == "client_cancelled" and 1 <= event["completion_tokens"] < 500
    assert event["estimated"] and event["cost_nanos"] > 0
    wait_until(lambda: balance_nanos(engine, org.id)[2] == 0)
    assert_books_balance(engine, org.id)


def test_settle_before_answer_holds_the_streams_end_until_its_settlement_commits(
        start_gateway, fake, engine, org):
    """``KILN_SETTLE_BEFORE_ANSWER=true`` (docs/METERING.md): the last bytes of a completed
    stream leave only once its settlement has committed. The test holds the org's balance row
    locked (``FOR UPDATE``) so that the settlement waits on it, and sees that wait in
    ``pg_locks``; the stream's end has not arrived then (without the setting it was written
    before the settlement began). Once the lock goes, the end arrives, and the event read at
    that moment is already final with the cost the client was told."""
    gw = start_gateway(settle_before_answer="true", settle_wait_s=120)
    opened = threading.Event()
    status, first, *rest = sse([chat_chunk("Hello"), chat_chunk(finish_reason="stop"),
                                chat_chunk(choices=False, usage=make_usage(9, 2))])
    fake.enqueue([status, first, Gate(opened), *rest])
    raw = RawStream(gw.base_url, org.key, stream_body(
        stream_options={"include_usage": True})).read_until(lambda s: b"Hello" in s.body)
    with engine.connect() as holder:
        tx = holder.begin()
        holder.execute(sa.text("SELECT 1 FROM credit_balances WHERE org_id = :o FOR UPDATE"),
                       {"o": org.id})
        mine = holder.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
        opened.set()
        with engine.connect() as conn:
            wait_until(lambda: conn.execute(sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE :me = ANY(pg_blocking_pids(pid))"),
                {"me": mine}).scalar_one() > 0, timeout_s=30)
        with pytest.raises(AssertionError, match="timed out"):
            raw.read_until(lambda s: s.ended, timeout_s=2)  # the end waits for the commit
        assert b"[DONE]" not in raw.body
        tx.rollback()
    raw.read_all()
    assert raw.ended and raw.body.endswith(b"data: [DONE]\n\n")
    event = usage_event(engine, raw.gid, settled=False)  # read at once: no wait for it
    told = json.loads(data_events(raw.body)[-2][6:], parse_float=Decimal)["usage"]["cost"]
    assert event["status"] == "completed"
    assert Decimal(event["cost_nanos"]) / 10**9 == told and event["cost_nanos"] == nanos(9, 2)
