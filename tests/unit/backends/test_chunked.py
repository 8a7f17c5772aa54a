"""The chunked coding's framing stripped from bytes in any pieces (gateway/backends/chunked.py;
RFC 9112, section 7.1)."""
import linecache
import socket
import sys
import threading
import time
import tracemalloc
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.backends import chunked
from gateway.backends.chunked import ChunkedBody, ChunkedBodyError, Dechunker

datas = st.lists(st.binary(min_size=1, max_size=300), max_size=12)
extensions = st.sampled_from([b"", b";name=value", b'; q="a;b"', b" ;x"])
trailers = st.lists(st.sampled_from([b"X-Usage: 3\r\n", b"Expires: 0\r\n"]), max_size=2)


def encode(chunks, ext=b"", trailer=(), upper=False, newline=b"\r\n"):
    out = b""
    for data in chunks:
        size = b"%x" % len(data)
        out += (size.upper() if upper else size) + ext + newline + data + newline
    return out + b"0" + ext + newline + b"".join(trailer) + newline


def feed_in_pieces(body, cuts):
    d, out = Dechunker(), b""
    points = sorted({c % (len(body) + 1) for c in cuts} | {0, len(body)})
    for a, b in zip(points, points[1:], strict=False):
        out += d.feed(body[a:b])
    return d, out


@settings(max_examples=300, deadline=None)
@given(datas, extensions, trailers, st.booleans(), st.sampled_from([b"\r\n", b"\n"]),
       st.lists(st.integers(0, 10_000), max_size=30), st.binary(max_size=5))
def test_any_cut_of_any_chunked_body_gives_its_data(chunks, ext, trailer, upper, newline,
                                                    cuts, after):
    body = encode(chunks, ext, trailer, upper, newline)
    d, out = feed_in_pieces(body + after, cuts)
    assert out == b"".join(chunks)
    assert d.done and d.extra == after


def test_data_is_given_as_it_arrives_not_when_its_chunk_is_whole():
    d = Dechunker()
    assert d.feed(b"a\r\nhello") == b"hello"
    assert d.feed(b"wor") == b"wor"
    assert d.feed(b"ld\r\n3\r\nabc\r\n") == b"ldabc"
    assert not d.done
    assert d.feed(b"0\r\n\r\n") == b"" and d.done


@pytest.mark.parametrize("body", [
    b"zz\r\nab\r\n",              # not hex
    b"0x2\r\nab\r\n",             # a prefix int() would take
    b"-2\r\nab\r\n",
    b"\r\nab\r\n",                # no size
    b"2\r\nabX\r\n",              # the chunk's data runs past its size
    b"1" * 70_000,                # a size line without end
])
def test_malformed_framing_is_an_error(body):
    with pytest.raises(ChunkedBodyError):
        Dechunker().feed(body)


def test_a_quiet_backend_is_waited_for_without_a_read_sized_buffer():
    # 10,000 open streams wait on quiet backends at once: each wait must not hold a new object
    # of the read's size (64 KiB), as BufferedReader.read1 does on an empty buffer.
    ours, backend = socket.socketpair()
    fp = ours.makefile("rb")
    closed = []
    resp = SimpleNamespace(raw=SimpleNamespace(
        _original_response=SimpleNamespace(close=lambda: closed.append(True))))
    body, got = ChunkedBody(resp, fp, 65536), []
    backend.sendall(b"5\r\nhello\r\n")
    assert body.read() == b"hello"
    tracemalloc.start(5)
    try:
        def read_to_the_end():
            while not body.done:
                got.append(body.read())
        reader = threading.Thread(target=read_to_the_end)
        reader.start()
        deadline = time.monotonic() + 10
        while not _waiting_in_a_read(reader) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _waiting_in_a_read(reader)
        held = [t for t in tracemalloc.take_snapshot().traces
                if t.size >= 32768 and any(f.filename == chunked.__file__ for f in t.traceback)]
    finally:
        tracemalloc.stop()
    backend.sendall(b"5\r\nworld\r\n0\r\n\r\n")
    reader.join(10)
    ours.close(), backend.close()
    assert held == []
    assert [data for data in got if data] == [b"world"] and closed == [True]


def _waiting_in_a_read(thread):
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code is ChunkedBody.read.__code__:  # on the line of its read of the connection
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
            return "peek(" in line or "read1(" in line
        frame = frame.f_back
    return False
