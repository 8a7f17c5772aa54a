"""Streams read by hand, for the streaming tests through the real gateway: a raw-socket HTTP/1.1
client that keeps every byte's arrival time, the relayed events, and the books of an org after
its streams (balance = grants - costs, no hold, no lease).
"""
import json
import socket
import threading
import time
from urllib.parse import urlsplit

import sqlalchemy as sa

from factories import MESSAGES
from fake_upstream import Gate, Send, Status, chat_chunk, sse
from gateway_proc import balance_nanos

GRANT = 10 * 10**9
SSE_HEAD = {"Content-Type": "text/event-stream"}


class RawStream:
    """One HTTP/1.1 POST on a raw socket; the response is read by hand, chunked framing decoded,
    and the arrival time of every received byte of the body kept (``time.monotonic()``).

    Sockets still open at the end of a test are closed by :func:`close_raw_streams` (an idle
    keep-alive connection would hold up the gateway's graceful shutdown).
    """

    opened = []

    def __init__(self, base_url, key, body, path="/v1/chat/completions", timeout_s=30):
        url = urlsplit(base_url)
        self.sock = socket.create_connection((url.hostname, url.port), timeout=timeout_s)
        self.opened.append(self.sock)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = json.dumps(body).encode()
        self.sock.sendall(
            (f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {key}\r\n"
             f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
            .encode() + payload)
        self.status, self.headers, self.head_at = None, {}, None
        self.body, self.marks = b"", []  # marks: (arrival time, len(body) after that read)
        self.ended = self.eof = False  # chunked terminator seen / connection closed
        self._raw = b""

    def _read(self, deadline):
        self.sock.settimeout(max(0.01, deadline - time.monotonic()))
        data = self.sock.recv(65536)
        now = time.monotonic()
        self.eof = not data
        self._raw += data
        if self.status is None:
            self._parse_head(now)
        if self.status is not None:
            self._parse_body()
        self.marks.append((now, len(self.body)))

    def _parse_head(self, now):
        end = self._raw.find(b"\r\n\r\n")
        if end >= 0:
            lines = self._raw[:end].decode("latin-1").split("\r\n")
            self._raw = self._raw[end + 4:]
            self.status = int(lines[0].split()[1])
            self.headers = {k.strip().lower(): v.strip()
                            for k, _, v in (line.partition(":") for line in lines[1:])}
            self.head_at = now

    def _parse_body(self):
        if self.headers.get("transfer-encoding") != "chunked":
            self.body, self._raw = self.body + self._raw, b""
            return
        while not self.ended and (line_end := self._raw.find(b"\r\n")) >= 0:
            size = int(self._raw[:line_end].split(b";")[0], 16)
            if size == 0:
                self.ended = True
            elif len(self._raw) >= line_end + size + 4:
                self.body += self._raw[line_end + 2:line_end + 2 + size]
                self._raw = self._raw[line_end + size + 4:]
            else:
                return

    def read_until(self, predicate, timeout_s=15):
        """Read until ``predicate(self)``; raise AssertionError on timeout or early close."""
        deadline = time.monotonic() + timeout_s
        while not predicate(self):
            if self.eof or self.ended or time.monotonic() > deadline:
                raise AssertionError(f"stream ended or timed out; got {self.body!r}")
            try:
                self._read(deadline)
            except TimeoutError:
                pass
        return self

    def read_head(self, timeout_s=15):
        return self.read_until(lambda s: s.status is not None, timeout_s)

    def read_all(self, timeout_s=30):
        deadline = time.monotonic() + timeout_s
        while not (self.ended or self.eof) and time.monotonic() < deadline:
            try:
                self._read(deadline)
            except TimeoutError:
                pass
        assert self.ended or self.eof, f"stream still open after {timeout_s}s: {self.body!r}"
        return self

    def arrival(self, offset):
        """Return when the body reached ``offset`` bytes."""
        return next(t for t, length in self.marks if length >= offset)

    def close(self):
        """Hang up; return the monotonic time just before the socket closed (the fake upstream's
        thread may record the model connection's close before this thread runs again)."""
        closing_at = time.monotonic()
        self.sock.close()
        return closing_at

    @property
    def gid(self):
        return self.headers["x-neocloud-generation-id"]


def close_raw_streams():
    while RawStream.opened:
        RawStream.opened.pop().close()


def events(body):
    """Split a relayed body into its events (bytes, without the blank line)."""
    return [e for e in body.split(b"\n\n") if e]


def data_events(body):
    return [e for e in events(body) if e.startswith(b"data: ")]


def org_events(engine, org_id):
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.text(
            "SELECT * FROM usage_events WHERE org_id = :o ORDER BY started_at"), {"o": org_id})
            .mappings()]


def assert_books_balance(engine, org_id):
    """Invariant at a quiet moment: balance = grants - sum of costs, no hold, no lease."""
    costs = sum(e["cost_nanos"] for e in org_events(engine, org_id))
    assert balance_nanos(engine, org_id) == (GRANT - costs, 0, 0)


def stream_body(**extra):
    return {"model": "fake-model", "messages": MESSAGES, "stream": True, **extra}


def relay_event_by_event(base_url, fake, org, count=8, one_chunk=False):
    """Stream ``count`` content events from a backend that sends each one only after the
    client has received the one before (a ``Gate`` per event): a relay that held an event back
    until more bytes came, or until the end, makes the client wait for an event that never
    comes, and fails here. Event-driven, so a loaded machine cannot make it flake.

    :param one_chunk: the events are all pieces of one HTTP chunk (its size line first, its
        terminator last): a reader that returned a chunk only once all of it had arrived would
        hold the first event back.
    :returns: the :class:`RawStream`, read to its end.
    """
    gates = [threading.Event() for _ in range(count)]
    status, *frames = sse([chat_chunk(f"tok{k}") for k in range(count)]
                          + [chat_chunk(finish_reason="stop")])
    if one_chunk:
        size = sum(len(f.data) for f in frames)
        status = Status(status.code, {**status.headers, "Transfer-Encoding": "chunked"},
                        chunked=False)  # framed here: one chunk, sent in pieces
        frames = [Send(b"%x\r\n" % size + frames[0].data), *frames[1:-1],
                  Send(frames[-1].data + b"\r\n0\r\n\r\n")]
    script = [status]
    for k, gate in enumerate(gates):
        script += [frames[k], Gate(gate)]
    fake.enqueue(script + frames[count:])
    raw = RawStream(base_url, org.key, stream_body()).read_head()
    for k, gate in enumerate(gates):
        raw.read_until(lambda s, k=k: len(data_events(s.body)) == k + 1)
        assert b'"tok%d"' % k in raw.body
        gate.set()
    return raw.read_all()
