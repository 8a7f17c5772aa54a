"""Relay of one admitted generation: upstream call, client watch, keepalives, settlement.

Every admitted request is settled exactly once (:meth:`Generation.finish`), from a ``finally``:
success, upstream error, timeout, client gone, or an exception in Kiln itself.
"""
import json
import logging
import select
import socket
import time
from dataclasses import dataclass

import gevent
from gevent.event import Event
from gevent.monkey import get_original
from gevent.queue import Queue
from gevent.socket import wait_read
from sqlalchemy.exc import SQLAlchemyError
from urllib3.exceptions import ReadTimeoutError

from . import limits, upstream
from .billing import Outcome, Usage, cost_usd, from_nanos, settle, to_nanos
from .db import utcnow
from .errors import UpstreamTimeout

log = logging.getLogger("kiln.requests")

GENERATION_HEADER = "X-Neocloud-Generation-Id"
READ_SIZE = 65536
DATA, EOF, FAILED, GONE = "data", "eof", "failed", "gone"
# Linux reports a peer's FIN as POLLRDHUP even while unread bytes (a pipelined next request)
# sit in the buffer, where a peek would only see those bytes. The unpatched poll, with timeout 0,
# never blocks the hub.
_RDHUP = getattr(select, "POLLRDHUP", 0)
_HANGUP = _RDHUP | select.POLLHUP | select.POLLERR
_real_poll = get_original("select", "poll")


@dataclass(frozen=True)
class Services:
    """Per-app collaborators a generation needs after the request context is gone."""

    config: object
    engine: object
    session: object
    catalog: dict
    metrics: object


class ClientGone(Exception):
    """The client closed its connection."""


class StreamFailed(Exception):
    """The upstream failed after the stream began; ``status`` is the usage event's status."""

    def __init__(self, message, status="upstream_error"):
        super().__init__(message)
        self.status = status


