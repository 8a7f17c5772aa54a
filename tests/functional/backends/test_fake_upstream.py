"""Self-tests for the scripted fake upstream (tests/support/fake_upstream.py)."""

import itertools
import json
import threading
import time

import pytest
import requests
from fake_upstream import fail_on_fake_errors
from gateway_proc import wait_until
from fake_upstream import (
    Close,
    FakeUpstream,
    Gate,
    Hang,
    Reset,
    Send,
    Sleep,
    Status,
    chat_chunk,
    default_script,
    error_reply,
    json_reply,
    sse,
)

SSE_HEADERS = {"Content-Type": "text/event-stream"}


@pytest.fixture
def fake():
    with FakeUpstream() as server:
        yield server
    assert not server.errors


def chat(fake, stream=False, timeout=5):
    """POST a chat completion; ``stream`` sets both the body flag and requests' streaming."""
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    return requests.post(fake.base_url + "/chat/completions", json=body, stream=stream,
                         timeout=timeout)


def read_chunks(response):
    """[(arrival monotonic seconds, bytes)] for each HTTP chunk of a streamed response."""
    return [(time.monotonic(), c) for c in response.iter_content(chunk_size=None)]


def test_default_json_reply(fake):
    r = chat(fake)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "m1"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    (rec,) = fake.requests
    assert (rec.method, rec.path) == ("POST", "/v1/chat/completions")
    assert rec.headers["CONTENT-TYPE"] == "application/json"
    assert rec.json["messages"][0]["content"] == "hi"
    # The fake marks the script complete just after its last byte leaves, so the client may
    # hold the whole reply a moment before the record says so.
    fake.wait_for(lambda rs: rs[0].completed)
    assert rec.closed_at is None


@pytest.mark.parametrize("include_usage", [False, True])
def test_default_stream(fake, include_usage):
    body = {"model": "m1", "messages": [], "stream": True,
            "stream_options": {"include_usage": include_usage}}
    with requests.post(fake.base_url + "/chat/completions", json=body, stream=True,
                       timeout=5) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == b"data: [DONE]"
    events = [json.loads(ln[len(b"data: "):]) for ln in lines[:-1]]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == "Hello from the fake upstream!"
    assert any(e["choices"] and e["choices"][0]["finish_reason"] == "stop" for e in events)
    usage_chunks = [e for e in events if "usage" in e]
    assert len(usage_chunks) == int(include_usage)
    if include_usage:
        assert usage_chunks[0]["choices"] == []


def test_scripted_sse_chunks_arrive_separately_with_delays(fake):
    fake.enqueue(sse([chat_chunk("a"), chat_chunk("b"), chat_chunk("c")], delay_s=0.15))
    with chat(fake, stream=True) as r:
        start = time.monotonic()
        chunks = read_chunks(r)
    assert [c for _, c in chunks][-1] == b"data: [DONE]\n\n"
    assert [json.loads(c[6:])["choices"][0]["delta"]["content"] for _, c in chunks[:3]] == [
        "a", "b", "c"]
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(chunks)]
    assert all(g > 0.05 for g in gaps), gaps
    assert chunks[-1][0] - start > 0.3


def test_raw_split_bytes_arrive_exactly(fake):
    pieces = [b'data: {"choices":[{"delta":{"con', b'tent":"x"}}]}\r', b"\n\r\n",
              b": ping\n\n", b"event: message\nretry: 100\n", b"data: [DONE]\n\n"]
    fake.enqueue(sse(pieces, done=False))
    with chat(fake, stream=True) as r:
        assert r.headers["content-type"] == "text/event-stream"
        got = [c for _, c in read_chunks(r)]
    assert got == pieces


def test_non_chunked_raw_body_then_close(fake):
    fake.enqueue([Status(200, SSE_HEADERS, chunked=False), Send(b"data: 1\n\n"),
                  Sleep(0.05), Send(b"data: 2\n\n")])
    r = chat(fake)
    assert r.headers["connection"] == "close"
    assert r.content == b"data: 1\n\ndata: 2\n\n"


