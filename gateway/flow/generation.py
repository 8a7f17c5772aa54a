"""One generation's life: admit, send it to a backend, relay the answer (JSON or SSE), settle.

The request flows one way (README, "Layout"): the view (:mod:`gateway.api.chat`) calls
:func:`respond`; this module calls the contract (:mod:`gateway.contract.parameters`), the ledger
(:mod:`gateway.ledger`), the money math (:mod:`gateway.billing`, :mod:`gateway.flow.metering`) and
the answer's two paths (:mod:`gateway.flow.answers`) and the relay (:mod:`gateway.backends.relay`,
:mod:`gateway.backends.upstream`, :mod:`gateway.backends.sse`), which return values or take
callbacks. A generation is settled in exactly one place, the ``finally`` of :func:`_life`, with
the outcome :func:`gateway.flow.outcomes.outcome_for` gives.
"""
import json
import logging
import secrets
import time
from dataclasses import dataclass, field

import gevent

from flask import Response

from . import answers
from ..backends import fleet, upstream
from ..billing import Usage, cost_nanos, from_nanos, hold_nanos
from ..db import utcnow
from ..errors import GENERATION_HEADER, GatewayError
from ..backends.fleet import Route
from ..ledger import AdmissionRequest, Settlement
from .metering import Meter, estimate_completion, estimate_prompt, reconcile_usage
from ..endings import CLIENT_CLOSED, Status
from .outcomes import LeaseLost, error_event, outcome_for
from ..contract.parameters import upstream_body
from ..backends.relay import ClientGone, ClientWatch, UpstreamCall, guard_writes

log = logging.getLogger("kiln.requests")


@dataclass(frozen=True)
class Services:
    """Per-app collaborators a generation needs after the request context is gone."""

    config: object
    engine: object
    session: object
    catalog: dict
    metrics: object
    ledger: object
    live: set = field(default_factory=set)  # this worker's generations, until closed


def respond(services, principal, chat, environ):
    """Admit ``chat`` and return the Flask response that relays it.

    :param chat: :class:`gateway.contract.validation.ChatRequest`.
    :param environ: the WSGI environ (the client's socket, its address).
    :raises GatewayError: refused before any byte of the answer (402, 429, 502, 503, ...);
        an admitted generation is settled before this is raised.
    """
    route = Route(services, chat.entry, chat.messages)
    route.take(services.config.backend_wait_s)  # 503 when none is free, before any charge
    try:
        gen = Generation(services, principal, chat, route, environ)
    except BaseException:
        route.release()
        raise
    life = _life(gen)
    try:
        head = next(life)
    except GatewayError as err:
        err.headers[GENERATION_HEADER] = gen.gid
        raise
    except ClientGone:  # settled as cancelled; nobody is left to read an answer
        return Response(status=CLIENT_CLOSED, headers={GENERATION_HEADER: gen.gid})
    body = guard_writes(life, environ.get("gunicorn.socket"), gen.timeouts.idle_s)
    return Response(body, status=head.status, content_type=head.content_type,
                    headers={GENERATION_HEADER: gen.gid, **head.headers})


def _life(gen):
    """Yield the response's head, then its body; settle exactly once, whatever ends it.

    A completed path returns its last bytes (the JSON body; the usage chunk and ``[DONE]``) as
    a function of the USD charged, instead of sending them: they go out once the settlement is
    handed to the ledger, with the cost it debits (docs/METERING.md, "When the usage event is
    final"). A failed stream's last bytes are its error event.
    """
    ending, last = None, None
    try:
        last = yield from (answers.stream(gen) if gen.chat.stream else answers.complete(gen))
    except BaseException as exc:  # noqa: BLE001 - the one place a generation ends
        ending = exc
        if isinstance(exc, GeneratorExit) or not gen.head_sent:
            raise
        if not isinstance(exc, ClientGone):  # nobody left to tell
            event = error_event(outcome_for(exc, stream_began=True), exc)
            last = lambda _charged: event  # noqa: E731
    finally:
        try:
            gen.close()
        finally:
            gen.settle(outcome_for(ending, gen.head_sent))
    if last is not None:
        yield last(gen.charged_usd)


