"""Bounded work before admission: reading and parsing a request body.

Before a request is admitted, nothing it sends may take more of a worker than a short, bounded
share, so that one client's bad requests do not slow another org's good ones (README "Limits"):

- a body must arrive within ``KILN_BODY_TIMEOUT_S`` (else 408 and the connection is closed): a
  client trickling its body holds no connection beyond that;
- a large body is parsed off the event loop, in a thread of its own. JSON parsing holds the GIL;
  the interpreter hands it to a waiting thread after its switch interval, which is shortened
  while a parse runs, so the event loop (which gives the GIL up at every I/O wait and then has
  to take it back) loses at most a fraction of a millisecond per wait instead of 5 ms
  (Python's ``sys.setswitchinterval``; the "convoy effect", CPython issue 7946);
- the bytes one worker reads and parses at once are capped (``KILN_PARSE_BUDGET_BYTES``), and so
  is the share of its time spent parsing (:data:`PARSE_SHARE`): a large body takes its size
  from that budget before its first byte is read, then waits for its turn to be parsed, and
  gets a fast 503 with ``Retry-After`` when either takes longer than ``KILN_PARSE_WAIT_S``,
  instead of queueing memory or CPU.

Small bodies (the usual chat request) take no share of the budget and are parsed inline.
"""
import contextlib
import sys
import time

import gevent
from gevent.event import Event
from gevent.threadpool import ThreadPool

from .errors import GatewayError, ServiceUnavailable

# Below this, a body is read and parsed inline: a thread hand-off costs more than the parse.
INLINE_BYTES = 256 * 1024
PARSE_THREADS = 1  # parses take turns: more threads would only share the GIL with the loop
PARSE_SHARE = 0.25  # of a worker's time, at most, spent parsing large bodies
PARSE_SWITCH_INTERVAL_S = 0.0002
RETRY_AFTER_S = "1"


class BodyTimeout(GatewayError):
    """The body did not arrive in time: 408 (RFC 9110, 15.5.9). gunicorn then reads what is
    left of the body for at most its keepalive (5 s) and closes the connection."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class ParseBudget:
    """The bytes of request bodies one worker reads and parses at once, and its parse time.

    Large bodies are parsed one at a time, and parsing takes at most :data:`PARSE_SHARE` of the
    worker's time: after a parse of ``t`` seconds the next one waits ``t / PARSE_SHARE - t``.
    A client sending large bodies without pause therefore gets at most that share of a worker's
    CPU, and the rest of its bodies a fast 503, however many it sends.

    :param capacity: bytes; a body larger than this takes the whole budget.
    :param wait_s: longest wait for a share, or a turn to parse, before the request is told 503.
    """

    def __init__(self, capacity, wait_s):
        self.capacity = capacity
        self.free = capacity
        self.wait_s = wait_s
        self._changed = Event()
        self._pool = None
        self._parsing = False
        self._next_parse_at = 0.0
        self._interval = sys.getswitchinterval()

    @contextlib.contextmanager
    def share(self, nbytes):
        """Hold ``nbytes`` of the budget (at most all of it) for the ``with`` block.

        :raises ServiceUnavailable: no share within ``wait_s`` (503, ``Retry-After``).
        """
        want = min(nbytes, self.capacity)
        self._wait_until(lambda: self.free >= want)
        self.free -= want
        try:
            yield
        finally:
            self.free += want
            self._changed.set()

    def _wait_until(self, ready):
        deadline = time.monotonic() + self.wait_s
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServiceUnavailable(
                    "Kiln is busy reading other large request bodies; retry with backoff.",
                    code="server_busy", headers={"Retry-After": RETRY_AFTER_S})
            self._changed.clear()
            self._changed.wait(min(left, max(0.001, self._next_parse_at - time.monotonic())))

    def run(self, func, *args):
        """Run ``func(*args)`` in the budget's own thread when it is this call's turn; return
        its result or raise its exception (the calling greenlet waits, the event loop does not).

        :raises ServiceUnavailable: no turn within ``wait_s``.
        """
        self._wait_until(lambda: not self._parsing and time.monotonic() >= self._next_parse_at)
        if self._pool is None:
            self._pool = ThreadPool(PARSE_THREADS)
        self._parsing, started = True, time.monotonic()
        sys.setswitchinterval(PARSE_SWITCH_INTERVAL_S)
        try:
            return self._pool.apply(func, args)
        finally:
            sys.setswitchinterval(self._interval)
            took = time.monotonic() - started
            self._parsing, self._next_parse_at = False, started + took / PARSE_SHARE
            self._changed.set()


def read_body(read, timeout_s):
    """Return ``read()``, the request body, if it arrives within ``timeout_s``.

    :raises BodyTimeout: it did not.
    """
    try:
        with gevent.Timeout(timeout_s):
            return read()
    except gevent.Timeout:
        raise BodyTimeout(f"The request body did not arrive within {timeout_s:g} s.") from None


def parse(budget, raw, parse_func, *args):
    """Parse ``raw`` with ``parse_func(raw, *args)``: inline when small, else in the budget's
    threads."""
    if len(raw) < INLINE_BYTES:
        return parse_func(raw, *args)
    return budget.run(parse_func, raw, *args)
