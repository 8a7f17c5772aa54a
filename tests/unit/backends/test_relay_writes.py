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


# -- the bounded queue between the pump and the relay ------------------------------------------

def test_chunks_are_first_in_first_out_and_the_writer_waits_at_the_bound():
    import gevent
    from gateway.backends.relay import Chunks
    chunks = Chunks(2)
    written = []

    def writer():
        for i in range(5):
            chunks.put(i)
            written.append(i)
    g = gevent.spawn(writer)
    gevent.sleep(0.01)
    assert written == [0, 1]  # the third put waits for a read
    assert [chunks.get(timeout=1) for _ in range(5)] == [0, 1, 2, 3, 4]
    g.join(1)
    assert written == [0, 1, 2, 3, 4] and chunks.empty()


def test_a_chunks_reader_waits_for_a_put_and_times_out_on_silence():
    import time

    import gevent
    from gevent.queue import Empty

    from gateway.backends.relay import Chunks
    chunks = Chunks(8)
    gevent.spawn_later(0.05, chunks.put, b"late")
    assert chunks.get(timeout=2) == b"late"
    started = time.monotonic()
    with pytest.raises(Empty):
        chunks.get(timeout=0.05)
    assert time.monotonic() - started >= 0.04
    with pytest.raises(Empty):
        chunks.peek_nowait()
    chunks.put_nowait((EOF, None))
    assert chunks.peek_nowait() == (EOF, None) and chunks.get_nowait() == (EOF, None)


def test_the_relay_reads_a_real_pump_queue():
    from gateway.backends.relay import Chunks
    queue = Chunks(8)
    for item in ((DATA, b"data: a\n\n"), (DATA, b"data: b\n\n"), (EOF, None)):
        queue.put(item)
    writes, applied = relay(SimpleNamespace(queue=queue))
    assert writes == [b"<a><b>"] and applied == [[b"a", b"b"]]


def test_the_chunks_writer_waits_at_the_byte_bound_too():
    import gevent
    from gateway.backends.relay import Chunks
    chunks = Chunks(64, max_bytes=100)
    written = []

    def writer():
        for i in range(4):
            chunks.put(i, size=60)
            written.append(i)
    g = gevent.spawn(writer)
    gevent.sleep(0.01)
    assert written == [0, 1] and chunks.size == 120  # 120 >= 100: the third put waits
    assert chunks.get(timeout=1) == 0 and chunks.size == 60
    gevent.sleep(0.01)
    assert written == [0, 1, 2]  # 60 < 100 let one more in, 120 stops the next
    assert [chunks.get(timeout=1) for _ in range(3)] == [1, 2, 3]
    g.join(1)
    assert written == [0, 1, 2, 3] and chunks.size == 0
