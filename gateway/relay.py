"""Relay of one admitted generation: upstream call, client watch, keepalives, settlement.

Every admitted request is settled exactly once (:meth:`Generation.finish`), from a ``finally``:
success, upstream error, timeout, client gone, or an exception in Kiln itself.
"""
import json
import logging
import socket
import time
from dataclasses import dataclass

import gevent
from gevent.event import Event
from gevent.queue import Queue
from urllib3.exceptions import ReadTimeoutError

from . import limits, upstream
from .billing import Outcome, Usage, cost_usd, from_nanos, settle, to_nanos
from .db import utcnow
from .errors import UpstreamTimeout

log = logging.getLogger("kiln.requests")

GENERATION_HEADER = "X-Neocloud-Generation-Id"
READ_SIZE = 65536
DATA, EOF, FAILED, GONE = "data", "eof", "failed", "gone"


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
        self.backend = request.entry.pick_backend()
        self.started = time.monotonic()
        self.first_token_s = None
        self.first_token_at = None
        self.events = Queue()
        self.gone = Event()
        self.resp = None
        self.final_usage = None   # Usage billed, once known
        self.opened_relay = False  # the stream body started running
        self._watcher = None
        self._settled = False

    # -- upstream and client ---------------------------------------------------------------

    def open_upstream(self):
        """Start the upstream request in a greenlet; return it (its value is the response)."""
        config = self.services.config
        timeouts = (config.upstream_connect_timeout_s, config.upstream_read_timeout_s)
        return gevent.spawn(upstream.open_chat, self.services.session, self.backend,
                            self.request.body, timeouts)

    def watch_client(self, sock):
        """Notice the client leaving while Kiln waits on the upstream (not only on a write)."""
        if sock is not None:
            self._watcher = gevent.spawn(self._watch, sock)

    def _watch(self, sock):
        try:
            while True:
                gevent.socket.wait_read(sock.fileno())
                if sock.recv(1, socket.MSG_PEEK) == b"":
                    break
                gevent.sleep(0.25)  # bytes of a next request: look again later
        except OSError:
            pass
        self.gone.set()
        self.events.put((GONE, None))
        if self.resp is not None:
            upstream.shutdown(self.resp)

    def wait_for(self, greenlet):
        """Return ``greenlet``'s value, or raise :class:`ClientGone` if the client leaves first."""
        gevent.wait([greenlet, self.gone], count=1)
        if not greenlet.ready():
            greenlet.kill(block=False)
            raise ClientGone()
        return greenlet.get()

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
            if not self.gone.is_set():
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

    def estimate_prompt(self):
        """Estimate prompt tokens when the backend reported none (flagged as estimated)."""
        text = "\n".join(_message_text(m) for m in self.request.body.get("messages", []))
        exact = upstream.count_tokens(self.services.session, self.backend, text)
        if exact is not None:
            return exact + 4 * self.request.n_messages
        return max(1, len(text.encode()) // 4) + 4 * self.request.n_messages

    def renew_lease(self, usage):
        """Renew the in-flight lease and store progress for the sweeper."""
        limits.renew(self.services.engine, self.gid, self.services.config.lease_ttl_s, usage)

    def finish(self, status, usage, http_status, error=None):
        """Settle once: final status, tokens, exact cost; release hold and lease; log and count.

        A failure here is logged, not raised: the lease then expires and the sweeper settles.
        """
        if self._settled:
            return
        self._settled = True
        if self._watcher is not None:
            self._watcher.kill(block=False)
        cost = to_nanos(self.price(usage))
        outcome = Outcome(status=status, usage=usage, cost_nanos=cost, http_status=http_status,
                          error=error, backend=self.backend.url, first_token_at=self.first_token_at)
        t0 = time.monotonic()
        try:
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
        u = outcome.usage
        return {"event": "generation", "generation_id": self.gid, "org_id": self.principal.org_id,
                "key_prefix": self.principal.key_prefix, "model": self.request.entry.id,
                "backend": self.backend.url, "stream": self.request.stream,
                "status": outcome.status, "http_status": outcome.http_status,
                "prompt_tokens": u.prompt, "cached_tokens": u.cached,
                "completion_tokens": u.completion, "estimated": u.estimated,
                "cost_usd": str(from_nanos(outcome.cost_nanos)),
                "ttft_ms": _ms(self.first_token_s),
                "duration_ms": _ms(time.monotonic() - self.started), "error": outcome.error}


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
