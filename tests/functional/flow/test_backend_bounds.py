"""Bounded memory per stream and backend answers Kiln must understand (README "Streaming" and
the backend error table), through gunicorn with the scripted fake upstream.

A client that stops reading stops Kiln reading the backend (the fake's writes block) and is hung
up on after the idle timeout, billed for what was generated; an event or a reply over its limit
ends the request with a clear error; the event splitter is linear; a stream answered with
something other than an event stream is the reference's 502, unbilled; a whole reply over its
bound is 502 ``upstream_too_large``, billed what was generated; gzip and deflate answers are
decoded.
"""
import gzip
import json
import socket
import time
import zlib

import openai
import pytest
import requests

from fake_upstream import (Send, Sleep, Status, chat_chunk, chat_completion, make_usage,
                           sse, sse_event)
from gateway.backends.sse import EventSplitter
from factories import MESSAGES
from gateway_proc import balance_nanos, settled_event, wait_until
from streams import (GRANT, RawStream, assert_books_balance, data_events, org_events,
                     stream_body)

MiB = 1024 * 1024


def chat_url(gw):
    return gw.base_url + "/v1/chat/completions"


# -- a client that stops reading ------------------------------------------------------------

def test_a_client_that_stops_reading_stops_the_backend_and_is_hung_up_on(start_gateway, fake,
                                                                         org, engine):
    gw = start_gateway(workers=1, upstream_read_timeout_s=3)
    # A 32 KiB event holding one token (the rest a long system_fingerprint, so that the budget
    # is not what stops it), sent 4,096 times.
    event = sse_event({**chat_chunk("x"), "system_fingerprint": "p" * 32768})
    script = [Status(200, {"Content-Type": "text/event-stream"})] + [Send(event)] * 4096
    fake.enqueue(script)
    sock = socket.create_connection(("127.0.0.1", gw.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    body = json.dumps(stream_body()).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: kiln\r\nAuthorization: Bearer "
                 + org.key.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    # The client reads nothing. Kiln gives up on it after the idle timeout and closes the
    # backend request; until then the fake's writes blocked on a full connection.
    record = fake.wait_for(lambda rs: rs and rs[-1].closed_at and rs[-1], timeout=120)
    sent = len(record.sent_at) * len(event)
    assert not record.completed and sent < 48 * MiB < len(script) * len(event)
    head = sock.recv(65536)  # what the client was sent before it stopped reading
    gid = head.split(b"X-Neocloud-Generation-Id: ")[1].split(b"\r\n")[0].decode()
    sock.close()
    usage = settled_event(engine, gid, timeout_s=60)
    assert usage["status"] == "client_cancelled" and usage["completion_tokens"] > 0
    assert usage["cost_nanos"] > 0
    assert_books_balance(engine, org.id)


# -- limits on what a backend sends ---------------------------------------------------------

def test_an_event_longer_than_the_limit_ends_the_stream_with_an_error(start_gateway, fake, org,
                                                                      engine):
    gw = start_gateway(max_event_bytes=65536)
    line = b"data: " + b"y" * 40000  # an event that never ends, sent in pieces
    fake.enqueue(sse([chat_chunk("a")], done=False) + [Send(line)] * 8)
    raw = RawStream(gw.base_url, org.key, stream_body()).read_all()
    assert raw.status == 200 and raw.ended and b"[DONE]" not in raw.body
    error = json.loads(data_events(raw.body)[-1][6:])["error"]
    assert "longer than 65536 bytes" in error["message"]
    event = settled_event(engine, raw.gid)
    assert event["status"] == "upstream_error" and event["completion_tokens"] == 1
    assert_books_balance(engine, org.id)


@pytest.mark.parametrize("encoding", [None, "gzip"])
def test_a_reply_larger_than_the_limit_is_502_and_billed_what_was_generated(
        start_gateway, fake, org, engine, encoding):
    """docs/RELIABILITY.md, "Big answers": the backend answered and generated, so the reply
    is billed Kiln's own count (the prompt estimate, and a token per 64 bytes read, within
    the cap held), and the client is told 502 ``upstream_too_large`` in the error envelope."""
    gw = start_gateway(max_reply_bytes=20_000)
    reply = json.dumps(chat_completion("z" * 300_000)).encode()
    headers = {"Content-Type": "application/json"}
    if encoding:  # small on the wire, large once decoded
        reply, headers = gzip.compress(reply), {**headers, "Content-Encoding": encoding}
    fake.enqueue([Status(200, {**headers, "Content-Length": str(len(reply))}, chunked=False),
                  Send(reply)])
    r = requests.post(chat_url(gw), json={"model": "fake-model", "messages": MESSAGES,
                                          "max_tokens": 1024},
                      headers=org.headers, timeout=60)
    assert r.status_code == 502 and r.headers["Content-Type"] == "application/json"
    error = r.json()["error"]
    assert error["code"] == "upstream_too_large" and "larger than 20000 bytes" in error["message"]
    event = settled_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert (event["status"], event["error_code"]) == ("upstream_error", "upstream_too_large")
    assert event["completion_tokens"] == 313 and event["estimated"]  # ceil(20,001 / 64)
    assert event["prompt_tokens"] > 0 and event["cost_nanos"] > 0
    assert balance_nanos(engine, org.id) == (GRANT - event["cost_nanos"], 0, 0)
    assert len([rec for rec in fake.requests if rec.method == "POST"]) == 1


def test_a_reply_over_its_request_s_own_bound_is_billed_the_cap(start_gateway, fake, org,
                                                                engine):
    """A reply no backend keeping to ``max_tokens`` can send (over 384 bytes a token, plus
    its envelope) is cut there, however high the setting, and billed the cap."""
    gw = start_gateway()
    reply = json.dumps(chat_completion("z" * 300_000)).encode()
    fake.enqueue([Status(200, {"Content-Type": "application/json",
                               "Content-Length": str(len(reply))}, chunked=False), Send(reply)])
    r = requests.post(chat_url(gw), json={"model": "fake-model", "messages": MESSAGES,
                                          "max_tokens": 10}, headers=org.headers, timeout=60)
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_too_large"
    event = settled_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert event["completion_tokens"] == 10 and event["cost_nanos"] > 0


def splitter_cpu_s(size, chunk=64, repeats=3):
    """CPU seconds (best of ``repeats``) to split one event of ``size`` bytes fed in pieces of
    ``chunk`` bytes."""
    line = b"data: " + b"q" * size
    pieces = [line[i:i + chunk] for i in range(0, len(line), chunk)] + [b"\n\n"]
    best = float("inf")
    for _ in range(repeats):
        splitter = EventSplitter(max_event_bytes=16 * MiB)
        start = time.process_time()
        for piece in pieces:
            out = splitter.feed(piece)
        best = min(best, time.process_time() - start)
        assert out == [line[6:]]
    return best


def test_the_splitter_is_linear_in_the_size_of_a_long_event():
    small, large = splitter_cpu_s(MiB), splitter_cpu_s(8 * MiB)
    # Linear: about 8x; a splitter that rescans its buffer on every piece would be about 64x.
    assert large / small < 24, (small, large)


# -- what a backend answers: not an event stream, compressed ---------------------------------

@pytest.mark.parametrize("content_type,reply", [
    ("application/json", json.dumps({"error": {"message": "model overloaded"}}).encode()),
    ("text/html", b"<html><body>502 Bad Gateway</body></html>"),
    (None, b"data: {}\n\n"),
], ids=["json-error", "html", "no-type"])
def test_a_stream_answered_with_no_event_stream_is_502_and_unbilled(gateway, fake, org, engine,
                                                                    client, content_type,
                                                                    reply):
    headers = {"Content-Length": str(len(reply))}
    if content_type:
        headers["Content-Type"] = content_type
    for _ in range(2):
        fake.enqueue([Status(200, headers, chunked=False), Send(reply)])
    r = requests.post(chat_url(gateway), json=stream_body(), headers=org.headers, timeout=30)
    assert r.status_code == 502 and r.headers["Content-Type"].startswith("text/plain")
    assert "not an event stream" in r.text and b"data:" not in r.content
    with pytest.raises(openai.APIStatusError) as err:  # as the SDK sees it
        list(client.chat.completions.create(model="fake-model", messages=MESSAGES,
                                            stream=True))
    assert err.value.status_code == 502
    assert [e["status"] for e in org_events(engine, org.id)] == ["upstream_error"] * 2
    assert balance_nanos(engine, org.id) == (GRANT, 0, 0)


def test_a_late_answer_that_is_no_event_stream_ends_the_begun_stream_with_an_error(
        start_gateway, fake, org, engine):
    """A backend silent past the keepalive interval: the stream's head and a keepalive comment
    went out, so its JSON error (status 200) is told as one SSE error event, no [DONE], and
    nothing is billed (README "Streaming")."""
    gw = start_gateway(workers=1, keepalive_s=0.5)
    reply = json.dumps({"error": {"message": "model overloaded"}}).encode()
    fake.enqueue([Sleep(1.5), Status(200, {"Content-Type": "application/json",
                                           "Content-Length": str(len(reply))}, chunked=False),
                  Send(reply)])
    r = requests.post(chat_url(gw), json=stream_body(), headers=org.headers, timeout=30)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    assert r.text.startswith(": keepalive") and "[DONE]" not in r.text
    events = [json.loads(e[6:]) for e in data_events(r.content)]
    assert len(events) == 1 and "not an event stream" in events[0]["error"]["message"]
    settled_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert [e["status"] for e in org_events(engine, org.id)] == ["upstream_error"]
    assert balance_nanos(engine, org.id) == (GRANT, 0, 0)


def compressor(encoding):
    """A streaming compressor for the HTTP content coding ``encoding`` (RFC 9110, 8.4.1)."""
    return zlib.compressobj(wbits=31 if encoding == "gzip" else 15)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_replies_are_decoded(client, fake, org, engine, encoding):
    reply = compressor(encoding)
    body = reply.compress(json.dumps(chat_completion("Hello there", usage=make_usage(12, 3)))
                          .encode()) + reply.flush()
    fake.enqueue([Status(200, {"Content-Type": "application/json", "Content-Encoding": encoding,
                               "Content-Length": str(len(body))}, chunked=False), Send(body)])
    completion = client.chat.completions.create(model="fake-model", messages=MESSAGES)
    assert completion.choices[0].message.content == "Hello there"
    assert completion.usage.completion_tokens == 3
    assert fake.requests[-1].headers["Accept-Encoding"] == "identity"


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_streams_are_decoded_event_by_event(client, fake, org, engine, encoding):
    stream = compressor(encoding)
    events = [chat_chunk(w, role="assistant" if i == 0 else None)
              for i, w in enumerate(["Hel", "lo", " there"])]
    events += [chat_chunk(finish_reason="stop"), chat_chunk(choices=False,
                                                            usage=make_usage(12, 3))]
    pieces = [stream.compress(sse_event(e)) + stream.flush(zlib.Z_SYNC_FLUSH) for e in events]
    pieces.append(stream.compress(b"data: [DONE]\n\n") + stream.flush())
    fake.enqueue([Status(200, {"Content-Type": "text/event-stream",
                               "Content-Encoding": encoding})] + [Send(p) for p in pieces])
    chunks = list(client.chat.completions.create(model="fake-model", messages=MESSAGES,
                                                 stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        "Hello there"
    assert chunks[-1].usage.completion_tokens == 3
    assert fake.requests[-1].headers["Accept-Encoding"] == "identity"
    gid = org_events(engine, org.id)[-1]["id"]
    event = settled_event(engine, gid)
    assert event["status"] == "completed" and event["completion_tokens"] == 3
    wait_until(lambda: balance_nanos(engine, org.id)[1:] == (0, 0))