class Generation:
    """One admitted request, from admission to settlement."""

    def __init__(self, services, principal, request, gid, hold_nanos):
        self.services = services
        self.principal = principal
        self.request = request
        self.gid = gid
        self.hold_nanos = hold_nanos
        self.backend = request.backend or request.entry.pick_backend()
        self.started = time.monotonic()
        self.first_token_s = None
        self.first_token_at = None
        self.events = Queue()
        self.gone = Event()
        self.resp = None
        self.final_usage = None   # Usage billed, once known
        self.client_addr = None   # X-Forwarded-For when the peer is a trusted proxy, else peer
        self.opened_relay = False  # the stream body started running
        self._watcher = None
        self._opener = None
        self._pump = None
        self._upstream_closed = False
        self._aborted = False
        self._settled = False
        self._renewed_at = self.started
        self._renewing = False  # the renewer is inside a database call: do not kill it there
        # Started only after a third of the lease TTL: short requests never pay for it.
        self._renewer = gevent.spawn_later(services.config.lease_ttl_s / 3,
                                           self._renew_lease_until_settled) \
            if services.config.metering else None

    # -- upstream and client ---------------------------------------------------------------

    def open_upstream(self, read_body=False):
        """Start the upstream request in a greenlet; return it (its value is the response).

        The response is also kept as :attr:`resp` the moment it exists, so that the client
        watcher can abort it. With ``read_body`` (non-stream) the same greenlet also reads the
        whole body, one greenlet per request instead of two.
        """
        self._opener = gevent.spawn(self._open, read_body)
        return self._opener

    def _open(self, read_body=False):
        config = self.services.config
        timeouts = (config.upstream_connect_timeout_s, config.upstream_read_timeout_s)
        sent = time.monotonic()
        try:
            resp = upstream.open_chat(self.services.session, self.backend, self.request.body,
                                      timeouts)
        finally:  # the backend's answer (status line or failure); a cancelled wait is none
            if not (self.gone.is_set() or self._upstream_closed):
                self.services.metrics.upstream_latency.labels(self.request.entry.id).observe(
                    time.monotonic() - sent)
        self.resp = resp
        if self.gone.is_set() or self._upstream_closed:
            self._abort(resp)  # the client left while the status line was on its way
        elif read_body:
            upstream.read_whole(resp)
        return resp

    def close_upstream(self):
        """Stop the reader and the opener, then abort the upstream response (the model server
        sees its connection close and stops generating). Safe to call twice, from any greenlet
        but those two.
        """
        self._upstream_closed = True
        for greenlet in (self._pump, self._opener):
            if greenlet is not None and not greenlet.ready():
                # Blocking kill: closing a response while a greenlet is inside its buffered
                # read fails ("reentrant call") and would leave the connection open.
                greenlet.kill()
        if self.resp is not None:
            self._abort(self.resp)

    def _abort(self, resp):
        if not self._aborted:  # a second shutdown of a closed urllib3 response raises
            self._aborted = True
            upstream.shutdown(resp)

    def watch_client(self, sock):
        """Notice the client leaving while Kiln waits on the upstream (not only on a write)."""
        if sock is not None:
            self._watcher = gevent.spawn(self._watch, sock)

    def _watch(self, sock):
        try:
            while True:
                wait_read(sock.fileno())
                if _peer_closed(sock):
                    break
                gevent.sleep(0.25)  # bytes of a pipelined next request: look again later
        except (OSError, ValueError):
            pass  # reset, or the socket is already closed: the client is gone
        self.gone.set()
        self.events.put((GONE, None))
        self.close_upstream()

    def wait_for(self, greenlet):
        """Return ``greenlet``'s value, or raise :class:`ClientGone` if the client leaves first."""
        gevent.wait([greenlet, self.gone], count=1)
        if not greenlet.ready():
            greenlet.kill(block=False)
            raise ClientGone()
        return greenlet.get()

    def start_pump(self, resp):
        """Start reading the upstream body into :attr:`events` in a greenlet."""
        self._pump = gevent.spawn(self.pump, resp)

    def read_body(self):
        """Return the whole upstream body (bytes), read by ``open_upstream(read_body=True)``."""
        return self.resp.content

    def pump(self, resp):
        """Read the upstream body into :attr:`events` as it arrives (runs in a greenlet)."""
        try:
            while True:
                data = resp.raw.read1(READ_SIZE)
                if not data:
                    self.events.put((EOF, None))
                    return
                self.events.put((DATA, data))
        except ReadTimeoutError:
            self.events.put((FAILED, StreamFailed("The model backend stopped sending (read "
                                                  "timeout).", status="timeout")))
        except Exception as err:  # noqa: BLE001 - any read failure ends the stream as an error
            if not (self.gone.is_set() or self._upstream_closed):
                self.events.put((FAILED, StreamFailed(f"The model backend connection failed: "
                                                      f"{type(err).__name__}.")))

    def mark_first_token(self):
        """Record the time of the first generated token (once)."""
        if self.first_token_s is None:
            self.first_token_s = time.monotonic() - self.started
            self.first_token_at = utcnow()

    # -- metering and settlement ---------------------------------------------------------------

    def price(self, usage):
        """Return the USD billed for ``usage`` (Usage or OpenAI dict), capped at the hold."""
        if isinstance(usage, dict):
            usage = Usage.from_openai(usage)
        cost = cost_usd(usage, self.request.entry.pricing)
        return min(cost, from_nanos(self.hold_nanos))

    def estimate_prompt(self, exact=True):
        """Estimate prompt tokens when the backend reported none (flagged as estimated): the
        messages' text counted by the backend's tokenize endpoint when ``exact`` and it has one,
        else about 4 bytes a token; plus the chat template's tokens (ChatML: about 5 a message
        and 3 to open the reply)."""
        text = "\n".join(_message_text(m) for m in self.request.body.get("messages", []))
        counted = upstream.count_tokens(self.services.session, self.backend, text) \
            if exact else None
        if counted is None:
            counted = max(1, len(text.encode()) // 4)
        return counted + 5 * self.request.n_messages + 3

    def count_completion(self, rules):
        """Return the completion tokens of a stream that reported no usage: the generated text
        counted by the backend when it can, else one token per delta."""
        if rules.texts:
            counted = upstream.count_tokens(self.services.session, self.backend,
                                            "".join(rules.texts))
            if counted is not None:
                return max(counted, 1)
        return rules.deltas

    def renew_lease(self, usage):
        """Renew the in-flight lease and store progress for the sweeper; return False once the
        lease is gone.

        Best effort: a database hiccup must not cut a live stream; a lease that then expires is
        closed by the sweeper, and this stream's own settlement finds it settled.
        """
        self._renewed_at = time.monotonic()
        if not self.services.config.metering:  # benchmarks only: there is no lease
            return True
        try:
            return limits.renew(self.services.engine, self.gid, self.services.config.lease_ttl_s,
                                usage)
        except SQLAlchemyError:
            log.warning("lease renewal failed for %s", self.gid, exc_info=True)
            return True

    def _renew_lease_until_settled(self):
        """Keep the lease renewed every third of the TTL from admission to settlement, whatever
        the request is doing (waiting for a status line, a long non-stream answer). While the
        stream relay renews (with progress), this greenlet only waits."""
        every_s = self.services.config.lease_ttl_s / 3
        while not self._settled:
            due_in_s = self._renewed_at + every_s - time.monotonic()
            if due_in_s > 0:
                gevent.sleep(due_in_s)
                continue
            self._renewing = True
            try:
                if not self.renew_lease(None):
                    return
            finally:
                self._renewing = False

    def finish(self, status, usage, http_status, error=None):
        """Settle once: final status, tokens, exact cost; release hold and lease; log and count.

        A failure here is logged, not raised: the lease then expires and the sweeper settles.
        """
        if self._settled:
            return
        self._settled = True
        # A renewer caught inside a database call finishes it and stops by itself: killed
        # there, it would waste the pooled connection.
        renewer = None if self._renewing else self._renewer
        for greenlet in (self._watcher, renewer):
            if greenlet is not None:
                greenlet.kill(block=False)
        cost = to_nanos(self.price(usage))
        outcome = Outcome(status=status, usage=usage, cost_nanos=cost, http_status=http_status,
                          error=error, backend=self.backend.url, first_token_at=self.first_token_at)
        t0 = time.monotonic()
        try:
            if self.services.config.metering:  # off only for benchmarks (KILN_METERING)
                settle(self.services.engine, self.gid, outcome)
        except Exception:  # noqa: BLE001 - the settlement guard: the sweeper will close it
            log.exception("settlement failed for %s; the sweeper will close it", self.gid)
        self._observe(outcome, time.monotonic() - t0)

    def _observe(self, outcome, settle_s):
        m = self.services.metrics
        model = self.request.entry.id
        m.settlement.observe(settle_s)
        m.in_flight.dec()
        m.requests.labels(model, outcome.status).inc()
        m.tokens.labels(model, "prompt").inc(outcome.usage.prompt)
        m.tokens.labels(model, "completion").inc(outcome.usage.completion)
        m.cost.labels(model).inc(float(from_nanos(outcome.cost_nanos)))
        if self.first_token_s is not None:
            m.ttft.labels(model).observe(self.first_token_s)
        if self.services.config.log_requests:
            log.info(json.dumps(self._log_record(outcome)))

    def _log_record(self, outcome):
        # No error text: a backend's message can quote the prompt (a 422 ``detail`` echoes the
        # input). The usage event keeps the text; the log says only that there was one.
        u = outcome.usage
        return {"event": "generation", "generation_id": self.gid, "org_id": self.principal.org_id,
                "key_prefix": self.principal.key_prefix, "client_addr": self.client_addr,
                "model": self.request.entry.id,
                "backend": self.backend.url, "stream": self.request.stream,
                "status": outcome.status, "http_status": outcome.http_status,
                "prompt_tokens": u.prompt, "cached_tokens": u.cached,
                "completion_tokens": u.completion, "estimated": u.estimated,
                "cost_usd": str(from_nanos(outcome.cost_nanos)),
                "ttft_ms": _ms(self.first_token_s),
                "duration_ms": _ms(time.monotonic() - self.started),
                "has_error": outcome.error is not None}


def _peer_closed(sock):
    """Return whether the client closed its side (called once ``sock`` is readable)."""
    if _RDHUP:
        poller = _real_poll()
        poller.register(sock.fileno(), select.POLLIN | _HANGUP)
        return any(events & _HANGUP for _, events in poller.poll(0))
    return sock.recv(1, socket.MSG_PEEK) == b""


def _ms(seconds):
    return None if seconds is None else round(seconds * 1000, 1)


def _message_text(message):
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content
                        if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def status_for(err):
    """Return the usage-event status for a gateway error raised before the stream began."""
    return "timeout" if isinstance(err, UpstreamTimeout) else "upstream_error"
