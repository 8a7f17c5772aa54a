"""The relay reading a chunked stream in its own greenlet (gateway/backends/reader.py,
``StreamReader``): its keepalive's wait leaves the stream whole, a stop from another greenlet
wakes it and returns only once it is out of the read, and the body's end and a broken body
are told as the relay expects. Real sockets, gevent's own (a socketpair)."""
from types import SimpleNamespace

import gevent
import pytest
from gevent import socket
from gevent.queue import Empty

from gateway.backends.chunked import ChunkedBody
from gateway.backends.client import ClientGone
from gateway.backends.reader import StreamReader
from gateway.backends.relay import DATA, EOF, FAILED, StreamFailed


class _Call:
    def __init__(self):
        self.read = "unset"

    def read_with(self, read):
        self.read = read


@pytest.fixture
def stream():
    ours, backend = socket.socketpair()
    fp = ours.makefile("rb")
    closed = []
    resp = SimpleNamespace(raw=SimpleNamespace(
        _original_response=SimpleNamespace(close=lambda: closed.append(True))))
    call = _Call()
    reader = StreamReader(call, ChunkedBody(resp, fp, 65536), idle_s=30)
    yield SimpleNamespace(reader=reader, backend=backend, fp=fp, closed=closed, call=call)
    fp.close(), ours.close(), backend.close()


def test_the_calls_greenlet_is_let_go(stream):
    assert stream.call.read is None  # the call's greenlet ends: the relay reads the body


def test_a_quiet_wait_times_out_and_the_stream_goes_on_whole(stream):
    with pytest.raises(Empty):
        stream.reader.get(timeout=0.05)
    stream.backend.sendall(b"5\r\nhel")
    assert stream.reader.get(timeout=5) == (DATA, b"hel")
    with pytest.raises(Empty):
        stream.reader.get(timeout=0.05)  # a timeout inside a chunk loses nothing either
    stream.backend.sendall(b"lo\r\n6\r\n world\r\n0\r\n\r\n")
    assert stream.reader.get(timeout=5) == (DATA, b"lo world")
    assert stream.reader.get(timeout=5) == (EOF, None)
    assert stream.reader.complete and stream.closed == [True]
    assert stream.reader.get(timeout=5) == (EOF, None)  # the end stays the end


def test_a_stop_from_another_greenlet_wakes_the_read_with_its_reason(stream):
    got = gevent.spawn(stream.reader.get, 30)
    gevent.sleep(0.05)
    assert not got.ready()  # waiting in the socket's read
    stream.reader.stop(reason=ClientGone())
    assert stream.reader._reader is None  # out of the read when stop returns
    stream.fp.close()  # so closing the response now does not fail inside a read
    kind, err = got.get(timeout=5)
    assert kind is FAILED and isinstance(err, ClientGone)
    assert not stream.reader.complete


def test_a_stop_before_the_next_read_is_its_answer(stream):
    stream.backend.sendall(b"2\r\nab\r\n")
    assert stream.reader.get(timeout=5) == (DATA, b"ab")
    stream.reader.stop(reason=ClientGone())  # from the relay's own greenlet: nothing waits
    kind, err = stream.reader.get(timeout=5)
    assert kind is FAILED and isinstance(err, ClientGone)


def test_a_body_broken_before_its_last_chunk_fails_the_stream(stream):
    stream.backend.sendall(b"2\r\nab\r\n")
    stream.backend.close()
    assert stream.reader.get(timeout=5) == (DATA, b"ab")
    kind, err = stream.reader.get(timeout=5)
    assert kind is FAILED and isinstance(err, StreamFailed) and err.kind == "upstream_error"
    assert not stream.reader.complete and stream.closed == []


def test_the_sockets_own_timeout_is_the_idle_timeout(stream):
    stream.fp.raw._sock.settimeout(0.05)
    kind, err = stream.reader.get(timeout=5)
    assert kind is FAILED and err.kind == "timeout" and "idle timeout" in str(err)


def test_nothing_is_queued_behind_a_read(stream):
    with pytest.raises(Empty):
        stream.reader.peek_nowait()
    assert stream.reader.queue is stream.reader  # the relay's queue is the reader itself


def test_what_has_arrived_past_the_readers_buffer_is_one_item(stream):
    piece = b"x" * 6000
    stream.backend.sendall(b"".join(b"1770\r\n" + piece + b"\r\n" for _ in range(3)))
    gevent.sleep(0.05)  # all of it in the socket: more than the reader's 8 KiB buffer
    assert stream.reader.get(timeout=5) == (DATA, piece * 3)


def test_a_read_of_framing_alone_still_waits_with_the_keepalives_timer(stream):
    stream.backend.sendall(b"5\r\nhello\r\n")
    assert stream.reader.get(timeout=5) == (DATA, b"hello")
    stream.backend.sendall(b"5\r\n")  # the next chunk's size line, then nothing for a while
    gevent.sleep(0.05)
    with gevent.Timeout(5, AssertionError("the read waited without its timer")):
        with pytest.raises(Empty):
            stream.reader.get(timeout=0.05)
    stream.backend.sendall(b"world\r\n")
    assert stream.reader.get(timeout=5) == (DATA, b"world")