class Generation:
    """One admitted request: what it asked, where it went, what it produced."""

    def __init__(self, services, principal, chat, route, environ):
        self.services, self.principal, self.chat, self.route = services, principal, chat, route
        config = services.config
        self.timeouts = chat.entry.timeouts_for(config)
        self.client_addr = environ.get("kiln.client_addr")
        self.meter = Meter(chat.completion_cap)
        self.hold_nanos = hold_nanos(chat.entry.pricing, chat.prompt_bound, chat.completion_cap)
        self.started = time.monotonic()
        t0 = self.started
        self.gid, self.started_at = services.ledger.admit(AdmissionRequest(
            gid=_new_gid(), org_id=principal.org_id, key_id=principal.key_id,
            model=chat.entry.id, stream=chat.stream, hold_nanos=self.hold_nanos,
            in_flight_limit=principal.in_flight_limit, lease_ttl_s=config.lease_ttl_s,
            key_checks=principal.key_checks, limit_usd=principal.limit_usd,
            limit_reset=principal.limit_reset))
        services.metrics.admission.observe(time.monotonic() - t0)
        services.metrics.in_flight.inc()
        self.lease = services.ledger.track(self.gid, self.progress)
        self.greenlet = gevent.getcurrent()
        services.live.add(self)
        self.watch = ClientWatch(environ.get("gunicorn.socket")) if chat.stream else None
        self.call = self.pump = None
        self.accepted = False   # the backend answered: what it produced is billed
        self.head_sent = False  # the response's status line went out
        self.read_whole = False  # the backend's reply was read to its end: keep the connection
        self.first_token_s = self.first_token_at = None
        self.usage = None       # the usage billed, once known
        self.charged_usd = None  # the USD debited, once settled

    # -- backend -------------------------------------------------------------------------------

    @property
    def backend(self):
        """The backend tried last: the one that served, once one answered."""
        return self.route.backend

    @property
    def attempts(self):
        return self.route.tried

    def open_response(self):
        """Return the first 2xx response of the route's backends (tries before the first byte)."""
        return self.route.open(self._try, (self.timeouts.connect_s, self.timeouts.first_byte_s))

    def _try(self, backend, timeouts_s):
        body = upstream.encode_body(upstream_body(self.chat, backend))
        resp = upstream.open_chat(self.services.session, backend, body, timeouts_s)
        return upstream.event_stream(resp) if self.chat.stream else resp

    def send(self):
        """Send the request from its own greenlet; return the call."""
        self.call = UpstreamCall(self.open_response)
        if self.watch is not None:
            self.watch.on_gone(self._client_gone)
        return self.call

    def _client_gone(self):
        if self.pump is not None:
            self.pump.stop(reason=ClientGone())  # the relay wakes and ends as cancelled
        self.abort()  # the model server stops generating

    def send_and_read(self):
        """Send the request from this greenlet and return the 2xx reply's whole body
        (non-stream). A reply that breaks off (a reset, the idle timeout) is retried on another
        backend like a failure before its status line: nothing of it reached the client, and
        it is not billed (docs/ROUTING.md)."""
        sent = time.monotonic()
        try:
            return self.route.open(self._try_whole,
                                   (self.timeouts.connect_s, self.timeouts.first_byte_s))
        finally:
            self.observe_answer(sent)

    def _try_whole(self, backend, timeouts_s):
        resp = self._try(backend, timeouts_s)
        upstream.set_read_timeout(resp, self.timeouts.idle_s)
        try:
            raw = upstream.read_whole(resp, self.services.config.max_reply_bytes)
        except BaseException:
            upstream.shutdown(resp)
            raise
        upstream.close(resp)
        return raw

    def answer(self, call):
        """Return the call's 2xx response (raise its error), counting the backend's latency;
        from now on each read waits up to the idle timeout."""
        try:
            resp = call.result()
            upstream.set_read_timeout(resp, self.timeouts.idle_s)
            return resp
        finally:
            self.observe_answer(call.sent_at)

    def observe_answer(self, sent):
        """Count the time from sending to the backend's answer (a stream's status line, a
        whole non-stream reply, or the failure)."""
        m = self.services.metrics
        m.child(m.upstream_latency, self.chat.entry.id).observe(time.monotonic() - sent)

    def check_lease(self):
        """Raise :class:`gateway.flow.outcomes.LeaseLost` once the sweeper settled this
        generation."""
        if self.lease.lost.is_set():
            raise LeaseLost()

    def mark_first_token(self):
        if self.first_token_s is None:
            self.first_token_s = time.monotonic() - self.started
            self.first_token_at = utcnow()

    def abort(self):
        """Stop reading the backend, then close its request (the model stops generating)."""
        if self.pump is not None:
            self.pump.stop()  # first: closing a response inside another greenlet's read fails
        if self.call is not None:
            self.call.close(complete=self.read_whole)

    def close(self):
        """Stop watching the client, then :meth:`abort`; a reply read to its end keeps its
        connection for the next request instead. Safe to call twice."""
        self.services.live.discard(self)
        if self.watch is not None:
            self.watch.stop()
        self.abort()
        self.route.release()

    def interrupt(self, reason):
        """End this generation early with ``reason`` (an exception; see
        :func:`gateway.ops.lifecycle.end_generations`): a relaying stream ends with an error event,
        anything else gets it raised where it waits. It is settled as any generation is."""
        if self.pump is not None:
            self.pump.stop(reason=reason)
        else:
            self.greenlet.kill(reason, block=False)

    # -- metering ------------------------------------------------------------------------------

    def count_tokens(self, text):
        """The backend's tokenizer, or None when it has none or does not answer in time."""
        return upstream.count_tokens(self.services.session, self.backend, text)

    def final_usage(self):
        """Return the usage to bill (computed once): nothing if the backend never accepted the
        request, else its report with Kiln's own counts where it is missing or malformed."""
        if self.usage is None:
            self.usage = Usage() if not self.accepted else reconcile_usage(
                self.meter.reported, self.meter, self._own_prompt,
                lambda: estimate_completion(self.meter, self.count_tokens))
        return self.usage

    def _own_prompt(self, count=None):
        chat = self.chat
        return estimate_prompt({"messages": chat.messages, "tools": chat.params.get("tools")},
                               chat.n_messages, chat.entry.context_window, chat.has_images,
                               count or self.count_tokens)

    def progress(self):
        """Usage so far, for the lease renewer: no backend call (its tokenizer may be busy)."""
        if self.usage is not None or not self.accepted:
            return self.usage
        return Usage(prompt=self._own_prompt(lambda _text: None),
                     completion=self.meter.generated, estimated=True)

    def cost_nanos(self):
        return cost_nanos(self.final_usage(), self.chat.entry.pricing)

    # -- settlement ----------------------------------------------------------------------------

    def settle(self, outcome):
        """Hand the outcome to the ledger (it commits it, retrying until it does), then count
        and log it. Anything billed above the hold is an anomaly: counted and logged."""
        usage = self.final_usage()
        cost = self.cost_nanos()
        # The backend generated past the cap it was sent (Kiln cut it), or reported more than
        # Kiln held for: either way it did not keep to the length it was given.
        anomaly = (self.meter.cut or cost > self.hold_nanos
                   or usage.completion > self.chat.completion_cap)
        if anomaly:
            self.services.metrics.anomalies.labels(self.chat.entry.id).inc()
            log.warning(json.dumps({"event": "usage_anomaly", "generation_id": self.gid,
                                    "backend": self.backend.url, "hold_nanos": self.hold_nanos,
                                    "cost_nanos": cost,
                                    "completion_tokens": usage.completion,
                                    "completion_cap": self.chat.completion_cap}))
        p, config = self.principal, self.services.config
        # A completed answer's last bytes leave without waiting for the settlement's commit:
        # the cost they tell is the one debited, since a cost within the hold is always
        # covered. A cost above the hold (the balance may not cover it all) waits to learn the
        # debit; an error waits so that its slot is free when the client retries; every answer
        # waits when the operator asks (KILN_SETTLE_BEFORE_ANSWER); none when nobody is left
        # to read it.
        wait = (outcome.status is not Status.COMPLETED or cost > self.hold_nanos
                or config.settle_before_answer) and outcome.status is not Status.CLIENT_CANCELLED
        wait_s = config.settle_wait_s if wait else 0
        settlement = Settlement(
            gid=self.gid, org_id=p.org_id, key_id=p.key_id, model=self.chat.entry.id,
            stream=self.chat.stream, status=outcome.status.value, usage=usage,
            cost_nanos=cost, http_status=outcome.http_status, error=outcome.message,
            error_code=outcome.code, backend=self.backend.url, attempts=self.attempts,
            anomaly=anomaly, started_at=self.started_at, first_token_at=self.first_token_at)
        if self.services.ledger.settle(settlement, wait_s=wait_s) and \
                settlement.debited is not None:
            cost = settlement.debited  # less only if the org could not cover an anomaly
        self.charged_usd = from_nanos(cost)
        self._observe(outcome, usage, cost)

    def _observe(self, outcome, usage, cost_nanos):
        m, model = self.services.metrics, self.chat.entry.id
        m.in_flight.dec()
        m.child(m.requests, model, outcome.status.value).inc()
        m.child(m.tokens, model, "prompt").inc(usage.prompt)
        m.child(m.tokens, model, "completion").inc(usage.completion)
        m.child(m.cost, model).inc(float(from_nanos(cost_nanos)))
        if self.first_token_s is not None:
            m.child(m.ttft, model).observe(self.first_token_s)
        fleet.observe(m, self.route, outcome.status.value, outcome.code, self.first_token_s,
                      usage.completion, time.monotonic() - self.started if self.chat.stream else 0)
        if self.services.config.log_requests:
            log.info(json.dumps(self._log_record(outcome, usage, cost_nanos)))

    def _log_record(self, outcome, usage, cost_nanos):
        # No error text: a backend's message can quote the prompt (a 422 ``detail`` echoes the
        # input). The usage event keeps the text; the log says only that there was one.
        return {"event": "generation", "generation_id": self.gid,
                "org_id": self.principal.org_id, "key_prefix": self.principal.key_prefix,
                "client_addr": self.client_addr, "model": self.chat.entry.id,
                "backend": self.backend.url, "stream": self.chat.stream,
                "status": outcome.status.value, "http_status": outcome.http_status,
                "prompt_tokens": usage.prompt, "cached_tokens": usage.cached,
                "completion_tokens": usage.completion, "estimated": usage.estimated,
                "cost_usd": str(from_nanos(cost_nanos)), "ttft_ms": _ms(self.first_token_s),
                "duration_ms": _ms(time.monotonic() - self.started),
                "has_error": outcome.message is not None}


def _new_gid():
    return "gen-" + secrets.token_hex(12)


def _ms(seconds):
    return None if seconds is None else round(seconds * 1000, 1)
