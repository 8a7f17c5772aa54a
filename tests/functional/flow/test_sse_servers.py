"""Streams from every real server, through gunicorn with gevent workers on Postgres: a backend's
stream that uses more of the SSE standard than OpenAI does (WHATWG HTML, "Server-sent events": a
byte-order mark, event names, several data lines in one event, ``id:``, ``retry:``, bare field
names) reaches the client as OpenAI's chunks, one ``data:`` line each (docs/RELIABILITY.md,
"Streams from every real server"); an ``event: error`` is the backend's error."""
import json

import openai
import pytest

from factories import MESSAGES, fake_model_nanos
from fake_upstream import Close, Reset, Send, Status, chat_chunk, sse
from gateway_proc import balance_nanos, settled_event
from streams import SSE_HEAD, RawStream, assert_books_balance, close_raw_streams, data_events, \
    stream_body


@pytest.fixture(autouse=True)
def raw_streams_closed():
    yield
    close_raw_streams()


def compact(obj):
    return json.dumps(obj, separators=(",", ":")).encode()


def full_standard_stream():
    """The bytes of a stream with a byte-order mark, named events around the chat chunks, a
    chunk in three data lines, ``id:``/``retry:`` fields and bare field names; and its pieces,
    the mark cut in two."""
    first = compact(chat_chunk("Hello", role="assistant"))
    third = compact(chat_chunk(" world"))
    split = b'{"id":"chatcmpl-fake","object":"chat.completion.chunk",\n' \
            b'"choices":[{"index":0,"delta":{"content":","},\n"finish_reason":null}]}'
    lines = split.split(b"\n")
    stream = (b"\xef\xbb\xbf: a server's hello\n\n"
              + b"retry: 3000\nid: 1\n\n"
              + b"event: ping\ndata: {\"type\":\"ping\"}\n\n"
              + b"id: 2\nevent: message\ndata: " + first + b"\r\n\r\n"
              + b"data: " + lines[0] + b"\ndata:" + lines[1] + b"\ndata: " + lines[2]
              + b"\nid\n\n"
              + b"event: response.output_text.delta\ndata: {\"delta\":\"never relayed\"}\n\n"
              + b"event\ndata: " + third + b"\n\n"
              + b"data: " + compact(chat_chunk(finish_reason="stop")) + b"\n\n"
              + b"data: [DONE]\n\n")
    return [stream[:1], stream[1:3], stream[3:]], (first, split.replace(b"\n", b" "), third)


def test_a_stream_with_all_of_the_standard_reaches_the_client_as_openai_chunks(
        gateway, fake, org, engine):
    pieces, kept = full_standard_stream()
    fake.enqueue([Status(200, SSE_HEAD)] + [Send(piece) for piece in pieces])
    raw = RawStream(gateway.base_url, org.key, stream_body()).read_all()
    assert raw.status == 200 and raw.ended
    finish = compact(chat_chunk(finish_reason="stop"))
    assert raw.body == b"".join(b"data: " + p + b"\n\n" for p in (*kept, finish)) \
        + b"data: [DONE]\n\n"
    assert b"never relayed" not in raw.body and b"ping" not in raw.body
    event = settled_event(engine, raw.gid)
    assert event["status"] == "completed"
    assert_books_balance(engine, org.id)


def test_the_openai_sdk_reads_it(gateway, fake, org):
    pieces, _ = full_standard_stream()
    fake.enqueue([Status(200, SSE_HEAD)] + [Send(piece) for piece in pieces])
    with openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=org.key, max_retries=0,
                       timeout=30) as client:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(model="fake-model", messages=MESSAGES,
                                                      stream=True) if chunk.choices)
    assert text == "Hello, world"


