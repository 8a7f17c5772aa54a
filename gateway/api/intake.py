"""Bounded work before admission: reading and parsing a request body.

Before a request is admitted, nothing it sends may take more of a worker than a short, bounded
share, so that one client's bad requests do not slow another org's good ones (bench/isolation.py
measures it):

- a body must arrive within ``KILN_BODY_TIMEOUT_S`` (else 408, and gunicorn closes the
  connection unless the rest arrives within its keepalive): a client trickling its body holds
  no connection much beyond that;
- a body is read in slices, the worker's other requests served in between, and a large one
  is parsed and checked against the contract in the worker's child process
  (:mod:`gateway.api.body_process`): parsing holds the interpreter throughout, so a body the
  contract refuses never becomes Python objects in the worker;
- the bytes of large bodies one worker holds at once and takes in per second are capped
  (``KILN_PARSE_BUDGET_BYTES``), and so is the share of time its children spend parsing one
  org's bodies (:data:`PARSE_SHARE`, of one core): a large body takes its size from that
  budget before its first byte is read, then waits for its turn to be parsed, and gets a fast
  503 with ``Retry-After`` (its connection closed, the rest of it unread) when either takes
  longer than ``KILN_PARSE_WAIT_S``, instead of queueing memory or CPU;
- the budget is shared fairly between orgs (:class:`ParseBudget`): one org holds at most half
  of it (less when more orgs want some), parses one body at a time, and its pause after a
  parse is its own, so one org's flood of large bodies does not make another org's 503s.

Small bodies (the usual chat request) take no share of the budget and are parsed inline.
"""
import collections
import socket
import time

import gevent
from gevent.event import Event

from ..errors import GatewayError, ServiceUnavailable

# Below this, a body is parsed inline: the hand-off to the child costs more than the parse.
INLINE_BYTES = 256 * 1024
READ_SLICE = 256 * 1024  # bytes read before the worker's other requests get a turn
PART_GAP_S = 0.0005  # the turn they get (read_body)
DRAIN_BYTES = 64 * 1024  # an unread body this large or more closes its connection (chat.py)
DRAIN_PIECE = 1024 * 1024  # hang_up reads what was received before it in pieces this large
HANG_UP_DRAIN_S = 5.0  # and for this long at most
PARSE_SHARE = 0.25  # of one core's time, at most, spent parsing one org's large bodies
PARSERS = 2  # child processes parsing one worker's large bodies (one per org at a time)
RETRY_AFTER_S = "1"


