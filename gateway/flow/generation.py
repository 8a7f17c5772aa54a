"""The accounting side of one generation: its id and hold (fixed at admission), its meter, the
usage billed, the progress the lease renewer records, and its settlement, counted and logged.

Admission (:func:`admit`) comes first: a :class:`Generation` exists only for a request the
ledger admitted. What the backend side did (which backend, whether its answer was taken) is
read from the :class:`~gateway.backends.exchange.Exchange`; nothing here sets its state.
"""
import json
import logging
import secrets
import time
from dataclasses import dataclass

import orjson

from ..backends import fleet
from ..billing import BY_BOUND, BY_TOKENIZER, Usage, cost_nanos, from_nanos, hold_nanos
from ..db import utcnow
from ..endings import Status
from ..ledger import AdmissionRequest, Settlement
from ..contract.validation import CHAT_ANSWER, EMBEDDINGS_ANSWER
from .metering import (Meter, estimate_completion, estimate_prompt, estimate_text_prompt,
                       oversized_completion, reconcile_embeddings_usage, reconcile_usage)
from .outcomes import LeaseLost

log = logging.getLogger("kiln.requests")


@dataclass(frozen=True)
class Admission:
    """An admitted request: its generation id, when the ledger admitted it, its hold, and when
    its admission began (``time.monotonic()``: a generation's timings count from there)."""

    gid: str
    started_at: object
    hold_nanos: int
    started: float
    endpoint: str = "chat"


def admit(services, principal, request, endpoint):
    """Place the request's hold and in-flight lease; return its :class:`Admission`.

    :param request: the canonical request (:class:`~gateway.contract.validation.ChatRequest`).
    :param endpoint: the API the client called (its codec's name), kept on the usage event.
    :raises GatewayError: 402 (credits, the key's limit), 429 (in-flight limit, rate), 503
        (database busy); nothing is left behind.
    """
    config, hold = services.config, hold_nanos(request.entry.pricing, request.prompt_bound,
                                                request.completion_cap)
    t0 = time.monotonic()
    gid, started_at = services.ledger.admit(AdmissionRequest(
        gid=_new_gid(), org_id=principal.org_id, key_id=principal.key_id,
        model=request.entry.id, stream=request.stream, hold_nanos=hold,
        in_flight_limit=principal.in_flight_limit, lease_ttl_s=config.lease_ttl_s,
        key_checks=principal.key_checks, limit_usd=principal.limit_usd,
        limit_reset=principal.limit_reset, endpoint=endpoint,
        key_in_flight_limit=principal.key_in_flight_limit))
    services.metrics.admission.observe(time.monotonic() - t0)
    services.metrics.in_flight.inc()
    return Admission(gid, started_at, hold, t0, endpoint)


