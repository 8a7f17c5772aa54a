"""The stream relay's writes (gateway/backends/relay.py, ``relay_stream``): what the backend
has sent by the time the relay runs goes to the client in one write, in order, and the
stream's end still ends it."""
from types import SimpleNamespace

import pytest
from gevent.queue import Queue

from gateway.backends.relay import DATA, EOF, FAILED, StreamFailed, relay_stream

pytestmark = pytest.mark.unit


def pump_with(*items):
    queue = Queue()
    for item in items:
        queue.put(item)
    return SimpleNamespace(queue=queue)


def relay(pump):
    applied = []

    def apply(payloads):
        applied.append(list(payloads))
        return b"".join(b"<" + p + b">" for p in payloads), False
    out = list(relay_stream(pump, apply, lambda: None, 10, 10, 1 << 20))
    return out, applied


def test_reads_queued_together_are_relayed_in_one_write():
    pump = pump_with((DATA, b"data: a\n\n"), (DATA, b"data: b\n\ndata: "), (DATA, b"c\n\n"),
                     (EOF, None))
    writes, applied = relay(pump)
    assert writes == [b"<a><b><c>"]
    assert applied == [[b"a", b"b", b"c"]]


def test_a_failure_queued_behind_data_comes_after_that_data_is_written():
    failure = StreamFailed("gone")
    pump = pump_with((DATA, b"data: a\n\n"), (FAILED, failure))
    out = []
    with pytest.raises(StreamFailed):
        for item in relay_stream(pump, lambda p: (b"".join(p), False), lambda: None, 10, 10,
                                 1 << 20):
            out.append(item)
    assert out == [b"a"]


def test_events_before_one_over_the_limit_are_relayed_before_the_stream_fails():
    pump = pump_with((DATA, b"data: a\n\n"), (DATA, b"data: " + b"y" * 100))
    out = []
    with pytest.raises(StreamFailed) as failed:
        for item in relay_stream(pump, lambda p: (b"".join(p), False), lambda: None, 10, 10,
                                 50):
            out.append(item)
    assert out == [b"a"] and failed.value.kind == "too_large"
