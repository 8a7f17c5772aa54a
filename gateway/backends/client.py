"""The client's side of one generation's I/O: noticing the client leave while Kiln waits on the
backend (:class:`ClientWatch`), and hanging up on a client that stopped reading
(:func:`guard_writes`). README "Streaming" is the contract; :mod:`.relay` is the backend's side.

Both are event-loop watchers on the client's socket, not greenlets: a greenlet per open stream
costs its own stack and frame chunk, a watcher a few hundred bytes (bench/RESULTS.md, bursts).
"""
import select
import socket
import time

import gevent
from gevent.event import Event
from gevent.monkey import get_original

# Linux reports a peer's FIN as POLLRDHUP even while unread bytes (a pipelined next request)
# sit in the buffer, where a peek would only see those bytes. The unpatched poll, with timeout 0,
# never blocks the hub.
_RDHUP = getattr(select, "POLLRDHUP", 0)
_HANGUP = _RDHUP | select.POLLHUP | select.POLLERR
_real_poll = get_original("select", "poll")


class ClientGone(Exception):
    """The client closed its connection."""


class ClientWatch:
    """Notice the client leaving while Kiln waits on the backend, not only at the next write.

    Under gunicorn's gevent worker the client's socket is ``environ["gunicorn.socket"]``. The
    watcher's callbacks run in the hub, so they only look (a poll with timeout 0) and hand the
    callbacks of :meth:`on_gone`, which may block, to a greenlet of their own.
    """

    RECHECK_S = 0.25  # bytes of a pipelined next request: look again this much later

    def __init__(self, sock):
        self.gone = Event()
        self._on_gone = []
        self._sock = sock
        self._watcher = None
        if sock is not None:
            self._loop = gevent.get_hub().loop
            self._arm()

    def on_gone(self, callback):
        """Call ``callback()`` once the client is gone (at once if it already is)."""
        if self.gone.is_set():
            callback()
        else:
            self._on_gone.append(callback)

    def _arm(self):
        self._close_watcher()
        try:
            self._watcher = self._loop.io(self._sock.fileno(), 1)  # 1: readable
        except (OSError, ValueError):
            return self._left()  # the socket is already closed: the client is gone
        self._watcher.start(self._readable)

    def _readable(self):  # in the hub: must not block
        try:
            closed = _peer_closed(self._sock)
        except (OSError, ValueError):
            closed = True  # reset, or the socket is already closed
        if closed:
            self._close_watcher()
            self._left()
        else:
            self._close_watcher()
            self._watcher = self._loop.timer(self.RECHECK_S)
            self._watcher.start(self._arm)

    def _left(self):
        self.gone.set()
        if self._on_gone:
            gevent.spawn(self._call_back)

    def _call_back(self):
        for callback in self._on_gone:
            callback()

    def _close_watcher(self):
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher.close()
            self._watcher = None

    def stop(self):
        if self._sock is not None:
            self._close_watcher()


def guard_writes(body, sock, idle_s):
    """Yield the items of ``body`` (the response's generator); if the server has not asked for
    the next one within ``idle_s`` seconds, its write is stuck behind a client that stopped
    reading: hang up on the client. The server's write then fails, it closes ``body`` (which
    settles the generation, billing what was generated), and the backend, no longer read,
    stopped at the bounded queue meanwhile. The check is a repeating event-loop timer."""
    writing_since = []
    timer = None
    if sock is not None:
        period = min(1.0, idle_s / 4)
        timer = gevent.get_hub().loop.timer(period, period)
        timer.start(_hang_up_if_stuck, writing_since, sock, idle_s, timer)
    try:
        for item in body:
            writing_since.append(time.monotonic())
            yield item
            writing_since.clear()
    finally:
        if timer is not None:
            timer.stop()
            timer.close()
        body.close()


def _hang_up_if_stuck(writing_since, sock, idle_s, timer):  # in the hub: must not block
    if writing_since and time.monotonic() - writing_since[0] > idle_s:
        timer.stop()
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _peer_closed(sock):
    """Return whether the client closed its side (called once ``sock`` is readable)."""
    if _RDHUP:
        poller = _real_poll()
        poller.register(sock.fileno(), select.POLLIN | _HANGUP)
        return any(events & _HANGUP for _, events in poller.poll(0))
    return sock.recv(1, socket.MSG_PEEK) == b""