class Generation:
    """One admitted request's money: what it may cost, what it produced, what it is billed.

    :param exchange: the backend side (:class:`~gateway.backends.exchange.Exchange`), read
        for the backend that served, the attempts, whether the answer was taken, and its
        tokenize endpoint (asked only when the model has no local tokenizer).
    """

    def __init__(self, services, principal, request, admission, exchange, client_addr):
        self.services, self.principal, self.request = services, principal, request
        self.exchange, self.client_addr = exchange, client_addr
        self.gid, self.started_at = admission.gid, admission.started_at
        self.hold_nanos = admission.hold_nanos
        self.started, self.endpoint = admission.started, admission.endpoint
        self.meter = Meter(request.completion_cap, getattr(request, "echoed", None))
        self.lease = services.ledger.track(self.gid, self.progress)
        self.first_token_s = self.first_token_at = None
        self.usage = None        # the usage billed, once known
        self.charged_usd = None  # the USD debited, once settled

    def check_lease(self):
        """Raise :class:`gateway.flow.outcomes.LeaseLost` once the sweeper settled this
        generation."""
        if self.lease.lost.is_set():
            raise LeaseLost()

    def mark_first_token(self):
        """Note the time of the first generated token (once)."""
        if self.first_token_s is None:
            self.first_token_s = time.monotonic() - self.started
            self.first_token_at = utcnow()
            self.exchange.spans.event("kiln.first_token")

    # -- metering ------------------------------------------------------------------------------

    def final_usage(self):
        """Return the usage to bill (computed once): nothing if the backend's answer was never
        taken or its stream began with an error (a refusal), else its report with Kiln's own
        counts where it is missing or malformed; Kiln's own counts alone for a reply too large
        to read (docs/METERING.md). Each count says which it is (``prompt_by``,
        ``completion_by``)."""
        if self.usage is None:
            if not self.exchange.accepted or self.meter.refused:
                self.usage = Usage()
            elif self.exchange.oversized_bytes is not None:
                self.usage = Usage(prompt=self._own_prompt(self.count_tokens), estimated=True,
                                   completion=oversized_completion(
                                       self.exchange.oversized_bytes,
                                       self.request.completion_cap),
                                   prompt_by=BY_BOUND, completion_by=BY_BOUND)
            elif self.request.kind == EMBEDDINGS_ANSWER:
                self.usage = reconcile_embeddings_usage(self.meter.reported, self._prompt_bound)
            else:
                self.usage = reconcile_usage(self.meter.reported, self.meter,
                                             self._prompt_bound, self._own_completion)
        return self.usage

    def count_tokens(self, text):
        """Kiln's exact count of ``text``: the model's local tokenizer, else the serving
        backend's tokenize endpoint; None when neither gives one (the bound applies)."""
        counted = self.services.tokenizers.count(self.request.entry.id, text)
        return counted if counted is not None else self.exchange.count_tokens(text)

    def _local_count(self, text):
        return self.services.tokenizers.count(self.request.entry.id, text)

    def _prompt_bound(self):
        """Kiln's prompt count: a bound from above in every case (the chat template, or the
        raw prompts' and inputs' special tokens, are the backend's: an allowance stands for
        them), tight when a tokenizer counts the text."""
        return self._own_prompt(self.count_tokens), BY_BOUND

    def _own_completion(self):
        """Kiln's completion count: exact when the generated text was counted by a tokenizer,
        else the bound (bytes, within the budget; the relayed floor when there is no text)."""
        answered = []

        def count(text):
            counted = self.count_tokens(text)
            answered.append(counted is not None)
            return counted
        tokens = estimate_completion(self.meter, count)
        return tokens, BY_TOKENIZER if answered and all(answered) else BY_BOUND

    def _own_prompt(self, count):
        request = self.request
        if request.kind != CHAT_ANSWER:  # raw prompts, or embeddings inputs
            if request.kind == EMBEDDINGS_ANSWER:
                items, suffix, bound = request.inputs, None, request.entry.max_input_tokens
            else:
                items, suffix = request.prompts, request.params.get("suffix")
                bound = request.entry.context_window
            return min(estimate_text_prompt(items, suffix, bound, count), request.prompt_bound)
        return estimate_prompt({"messages": request.messages,
                                "tools": request.params.get("tools")},
                               request.n_messages, request.entry.context_window,
                               request.has_images, count)

    def progress(self):
        """Usage so far, for the lease renewer: no backend call (its tokenizer may be busy);
        the model's local tokenizer when it has one, so that a generation the sweeper bills
        (its worker lost) is counted as its settlement would have counted it."""
        if self.usage is not None or not self.exchange.accepted or self.meter.refused:
            return self.usage
        text = self.meter.text()
        counted = self._local_count(text) if text else None
        return Usage(prompt=self._own_prompt(self._local_count),
                     completion=max(counted or 0, self.meter.generated), estimated=True)

    # -- settlement ----------------------------------------------------------------------------

    def settle(self, outcome):
        """Hand the outcome to the ledger (it commits it, retrying until it does), then count
        and log it. Anything billed above the hold is an anomaly: counted and logged."""
        usage = self.final_usage()
        cost = cost_nanos(usage, self.request.entry.pricing)
        cap, model = self.request.completion_cap, self.request.entry.id
        # The backend generated past the cap it was sent (Kiln cut it), or reported more than
        # Kiln held for: either way it did not keep to the length it was given.
        anomaly = (self.meter.cut or cost > self.hold_nanos or usage.completion > cap
                   or usage.contradicted)
        if anomaly:
            self.services.metrics.anomalies.labels(model).inc()
            log.warning(json.dumps({"event": "usage_anomaly", "generation_id": self.gid,
                                    "backend": self.exchange.backend.url,
                                    "hold_nanos": self.hold_nanos, "cost_nanos": cost,
                                    "completion_tokens": usage.completion,
                                    "completion_cap": cap}))
        settlement = Settlement(
            gid=self.gid, org_id=self.principal.org_id, key_id=self.principal.key_id,
            model=model, stream=self.request.stream, status=outcome.status.value, usage=usage,
            cost_nanos=cost, http_status=outcome.http_status, error=outcome.message,
            error_code=outcome.code, backend=self.exchange.backend.url,
            attempts=self.exchange.attempts, anomaly=anomaly, started_at=self.started_at,
            first_token_at=self.first_token_at)
        if self.services.ledger.settle(settlement, wait_s=self._settle_wait_s(outcome, cost)) \
                and settlement.debited is not None:
            cost = settlement.debited  # less only if the org could not cover an anomaly
        self.charged_usd = from_nanos(cost)
        self._observe(outcome, usage, cost)

    def _settle_wait_s(self, outcome, cost):
        """How long the answer waits for the settlement's commit.

        A completed answer's last bytes leave without waiting: the cost they tell is the one
        debited, since a cost within the hold is always covered. A cost above the hold (the
        balance may not cover it all) waits to learn the debit; an error waits so that its slot
        is free when the client retries; every answer waits when the operator asks
        (KILN_SETTLE_BEFORE_ANSWER); none when nobody is left to read it.
        """
        config = self.services.config
        wait = (outcome.status is not Status.COMPLETED or cost > self.hold_nanos
                or config.settle_before_answer) and outcome.status is not Status.CLIENT_CANCELLED
        return config.settle_wait_s if wait else 0

    def _observe(self, outcome, usage, cost_nanos):
        m, model = self.services.metrics, self.request.entry.id
        m.in_flight.dec()
        m.child(m.requests, model, outcome.status.value).inc()
        m.child(m.endpoint_requests, self.endpoint, model, outcome.status.value).inc()
        m.child(m.endpoint_tokens, self.endpoint, model, "prompt").inc(usage.prompt)
        m.child(m.endpoint_tokens, self.endpoint, model, "completion").inc(usage.completion)
        m.child(m.tokens, model, "prompt").inc(usage.prompt)
        m.child(m.tokens, model, "completion").inc(usage.completion)
        m.child(m.cost, model).inc(float(from_nanos(cost_nanos)))
        if self.first_token_s is not None:
            m.child(m.ttft, model).observe(self.first_token_s)
        elapsed_s = time.monotonic() - self.started if self.request.stream else 0
        fleet.observe(m, self.exchange.route, outcome.status.value, outcome.code,
                      self.first_token_s, usage.completion, elapsed_s)
        if self.services.config.log_requests:
            log.info(orjson.dumps(self._log_record(outcome, usage, cost_nanos)).decode())

    def _log_record(self, outcome, usage, cost_nanos):
        # No error text: a backend's message can quote the prompt (a 422 ``detail`` echoes the
        # input). The usage event keeps the text; the log says only that there was one.
        return {"event": "generation", "generation_id": self.gid,
                "org_id": self.principal.org_id, "key_prefix": self.principal.key_prefix,
                "client_addr": self.client_addr, "model": self.request.entry.id,
                "backend": self.exchange.backend.url, "stream": self.request.stream,
                "status": outcome.status.value, "http_status": outcome.http_status,
                "prompt_tokens": usage.prompt, "cached_tokens": usage.cached,
                "completion_tokens": usage.completion, "estimated": usage.estimated,
                "prompt_counted_by": usage.prompt_by, "completion_counted_by": usage.completion_by,
                "cost_usd": str(from_nanos(cost_nanos)), "ttft_ms": _ms(self.first_token_s),
                "duration_ms": _ms(time.monotonic() - self.started),
                "has_error": outcome.message is not None, "code": outcome.code}


def _new_gid():
    return "gen-" + secrets.token_hex(12)


def _ms(seconds):
    return None if seconds is None else round(seconds * 1000, 1)
