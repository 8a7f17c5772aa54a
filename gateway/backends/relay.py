"""The backend's side of one generation's I/O: the upstream call, the pump that reads a stream
that is not plainly chunked (a chunked one is read by the relay itself: :mod:`.reader`), and
the stream relay. Nothing here knows about money;
the flow (:mod:`gateway.flow.generation`) passes callbacks.

README "Streaming" is the contract: events relayed as bytes arrive, ``: keepalive`` comments
while the backend is silent, the backend's request closed when the client leaves (so the model
stops; :mod:`.client` notices), and the backend read no faster than the client reads (the
relay reads only between its writes, or a bounded queue between a pump and it).
"""
import time

import gevent
from gevent.event import AsyncResult, Event
from gevent.queue import Empty
from urllib3.exceptions import ReadTimeoutError

from . import upstream
from .client import ClientGone
from .sse import KEEPALIVE, EventSplitter, EventTooLarge

READ_SIZE = 65536
# Reads buffered between backend and client: back-pressure past either bound. A client that
# keeps up takes what has queued in one write (:func:`_with_queued`), so the count bounds the
# writes saved; the bytes bound what a stream holds for a client that does not keep up.
QUEUE_CHUNKS = 64
QUEUE_BYTES = 65536
DATA, EOF, FAILED = "data", "eof", "failed"


class StreamFailed(Exception):
    """The backend failed after the stream began.

    :param kind: ``"upstream_error"``, ``"timeout"`` or ``"too_large"``.
    """

    def __init__(self, message, kind="upstream_error"):
        super().__init__(message)
        self.kind = kind


class UpstreamCall:
    """One request to a backend, sent from its own greenlet and abortable from any other. A
    chunked stream's body is then read by the relay itself (:class:`.reader.StreamReader`) and
    this greenlet ends; any other body is read in it (:class:`Pump`). Each greenlet costs its own
    stack and frames (bench/RESULTS.md, bursts).

    :param open_response: ``() -> response``: sends the request (retrying on other backends,
        :meth:`gateway.backends.fleet.Route.open`) and returns the 2xx response once its status
        is in.
    """

    def __init__(self, open_response):
        self.response = None
        self.sent_at = time.monotonic()
        self._aborted = False
        self._answer = AsyncResult()
        self._taken = Event()
        self._read = None  # what reads the body, from the greenlet that sent the request
        self.greenlet = gevent.spawn(self._send, open_response)

    def _send(self, open_response):
        try:
            resp = open_response()
        except BaseException as err:
            self._answer.set_exception(err)
            if not isinstance(err, Exception):
                raise  # killed (GreenletExit): the greenlet ends as killed
            return
        self.response = resp
        self._answer.set(resp)
        if self._aborted:
            upstream.shutdown(resp)  # the abort came while the status line was on its way
            return
        self._taken.wait()  # until the flow takes the answer (or closes the call: a kill)
        if self._read is not None:
            self._read(resp)

    def read_with(self, read):
        """Read the answer's body with ``read(response)`` in the call's greenlet (once); None:
        the caller reads it, and the call's greenlet ends."""
        self._read = read
        self._taken.set()

    @property
    def answered(self):
        """The backend answered (a 2xx response), or the call failed."""
        return self._answer.ready()

    def result(self):
        """Return the 2xx response; raise the gateway error the call ended with."""
        return self._answer.get()

    def wait(self, timeout_s, gone):
        """Wait up to ``timeout_s`` for the answer; raise :class:`ClientGone` if ``gone`` is
        set first. Return whether the backend answered."""
        gevent.wait([self._answer, gone], count=1, timeout=timeout_s)
        if gone.is_set():
            raise ClientGone()
        return self.answered

    def abort(self):
        """Close the backend request at once (the model server stops generating). Safe to call
        twice and from any greenlet but the caller's own reads."""
        self.close(complete=False)

    def close(self, complete):
        """End the call: a reply read ``complete``-ly gives its connection back to the pool;
        any other is aborted."""
        if self._aborted:
            return
        self._aborted = True
        if not self.greenlet.ready():
            # Blocking kill: closing a response while a greenlet is inside its buffered read
            # fails ("reentrant call") and would leave the connection open.
            self.greenlet.kill()
        if self.response is not None:
            upstream.close(self.response) if complete else upstream.shutdown(self.response)


def keepalives_until_answered(call, gone, keepalive_s, keepalive=KEEPALIVE):
    """Yield ``keepalive`` (the dialect's bytes; ``: keepalive`` comments by default) until the
    backend has answered (or failed).

    :raises ClientGone: the client left first.
    """
    while not call.wait(keepalive_s, gone):
        yield keepalive


