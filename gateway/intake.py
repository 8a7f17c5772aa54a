"""Bounded work before admission: reading and parsing a request body.

Before a request is admitted, nothing it sends may take more of a worker than a short, bounded
share, so that one client's bad requests do not slow another org's good ones (README "Limits"):

- a body must arrive within ``KILN_BODY_TIMEOUT_S`` (else 408 and the connection is closed): a
  client trickling its body holds no connection beyond that;
- a large body is parsed off the event loop, in a small thread pool of its own (JSON parsing holds
  the GIL, but the interpreter switches threads every few milliseconds, so the worker's other
  requests keep moving instead of waiting for the whole parse);
- the bytes one worker reads and parses at once are capped (``KILN_PARSE_BUDGET_BYTES``): a large
  body takes its size from that budget before its first byte is read, and gets a fast 503 with
  ``Retry-After`` when it cannot within ``KILN_PARSE_WAIT_S``, instead of queueing memory.

Small bodies (the usual chat request) take no share of the budget and are parsed inline.
"""
import contextlib
import time

import gevent
from gevent.event import Event
from gevent.threadpool import ThreadPool

from .errors import GatewayError, ServiceUnavailable

# Below this, a body is read and parsed inline: a thread hand-off costs more than the parse.
INLINE_BYTES = 256 * 1024
PARSE_THREADS = 2
RETRY_AFTER_S = "1"


class BodyTimeout(GatewayError):
    """The body did not arrive in time: 408, and the connection is closed (RFC 9110, 15.5.9)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class ParseBudget:
    """The bytes of request bodies one worker reads and parses at once.

    :param capacity: bytes; a body larger than this takes the whole budget.
    :param wait_s: longest wait for a share before the request is told 503.
    """

    def __init__(self, capacity, wait_s):
        self.capacity = capacity
        self.free = capacity
        self.wait_s = wait_s
        self._released = Event()
        self._pool = None

    @contextlib.contextmanager
    def share(self, nbytes):
        """Hold ``nbytes`` of the budget (at most all of it) for the ``with`` block.

        :raises ServiceUnavailable: no share within ``wait_s`` (503, ``Retry-After``).
        """
        want = min(nbytes, self.capacity)
        self._acquire(want)
        try:
            yield
        finally:
            self.free += want
            self._released.set()

    def _acquire(self, want):
        deadline = time.monotonic() + self.wait_s
        while self.free < want:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServiceUnavailable(
                    "Kiln is busy reading other large request bodies; retry with backoff.",
                    code="server_busy", headers={"Retry-After": RETRY_AFTER_S})
            self._released.clear()
            self._released.wait(left)
        self.free -= want

    def run(self, func, *args):
        """Run ``func(*args)`` in the budget's own threads; return its result or raise its
        exception (the calling greenlet waits, the event loop does not)."""
        if self._pool is None:
            self._pool = ThreadPool(PARSE_THREADS)
        return self._pool.apply(func, args)


def read_body(read, timeout_s):
    """Return ``read()``, the request body, if it arrives within ``timeout_s``.

    :raises BodyTimeout: it did not (the connection is closed after the answer).
    """
    try:
        with gevent.Timeout(timeout_s):
            return read()
    except gevent.Timeout:
        raise BodyTimeout(f"The request body did not arrive within {timeout_s:g} s.",
                          headers={"Connection": "close"}) from None


def parse(budget, raw, parse_func, *args):
    """Parse ``raw`` with ``parse_func(raw, *args)``: inline when small, else in the budget's
    threads."""
    if len(raw) < INLINE_BYTES:
        return parse_func(raw, *args)
    return budget.run(parse_func, raw, *args)