def test_an_error_event_first_is_a_refusal_billed_nothing(gateway, fake, org, engine):
    start = balance_nanos(engine, org.id)[0]
    fake.enqueue(sse([b"event: error\ndata: {\"type\":\"error\",\"message\":"
                      b"\"prompt refused by the content filter\"}\n\n"], done=False))
    raw = RawStream(gateway.base_url, org.key, stream_body()).read_all()
    assert raw.status == 200 and raw.ended and b"[DONE]" not in raw.body
    (last,) = data_events(raw.body)
    error = json.loads(last[6:])["error"]
    assert error["code"] == "upstream_error" and "content filter" in error["message"]
    event = settled_event(engine, raw.gid)
    assert (event["status"], event["cost_nanos"], event["prompt_tokens"],
            event["completion_tokens"]) == ("upstream_error", 0, 0, 0)
    assert balance_nanos(engine, org.id)[0] == start


def test_an_error_event_mid_stream_ends_it_as_one_error_billed_what_was_relayed(
        gateway, fake, org, engine):
    fake.enqueue(sse([chat_chunk("a", role="assistant"),
                      b"event: error\ndata: {\"error\":{\"message\":\"CUDA out of memory\"}}"
                      b"\n\n"], done=False))
    raw = RawStream(gateway.base_url, org.key, stream_body()).read_all()
    first, last = data_events(raw.body)
    assert json.loads(first[6:])["choices"][0]["delta"]["content"] == "a"
    assert "CUDA out of memory" in json.loads(last[6:])["error"]["message"]
    assert b"[DONE]" not in raw.body
    event = settled_event(engine, raw.gid)
    assert event["status"] == "upstream_error" and event["completion_tokens"] == 1
    assert event["cost_nanos"] == fake_model_nanos(prompt=event["prompt_tokens"], completion=1)
    assert_books_balance(engine, org.id)


EVENT_STREAM = Status(200, {"Content-Type": "text/event-stream"})


@pytest.mark.parametrize("ending", ["empty", "comment then close", "reset"])
def test_a_stream_ended_before_its_first_event_is_a_refusal_billed_nothing(
        gateway, fake, org, engine, ending):
    """llama-cpp-python answers a prompt over its context window with HTTP 200 and an empty
    event stream; a backend may also break the connection before its first event. Nothing was
    generated and the client got nothing: its error event, a usage event that bills nothing
    (docs/METERING.md, "A client that leaves")."""
    start = balance_nanos(engine, org.id)[0]
    script = {"empty": [EVENT_STREAM, Close()],
              "comment then close": [EVENT_STREAM, Send(b": ping\n\n"), Close()],
              "reset": [EVENT_STREAM, Send(b": ping\n\n"), Reset()]}[ending]
    fake.enqueue(script)
    raw = RawStream(gateway.base_url, org.key, stream_body()).read_all()
    assert raw.status == 200 and raw.ended and b"[DONE]" not in raw.body
    (last,) = data_events(raw.body)
    assert json.loads(last[6:])["error"]["code"] == "upstream_error"
    event = settled_event(engine, raw.gid)
    assert (event["status"], event["cost_nanos"], event["prompt_tokens"],
            event["completion_tokens"]) == ("upstream_error", 0, 0, 0)
    assert balance_nanos(engine, org.id)[0] == start
    assert_books_balance(engine, org.id)


def test_a_stream_that_breaks_after_an_empty_event_is_billed_its_prompt(gateway, fake, org,
                                                                       engine):
    """An event, even one without a chunk, is the backend at work: a break after it is billed
    the prompt as any broken stream is; only a stream with no event at all is a refusal."""
    fake.enqueue([EVENT_STREAM, Send(b"data: \n\n"), Close()])
    raw = RawStream(gateway.base_url, org.key, stream_body()).read_all()
    assert raw.status == 200 and b"[DONE]" not in raw.body
    event = settled_event(engine, raw.gid)
    assert event["status"] == "upstream_error" and event["prompt_tokens"] > 0
    assert event["cost_nanos"] == fake_model_nanos(prompt=event["prompt_tokens"]) > 0
    assert_books_balance(engine, org.id)