@pytest.mark.parametrize("end", [Reset(), Close()], ids=["reset", "close"])
def test_abort_mid_stream_raises(fake, end):
    fake.enqueue([Status(200, SSE_HEADERS), Send(b"data: partial\n\n"), Sleep(0.05), end])
    broken = (requests.ConnectionError, requests.exceptions.ChunkedEncodingError)
    with pytest.raises(broken), chat(fake, stream=True) as r:
        read_chunks(r)
    # The client may see the abort before the server's thread records the script's end.
    assert fake.wait_for(lambda records: records and records[0].completed, timeout=5)


def test_reset_before_status_raises_connection_error(fake):
    fake.enqueue([Reset()])
    with pytest.raises(requests.ConnectionError):
        chat(fake)


def test_hang_then_client_close_sets_closed_at(fake):
    fake.enqueue([Status(200, SSE_HEADERS), Send(b": hello\n\n"), Hang()])
    with chat(fake, stream=True) as r:
        chunks = r.iter_content(chunk_size=None)  # keep a reference: a dropped
        assert next(chunks) == b": hello\n\n"  # generator closes the connection
        time.sleep(0.1)
        assert fake.active == 1 and fake.requests[0].closed_at is None
        closing = time.monotonic()
    (rec,) = fake.wait_for(lambda recs: [x for x in recs if x.closed_at])
    assert closing <= rec.closed_at < closing + 2
    assert not rec.completed
    fake.wait_for(lambda _: fake.active == 0)


def test_hang_before_status_and_client_timeout(fake):
    fake.enqueue([Hang()])
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.post(fake.base_url + "/chat/completions", json={}, timeout=0.2)
    assert fake.wait_for(lambda recs: recs[0].closed_at)


def test_max_active_counts_concurrent_requests(fake):
    release = threading.Event()  # all eight are held until they are all active
    fake.default = lambda record: [Gate(release), *default_script(record)]
    results = []
    threads = [threading.Thread(target=lambda: results.append(chat(fake, timeout=60)
                                                              .status_code))
               for _ in range(8)]
    for t in threads:
        t.start()
    fake.wait_for(lambda _: fake.active == 8, timeout=30)
    release.set()
    for t in threads:
        t.join()
    assert results == [200] * 8
    # Each handler leaves ``active`` just after its last byte, which its client may already
    # have read: wait for the count to come down.
    fake.wait_for(lambda _: fake.active == 0)
    assert fake.max_active == 8
    fake.reset_stats()
    assert fake.max_active == 0


def test_keep_alive_and_path_scoped_queue(fake):
    fake.enqueue(json_reply({"scripted": True}))
    with requests.Session() as s:
        models = s.get(fake.base_url + "/models", timeout=5).json()
        scripted = s.post(fake.base_url + "/chat/completions", json={}, timeout=5).json()
        with s.post(fake.base_url + "/chat/completions", json={"stream": True}, stream=True,
                    timeout=5) as r:
            streamed = r.content
        default = s.post(fake.base_url + "/chat/completions", json={}, timeout=5).json()
    assert models["data"][0]["id"] == "fake-model"
    assert scripted == {"scripted": True}  # GET /v1/models did not consume the script
    assert streamed.endswith(b"data: [DONE]\n\n")
    assert default["object"] == "chat.completion"
    # The fake marks a script completed just after its last byte, which the client may
    # already have read: wait for the mark.
    recs = fake.wait_for(lambda rs: len(rs) == 4 and all(rec.completed for rec in rs) and rs)
    assert len({rec.conn_id for rec in recs}) == 1


@pytest.mark.parametrize("plain", [False, True])
def test_error_reply(fake, plain):
    fake.enqueue(error_reply(429, "slow down", plain=plain))
    r = chat(fake)
    assert r.status_code == 429
    assert (r.text if plain else r.json()["error"]["message"]) == "slow down"


def test_a_failing_responder_fails_the_test_not_reads_as_a_502():
    """The shared ``fake`` fixture (conftest.py) fails a test whose fake upstream broke."""
    def broken(record):
        raise KeyError("a bug in a responder")

    with FakeUpstream(default=broken) as server:
        with pytest.raises(requests.ConnectionError):
            chat(server)
        wait_until(lambda: server.errors, timeout_s=10)
    fail_on_fake_errors(server, since=len(server.errors))  # nothing new: passes
    with pytest.raises(pytest.fail.Exception, match="a bug in a responder"):
        fail_on_fake_errors(server, since=0)