class BodyTimeout(GatewayError):
    """The body did not arrive in time: 408 (RFC 9110, 15.5.9). gunicorn then reads what is
    left of the body for at most its keepalive (5 s) and closes the connection."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class ParseBudget:
    """What one worker spends on large request bodies, shared fairly between orgs: bytes
    held, bytes taken in per second, and time spent parsing.

    - At most ``capacity`` bytes of large bodies are held at once (memory), and at most
      ``capacity`` bytes are taken in per second (a token bucket: reading costs the event loop
      a few milliseconds per MiB, so a client sending large bodies without pause cannot keep
      the worker busy reading them).
    - One org holds at most its share of ``capacity``: ``capacity / max(2, n)`` with ``n``
      the orgs holding or waiting for a share, so that another org always finds room beside
      a flood of one. An org that holds nothing may take one body of any size that is free.
    - Large bodies are parsed by ``parsers`` child processes, one body at a time each; one
      org parses one body at a time, and at most :data:`PARSE_SHARE` of a core's time: after
      a parse that cost ``t`` CPU seconds its next one waits ``t / PARSE_SHARE - t``. Another org's
      body meanwhile takes the next free child, without waiting for that pause.

    Whatever cannot be had within ``wait_s`` is a fast 503 with ``Retry-After``.

    :param capacity: bytes; a body larger than this takes the whole budget.
    :param parsers: the child processes (:class:`gateway.api.body_process.BodyProcesses`).
    """

    def __init__(self, capacity, wait_s, parsers=PARSERS):
        self.capacity = capacity
        self.free = capacity
        self.wait_s = wait_s
        self.held = collections.Counter()     # org -> bytes it holds
        self._waiting = collections.Counter()  # org -> its requests waiting for a share
        self._tokens, self._refilled_at = float(capacity), time.monotonic()
        self._changed = Event()
        self._idle = list(range(parsers))     # children with no body
        self._parsing = set()                 # orgs with a body being parsed
        self._next_parse_at = {}              # org -> when its next parse may start

    def share(self):
        """The bytes one org may hold now (one body of any size when it holds none)."""
        active = {org for org, n in self.held.items() if n} | set(self._waiting)
        return self.capacity // max(2, len(active))

    def acquire(self, org, nbytes):
        """Take ``nbytes`` (at most the capacity) for ``org`` to hold and to take in; return
        the amount to :meth:`release` once the body is parsed.

        :raises ServiceUnavailable: not within ``wait_s``.
        """
        want = min(nbytes, self.capacity)
        self._waiting[org] += 1
        try:
            self._wait_until(lambda: self._may_hold(org, want) and self._refill() >= want,
                             lambda: (want - self._tokens) / self.capacity)
        finally:
            self._waiting -= collections.Counter({org: 1})  # drops it at zero
        self.held[org] += want
        self.free -= want
        self._tokens -= want
        return want

    def release(self, org, amount):
        self.held[org] -= amount
        if not self.held[org]:
            del self.held[org]
        self.free += amount
        self._changed.set()

    def _may_hold(self, org, want):
        held = self.held[org]
        return self.free >= want and (not held or held + want <= self.share())

    def _refill(self):
        now = time.monotonic()
        self._tokens = min(self.capacity, self._tokens + (now - self._refilled_at) * self.capacity)
        self._refilled_at = now
        return self._tokens

    def _wait_until(self, ready, retry_in_s):
        deadline = time.monotonic() + self.wait_s
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServiceUnavailable(
                    "Kiln is busy reading other large request bodies; retry with backoff.",
                    code="server_busy", headers={"Retry-After": RETRY_AFTER_S})
            self._changed.clear()
            self._changed.wait(min(left, max(0.001, retry_in_s())))

    def run(self, org, func, *args, start=None, cost_s=None):
        """Return ``func(parser, *args)`` (or raise its exception) once it is ``org``'s turn to
        parse, ``parser`` the index of the child it may use.

        :param start: called with ``parser`` first, its time not counted as parsing (a child
            starting up).
        :param cost_s: ``parser -> seconds`` the parse cost (the child's CPU time: on a busy
            host a niced child takes longer than it works); None: the time ``func`` took.
        :raises ServiceUnavailable: no turn within ``wait_s``.
        """
        self._wait_until(lambda: self._may_parse(org),
                         lambda: self._next_parse_at.get(org, 0.0) - time.monotonic())
        parser = self._idle.pop()
        self._parsing.add(org)
        started = time.monotonic()
        try:
            if start is not None:
                start(parser)
                started = time.monotonic()
            return func(parser, *args)
        finally:
            now = time.monotonic()
            took = cost_s(parser) if cost_s is not None else now - started
            self._parsing.discard(org)
            self._idle.append(parser)
            for other in [o for o, at in self._next_parse_at.items() if at <= now]:
                del self._next_parse_at[other]  # only orgs still pausing are kept
            self._next_parse_at[org] = now + took / PARSE_SHARE - took
            self._changed.set()

    def _may_parse(self, org):
        return (bool(self._idle) and org not in self._parsing
                and time.monotonic() >= self._next_parse_at.get(org, 0.0))


def hang_up(sock):
    """Close the client's connection once the answer is written, without reading the rest of
    its body (gunicorn would read and discard it all to reuse the connection). The answer's
    bytes are sent before the FIN; clients read an early answer when their send then fails
    (urllib3 and curl do).

    What the kernel had received before the shutdown still reads back after it (up to the
    socket's receive buffer: megabytes), and gunicorn reads it before it closes, 1 KiB at a
    time without a turn for the event loop: it is read here first, in large cooperative
    pieces, so that gunicorn finds the end at once.
    """
    try:
        sock.shutdown(socket.SHUT_RDWR)
        with gevent.Timeout(HANG_UP_DRAIN_S, False):
            while sock.recv(DRAIN_PIECE):
                gevent.sleep(PART_GAP_S)
    except OSError:
        pass


def read_body(stream, length, limit, timeout_s):
    """Return the request body, as the list of its parts (bytes, at most :data:`READ_SLICE`
    each, in order), if it arrives within ``timeout_s``: ``length`` bytes (its
    Content-Length) or, when that is None, up to ``limit + 1`` bytes.

    Between two parts the worker's other requests are served: a socket with data waiting
    does not give the event loop a turn by itself, and ``gevent.sleep(0)`` runs the other
    greenlets without waiting for the loop to poll their sockets, so the wait is a short
    timer (:data:`PART_GAP_S`), which the loop reaches only after polling. A body of one part
    (most) never waits.

    :raises BodyTimeout: it did not.
    """
    want = limit + 1 if length is None else length
    parts, got = [], 0
    try:
        with gevent.Timeout(timeout_s):
            while got < want:
                part = stream.read(min(READ_SLICE, want - got))
                if not part:
                    break
                parts.append(part)
                got += len(part)
                if got < want:
                    gevent.sleep(PART_GAP_S)
    except gevent.Timeout:
        raise BodyTimeout(f"The request body did not arrive within {timeout_s:g} s.") from None
    return parts