class Chunks:
    """The bounded queue between a :class:`Pump` (the one writer) and the relay (the one
    reader): a list and two events, about 420 bytes, where gevent's ``Queue`` takes 2.6 KiB
    (three deques); one is held per open stream (bench/RESULTS.md, bursts). The methods are
    those of ``gevent.queue.Queue`` the relay uses, with its :class:`~gevent.queue.Empty`.

    :param maxsize: items queued at most.
    :param max_bytes: sizes (as given to :meth:`put`) queued at most, or None: a put waits
        while the queue holds this much, so it holds at most this plus one item.
    """

    __slots__ = ("maxsize", "max_bytes", "size", "_items", "_readable", "_writable")

    def __init__(self, maxsize, max_bytes=None):
        self.maxsize, self.max_bytes = maxsize, max_bytes
        self.size = 0  # the sizes of the items queued
        self._items = []  # (item, size)
        self._readable, self._writable = Event(), Event()

    def put(self, item, size=0):
        """Append ``item`` of ``size`` (bytes, say), first waiting while ``maxsize`` items or
        ``max_bytes`` are queued."""
        max_bytes = self.max_bytes
        while len(self._items) >= self.maxsize or (max_bytes is not None
                                                   and self.size >= max_bytes):
            self._writable.clear()
            self._writable.wait()
        self.put_nowait(item, size)

    def put_nowait(self, item, size=0):
        """Append ``item`` whatever the bounds (the relay's last word: a failure, the end)."""
        self._items.append((item, size))
        self.size += size
        self._readable.set()

    def get(self, timeout=None):
        """Take the oldest item, waiting up to ``timeout`` seconds; raise ``Empty`` after."""
        if not self._items:
            self._readable.clear()
            self._readable.wait(timeout)
        return self.get_nowait()

    def get_nowait(self):
        if not self._items:
            raise Empty()
        item, size = self._items.pop(0)
        self.size -= size
        self._writable.set()
        return item

    def peek_nowait(self):
        if not self._items:
            raise Empty()
        return self._items[0][0]

    def empty(self):
        return not self._items


class Pump:
    """Reads a backend's body that is not plainly chunked (a length, or a content coding) into
    a bounded queue, decoded, in the greenlet of the :class:`UpstreamCall` that sent the
    request (a plainly chunked one, the usual stream, is read by :class:`.reader.StreamReader`).

    When the queue is full the pump waits, so a client that stops reading stops Kiln reading the
    backend: TCP back-pressure reaches the model server instead of memory growing here.
    """

    def __init__(self, call, idle_s):
        self.idle_s = idle_s  # what the socket's read timeout is, for the message
        self.queue = Chunks(QUEUE_CHUNKS, QUEUE_BYTES)
        self.complete = False  # the body was read to its end
        self._greenlet = call.greenlet
        call.read_with(self._run)

    def _run(self, resp):
        queue = self.queue
        try:
            for data in _reads(resp.raw):
                queue.put((DATA, data), len(data))
            self.complete = True
            queue.put((EOF, None))
        except (ReadTimeoutError, TimeoutError):
            self.queue.put((FAILED, StreamFailed(f"The model backend sent nothing for "
                                                 f"{self.idle_s:g} s (idle timeout).",
                                                 kind="timeout")))
        except Exception as err:  # noqa: BLE001 - any read failure ends the stream as an error
            self.queue.put((FAILED, StreamFailed(f"The model backend connection failed: "
                                                 f"{type(err).__name__}.")))

    def stop(self, reason=None):
        """Stop reading; with ``reason`` (an exception), hand it to the relay in place of
        whatever was queued, so that it wakes at once."""
        self._greenlet.kill()
        if reason is not None:
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queue.put_nowait((FAILED, reason))


def _reads(raw):
    """urllib3's reads of a body, decoded, each what has arrived (up to :data:`READ_SIZE`)."""
    while data := raw.read1(READ_SIZE, decode_content=True):
        yield data


def _with_queued(queue, data):
    """``data`` and the reads queued behind it, joined: what the backend has sent by now goes
    to the client in one write, not one per read (a read holds one HTTP chunk of the backend's
    body, often one event: per-event writes cost a send and a pass through the server's write
    path each, bench/RESULTS.md). Stops at the stream's end or failure, left queued."""
    parts = None
    while True:
        try:
            kind, more = queue.peek_nowait()
        except Empty:
            break
        if kind is not DATA:
            break
        queue.get_nowait()
        if parts is None:
            parts = [data]
        parts.append(more)
    return data if parts is None else b"".join(parts)


def relay_stream(pump, apply, tick, keepalive_s, idle_s, max_event_bytes, keepalive=KEEPALIVE):
    """Yield the client's bytes for a backend's event stream until it ends.

    :param apply: ``list of data payloads -> (bytes to send, stop)``; ``stop`` ends the relay
        after those bytes (the generation reached its budget); raising ends the stream.
    :param tick: ``() -> None`` called between reads (may raise to stop the relay).
    :param keepalive_s: seconds of silence before ``keepalive`` (bytes; a ``: keepalive``
        comment by default).
    :param idle_s: seconds of backend silence after which the stream fails as a timeout.
    :returns: the bytes of an unfinished event when the backend closed the stream (empty
        when it ended cleanly or the relay stopped).
    :raises StreamFailed: read failure, idle timeout, or an event over ``max_event_bytes``.
    """
    splitter = EventSplitter(max_event_bytes)
    now = time.monotonic()
    last_data, next_keepalive = now, now + keepalive_s
    while True:
        tick()
        wait_s = max(0.0, min(next_keepalive, last_data + idle_s) - time.monotonic())
        try:
            kind, data = pump.queue.get(timeout=wait_s)
            tick()
        except Empty:
            now = time.monotonic()
            if now >= last_data + idle_s:
                raise StreamFailed(f"The model backend sent nothing for {idle_s:g} s (idle "
                                   f"timeout).", kind="timeout") from None
            if now >= next_keepalive:
                yield keepalive
                next_keepalive = time.monotonic() + keepalive_s
            continue
        if kind is EOF:
            return splitter.pending
        if kind is FAILED:
            raise data
        last_data = time.monotonic()
        try:
            out, stop = apply(splitter.feed(_with_queued(pump.queue, data)))
        except EventTooLarge as err:
            if err.events:  # the whole events before it are relayed (and billed) first
                out, _ = apply(err.events)
                if out:
                    yield out
            raise StreamFailed(str(err), kind="too_large") from err
        if out:
            yield out
            next_keepalive = time.monotonic() + keepalive_s
        if stop:
            return b""
