"""A whole (non-stream) reply larger than Kiln reads for its request (docs/RELIABILITY.md, "Big
answers"), in process against the scripted fake upstream: it is the backend's answer, not its
failure. Never retried on another backend (which would generate it again), never counted on
the backend's breaker, taken (so what was generated is billed) and told as 502
``upstream_too_large`` in the error envelope."""
import json
import time

import pytest
from flask import Flask

from factories import entry, services
from fake_upstream import Close, FakeUpstream, Send, Status, chat_completion, json_reply
from gateway.backends import upstream
from gateway.backends.exchange import Exchange
from gateway.backends.fleet import Route
from gateway.contract.catalog import Backend, Timeouts
from gateway.errors import UpstreamError, UpstreamTooLarge

pytestmark = pytest.mark.unit

BIG = chat_completion("z" * 5000)


@pytest.fixture
def fleet(tmp_path):
    """Two fake upstreams behind one model; ``exchange(**settings)`` opens a non-stream
    exchange over them with these settings (retries and a breaker that opens on one
    failure)."""
    with FakeUpstream() as one, FakeUpstream() as two:
        fakes = (one, two)
        backends = [Backend(url=f.base_url, model="m") for f in fakes]
        session = upstream.create_session(4)
        made = []

        def exchange(max_reply_bytes=None, **settings):
            svc = services(tmp_path, upstream_retries=2, breaker_failures=1, **settings)
            svc.session, svc.live = session, set()
            route = Route(svc, entry(backends), [])
            route.take(0)
            ex = Exchange(svc, route, Timeouts(5, 30, 30), lambda b: b"{}", False, None,
                          max_reply_bytes=max_reply_bytes)
            made.append(ex)
            return svc, ex

        yield fakes, backends, exchange
        for ex in made:
            ex.close()
        session.close()


def test_a_reply_over_the_setting_is_taken_once_and_not_held_against_the_backend(fleet):
    fakes, backends, exchange = fleet
    for fake in fakes:
        fake.enqueue(json_reply(BIG))
    svc, ex = exchange(max_reply_bytes=1000)
    with pytest.raises(UpstreamError) as err:
        ex.send_and_read(json.loads)
    assert err.value.code == "upstream_too_large" and err.value.status == 502
    assert sum(len(f.requests) for f in fakes) == 1 and len(ex.attempts) == 1  # no retry
    assert ex.accepted and ex.oversized_bytes == 1001  # what was read: billed
    now = time.monotonic()
    assert all(svc.states[b].breaker.failures == 0 and svc.states[b].breaker.is_up(now)
               for b in backends)
    assert ex.route.answered


def test_a_reply_within_the_request_bound_is_read_whole(fleet):
    fakes, _, exchange = fleet
    for fake in fakes:
        fake.enqueue(json_reply(BIG))
    _, ex = exchange(max_reply_bytes=len(json.dumps(BIG)) + 100)
    assert ex.send_and_read(json.loads)["choices"][0]["message"]["content"] == "z" * 5000
    assert ex.accepted and ex.oversized_bytes is None and len(ex.attempts) == 1


def test_the_setting_is_read_when_no_bound_is_given(tmp_path):
    svc = services(tmp_path, max_reply_bytes=1000)
    with FakeUpstream() as fake:
        fake.enqueue(json_reply(BIG))
        svc.session, svc.live = upstream.create_session(1), set()
        route = Route(svc, entry([Backend(url=fake.base_url, model="m")]), [])
        route.take(0)
        ex = Exchange(svc, route, Timeouts(5, 30, 30), lambda b: b"{}", False, None)
        try:
            with pytest.raises(UpstreamError) as err:
                ex.send_and_read(json.loads)
        finally:
            ex.close()
            svc.session.close()
    assert err.value.code == "upstream_too_large" and ex.oversized_bytes == 1001


def test_a_reply_that_breaks_off_is_still_a_failure_retried_elsewhere(fleet):
    fakes, _, exchange = fleet
    body = json.dumps(BIG).encode()
    broken = [Status(200, {"Content-Type": "application/json",
                           "Content-Length": str(len(body))}, chunked=False),
              Send(body[:100]), Close()]
    _, ex = exchange()
    for fake in fakes:
        fake.enqueue(broken if fake.base_url == ex.backend.url else json_reply(BIG))
    assert ex.send_and_read(json.loads)["id"] == BIG["id"]
    assert len(ex.attempts) == 2


def test_the_error_is_told_in_the_envelope():
    with Flask(__name__).app_context():
        resp = UpstreamTooLarge("too large", bytes_read=5).to_response()
    assert resp.status_code == 502 and resp.mimetype == "application/json"
    assert json.loads(resp.get_data())["error"]["code"] == "upstream_too_large"


def test_the_api_document_lists_the_error_in_the_envelope():
    from gateway.api.openapi import build_document
    for path in ("/v1/chat/completions", "/v1/completions"):
        doc = build_document(16 * 1024 * 1024)["paths"][path]["post"]["responses"]["502"]
        assert set(doc["content"]) == {"text/plain", "application/json"}
        assert "upstream_too_large" in doc["description"]
