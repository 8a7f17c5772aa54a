"""What reads a backend's chunked stream: the relay itself, in the request's own greenlet
(:class:`StreamReader`), so that an open stream holds one greenlet, not two (bench/RESULTS.md,
bursts). Any other body is read by :class:`gateway.backends.relay.Pump` in the call's greenlet.
"""
import select

import gevent
from gevent import Timeout
from gevent.event import Event
from gevent.monkey import get_original
from gevent.queue import Empty
from urllib3.exceptions import ReadTimeoutError

from .relay import DATA, EOF, FAILED, READ_SIZE, StreamFailed

_real_poll = get_original("select", "poll")  # with timeout 0 it never blocks the hub


class _Quiet(BaseException):
    """Raised into the relay's read when the wait it was given ends (the keepalive's turn)."""


class _Woken(BaseException):
    """Raised into the relay's read by :meth:`StreamReader.stop` from another greenlet."""


class StreamReader:
    """Reads a backend's chunked stream in the relay's own greenlet (the request's): one
    greenlet per open stream, where a :class:`~gateway.backends.relay.Pump` adds the call's
    (bench/RESULTS.md, bursts). The backend is read only when the relay asks, so it is read no
    faster than the client takes what was sent (README "Streaming": TCP back-pressure reaches
    the model server).

    It is the relay's queue (:func:`~gateway.backends.relay.relay_stream` reads
    ``reader.queue``): :meth:`get` waits up
    to a timeout and returns everything that has arrived, and nothing is ever queued behind
    it. Its wait is the socket's own: the keepalive's timeout is raised into it, and so is a
    :meth:`stop` from another greenlet (the client left, the gateway shuts down), which
    returns only once the relay is out of the read (a response closed under a read fails).

    :param call: the :class:`~gateway.backends.relay.UpstreamCall`, whose greenlet ends at
        once.
    :param body: the response's :class:`~gateway.backends.chunked.ChunkedBody`.
    :param idle_s: the socket's read timeout (for the message).
    """

    __slots__ = ("queue", "idle_s", "complete", "_body", "_fd", "_end", "_reason", "_reader",
                 "_left")

    def __init__(self, call, body, idle_s):
        self.queue = self
        self.idle_s = idle_s
        self.complete = False  # the body was read to its end
        self._body = body
        self._fd = body.fileno()
        self._end = None      # the last item, once the stream has ended or failed
        self._reason = None   # what stop() handed in
        self._reader = None   # the greenlet inside a read, while it is
        self._left = None     # set when that greenlet leaves the read (stop() waits for it)
        call.read_with(None)

    def get(self, timeout=None):
        """Return ``(DATA, bytes)`` as soon as the backend has sent some (what has arrived, up
        to :data:`READ_SIZE`: one write to the client for all of it, as a pump's queue gives),
        ``(EOF, None)`` at the body's end or ``(FAILED, error)``; raise
        :class:`~gevent.queue.Empty` after ``timeout`` seconds of silence."""
        if self._reason is not None:
            self._end, self._reason = (FAILED, self._reason), None
        if self._end is not None:
            return self._end
        body, fd = self._body, self._fd
        timer = None
        self._reader = gevent.getcurrent()
        try:
            while True:
                if timer is None and not _readable(fd):  # a wait: the keepalive's timer
                    timer = Timeout(timeout, _Quiet)  # (a fast backend is read without one)
                    timer.start()
                data = body.read()
                if data or body.done:  # else that read held only framing: read on
                    break
        except _Quiet:
            raise Empty() from None
        except _Woken:
            self._end = (FAILED, self._reason or StreamFailed("The stream was stopped."))
            return self._end
        except Exception as err:  # noqa: BLE001 - any read failure ends the stream as an error
            self._end = self._failed(err)
            return self._end
        finally:
            if timer is not None:
                timer.close()
            self._reader = None
            if self._left is not None:
                self._left.set()
        if not data:
            self.complete = True
            self._end = (EOF, None)
            return self._end
        size = len(data)
        if size < READ_SIZE and not body.done and _readable(fd):
            parts = [data]
            while size < READ_SIZE and not body.done and _readable(fd):
                try:
                    more = body.read()  # readable: one read that does not wait
                except Exception as err:  # noqa: BLE001 - told after what came before it
                    self._end = self._failed(err)
                    break
                parts.append(more)
                size += len(more)
            data = b"".join(parts)
        return DATA, data

    def _failed(self, err):
        if isinstance(err, (ReadTimeoutError, TimeoutError)):
            return FAILED, StreamFailed(f"The model backend sent nothing for {self.idle_s:g} s "
                                        f"(idle timeout).", kind="timeout")
        return FAILED, self._reason or StreamFailed(
            f"The model backend connection failed: {type(err).__name__}.")

    def peek_nowait(self):
        raise Empty()  # a get takes all that has arrived: nothing waits behind it

    def stop(self, reason=None):
        """Stop reading; with ``reason`` (an exception), the relay's next :meth:`get` returns
        it. A relay waiting in a read is woken and out of it when this returns."""
        if reason is not None and self._end is None:
            self._reason = reason
        reader = self._reader
        if reader is None or reader is gevent.getcurrent():
            return
        if self._left is None:
            self._left = Event()
        hub = gevent.get_hub()
        hub.loop.run_callback(self._wake)
        if gevent.getcurrent() is not hub:
            self._left.wait()

    def _wake(self):  # in the hub: raise into the read only if the relay is still in it
        if self._reader is not None:
            self._reader.throw(_Woken)


def _readable(fd):
    """Whether the socket ``fd`` has bytes (or its end) to read now."""
    poller = _real_poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))
