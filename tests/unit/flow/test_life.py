"""The flow's one ``finally``, in-process: however a generation's response ends (fully written,
closed early by the server, a failure before or after the head, a failing close), it is settled
exactly once, with the outcome the table gives."""
from types import SimpleNamespace

import pytest

from gateway.dialects.chat import ChatStream
from gateway.flow.answers import Head
from gateway.flow.life import _life
from gateway.errors import UpstreamError, UpstreamRejected
from gateway.endings import Status
from gateway.backends.relay import ClientGone, StreamFailed
from gateway.backends.spans import NO_SPANS

pytestmark = pytest.mark.unit


class StubGeneration:
    """What ``_life`` uses of a generation and its exchange: close (the exchange's) and settle
    (the generation's), counted on one object; untraced."""

    spans = NO_SPANS

    def __init__(self, close_fails=False):
        self.closed, self.close_fails, self.settled = 0, close_fails, []
        self.charged_usd = None

    def close(self):
        self.closed += 1
        if self.close_fails:
            raise OSError("close failed")

    def settle(self, outcome):
        self.settled.append(outcome)
        self.charged_usd = "0.5"


def life_of(monkeypatch, body, gen=None):
    """Run ``_life`` with ``body(gen)`` as the stream path, rendered as chat."""
    gen = gen or StubGeneration()
    return gen, _life(gen, gen, body(gen), ChatStream(SimpleNamespace(include_usage=False)))


def head_then(*parts, fail=None):
    def body(gen):
        yield Head(200, "text/event-stream", {})
        yield from parts
        if fail is not None:
            raise fail
    return body


def test_a_complete_response_settles_once_as_completed(monkeypatch):
    gen, life = life_of(monkeypatch, head_then(b"a", b"b"))
    assert isinstance(next(life), Head) and list(life) == [b"a", b"b"]
    life.close()
    assert [o.status for o in gen.settled] == [Status.COMPLETED] and gen.closed == 1


def test_closed_after_the_head_settles_once_as_cancelled(monkeypatch):
    gen, life = life_of(monkeypatch, head_then(b"a", b"b"))
    next(life)
    life.close()  # the server could not write the headers, or the client left
    assert [(o.status, o.http_status) for o in gen.settled] == [(Status.CLIENT_CANCELLED, 499)]


def test_a_failure_before_the_head_is_raised_and_settled_once(monkeypatch):
    def body(gen):
        raise UpstreamRejected("too long")
        yield  # a generator
    gen, life = life_of(monkeypatch, body)
    with pytest.raises(UpstreamRejected):
        next(life)
    outcome, = gen.settled
    assert (outcome.status, outcome.http_status, outcome.code) == \
        (Status.REJECTED, 400, "upstream_rejected")


def test_a_failure_after_the_head_is_one_error_event(monkeypatch):
    gen, life = life_of(monkeypatch, head_then(b"a", fail=StreamFailed("oom")))
    next(life)
    assert next(life) == b"a"
    event = next(life)
    assert event.startswith(b'data: {"error"') and b"[DONE]" not in event
    assert list(life) == []
    outcome, = gen.settled
    assert (outcome.status, outcome.http_status, outcome.code) == \
        (Status.UPSTREAM_ERROR, 200, "upstream_error")


def test_closed_while_the_error_event_is_written_settles_once_as_the_error(monkeypatch):
    gen, life = life_of(monkeypatch, head_then(fail=StreamFailed("slow", kind="timeout")))
    next(life)
    assert b'"error"' in next(life)  # suspended at the yield inside `except`
    life.close()  # the write failed: GeneratorExit lands inside the except block
    assert [o.status for o in gen.settled] == [Status.TIMEOUT]


def test_client_gone_mid_stream_is_cancelled_not_an_error(monkeypatch):
    gen, life = life_of(monkeypatch, head_then(b"a", fail=ClientGone()))
    next(life)
    assert list(life) == [b"a"]
    assert [o.status for o in gen.settled] == [Status.CLIENT_CANCELLED]


def test_a_kiln_bug_mid_stream_is_an_error_event_and_settles_as_error(monkeypatch):
    gen, life = life_of(monkeypatch, head_then(fail=ZeroDivisionError()))
    next(life)
    assert b'"internal_error"' in next(life)
    assert list(life) == []
    assert [(o.status, o.http_status) for o in gen.settled] == [(Status.ERROR, 200)]


def test_a_failing_close_still_settles(monkeypatch):
    gen, life = life_of(monkeypatch, head_then(fail=UpstreamError("gone")),
                        StubGeneration(close_fails=True))
    next(life)
    with pytest.raises(OSError):
        list(life)
    assert [o.status for o in gen.settled] == [Status.UPSTREAM_ERROR]


def test_the_last_bytes_of_a_completion_go_out_after_its_settlement(monkeypatch):
    def body(gen):
        yield Head(200, "text/event-stream", {})
        yield b"a"
        return lambda charged: f"usage costs {charged}, [DONE]".encode()
    gen, life = life_of(monkeypatch, body)
    next(life)
    assert next(life) == b"a" and gen.settled == []
    assert next(life) == b"usage costs 0.5, [DONE]"  # the cost the settlement charged
    assert [o.status for o in gen.settled] == [Status.COMPLETED]
