"""Prometheus metrics, correct across gunicorn workers (prometheus-client multiprocess mode),
and the log line of a request that never became a generation.

Multiprocess mode is on when ``PROMETHEUS_MULTIPROC_DIR`` is set before the app is imported
(``deploy/gunicorn.conf.py`` does it); otherwise the app's own registry is served.

What is counted where: admitted requests (generations) are counted and logged once, at
settlement (:meth:`gateway.flow.generation.Generation.settle`); every error response sent is
counted here by HTTP status and envelope ``code``; every request that got no generation id (auth,
validation, 402, 429, maintenance, ``/v1/models``, ...) is logged here as one JSON line.
"""
import json
import logging
import os
import time

from flask import Blueprint, Response, current_app, g, request
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess
from prometheus_client.exposition import choose_encoder

from ..errors import GENERATION_HEADER

log = logging.getLogger("kiln.requests")
bp = Blueprint("metrics", __name__)

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
DB_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class Metrics:
    """The gateway's collectors, registered on a registry of their own (one per app)."""

    def __init__(self):
        self._children = {}
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kiln_requests_total",
                                "Generations of every endpoint by model and final status",
                                ["model", "status"], registry=r)
        # The same generations by the API the client called (a codec's name: chat, messages,
        # responses, completions, embeddings); the series above keep their names and labels.
        self.endpoint_requests = Counter("kiln_endpoint_requests_total",
                                         "Generations by endpoint, model and final status",
                                         ["endpoint", "model", "status"], registry=r)
        self.endpoint_tokens = Counter("kiln_endpoint_tokens_total",
                                       "Tokens metered by endpoint, model and kind",
                                       ["endpoint", "model", "kind"], registry=r)
        self.errors = Counter("kiln_errors_total", "Error responses by HTTP status and code",
                              ["http_status", "code"], registry=r)
        self.in_flight = Gauge("kiln_in_flight", "Admitted requests not yet settled",
                               multiprocess_mode="livesum", registry=r)
        self.tokens = Counter("kiln_tokens_total", "Tokens metered by model and kind",
                              ["model", "kind"], registry=r)
        self.cost = Counter("kiln_cost_usd_total", "USD debited by model", ["model"], registry=r)
        self.ttft = Histogram("kiln_time_to_first_token_seconds", "Admission to first token",
                              ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.upstream_latency = Histogram("kiln_upstream_latency_seconds",
                                          "Request sent to the backend's answer (status line "
                                          "or failure)",
                                          ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.admission = Histogram("kiln_admission_seconds", "Admission transaction time",
                                   buckets=DB_BUCKETS_S, registry=r)
        self.settlement = Histogram("kiln_settlement_seconds",
                                    "Settlement transaction time (one batch)",
                                    buckets=DB_BUCKETS_S, registry=r)
        self.settlement_batch = Histogram("kiln_settlement_batch_size",
                                          "Generations settled per transaction",
                                          buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.settlements_refused = Counter(
            "kiln_settlements_refused_total",
            "Settlements the database refused for their values, even within the columns' "
            "ranges: left to the sweeper", registry=r)
        self.background_restarts = Counter(
            "kiln_background_restarts_total",
            "Background greenlets (ledger writers, sweeper, prober) restarted after a failure",
            ["name"], registry=r)
        self.anomalies = Counter("kiln_usage_anomalies_total",
                                 "Generations whose backend reported more than Kiln held for",
                                 ["model"], registry=r)
        # A count Kiln asked a tokenizer for and did not get (the backend's tokenize endpoint
        # failed or was late; a local tokenizer file could not be built): the bound applied.
        self.tokenize_failures = Counter(
            "kiln_tokenize_failures_total",
            "Token counts a tokenizer did not answer (the upward bound was billed instead), by "
            "model and reason", ["model", "reason"], registry=r)
        self._webhook_collectors(r)
        self._backend_collectors(r)

    def _webhook_collectors(self, r):
        """Webhook deliveries (docs/WEBHOOKS.md), by event type."""
        self.webhooks_delivered = Counter("kiln_webhooks_delivered_total",
                                          "Webhook events delivered (a 2xx answer)",
                                          ["event"], registry=r)
        self.webhooks_failed = Counter("kiln_webhooks_failed_total",
                                       "Webhook events given up after their last attempt",
                                       ["event"], registry=r)
        self.webhook_attempts_failed = Counter(
            "kiln_webhook_attempts_failed_total",
            "Webhook delivery attempts that failed and will be tried again", ["event"],
            registry=r)
        self.webhook_outbox_depth = Gauge("kiln_webhook_outbox_depth",
                                          "Webhook events waiting for delivery (pending)",
                                          multiprocess_mode="livemax", registry=r)

    def _backend_collectors(self, r):
        """Per-backend series (docs/ROUTING.md): ``backend`` is the catalog URL."""
        labels = ["model", "backend"]
        self.backend_requests = Counter("kiln_backend_requests_total",
                                        "Tries sent to a backend (retries included)", labels,
                                        registry=r)
        self.backend_errors = Counter("kiln_backend_errors_total",
                                      "Failed tries by kind (the error code)",
                                      labels + ["kind"], registry=r)
        self.backend_in_flight = Gauge("kiln_backend_in_flight", "Requests a backend is serving",
                                       labels, multiprocess_mode="livesum", registry=r)
        self.backend_ttft = Histogram("kiln_backend_time_to_first_token_seconds",
                                      "Admission to first token, by the backend that served",
                                      labels, buckets=LATENCY_BUCKETS_S, registry=r)
        self.backend_tokens_per_s = Histogram(
            "kiln_backend_tokens_per_second", "Completion tokens per second after the first",
            labels, buckets=(1, 5, 10, 25, 50, 100, 200, 400, 800), registry=r)
        self.backend_state = Gauge("kiln_backend_state", "Circuit breaker: 0 closed, "
                                   "1 half-open, 2 open (the worst worker's view)", labels,
                                   multiprocess_mode="livemax", registry=r)

    def child(self, metric, *labels):
        """Return ``metric.labels(*labels)``, looked up once (the hot path asks per request)."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found


@bp.get("/metrics")
def metrics_view():
    """Serve the metrics (all workers' values when multiprocess) in the format the scraper
    asks for in ``Accept``: Prometheus text, or OpenMetrics."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    else:
        registry = current_app.extensions["kiln.metrics"].registry
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    # content_type, not mimetype: the type already names its charset.
    return Response(encode(registry), content_type=content_type)


# Probes and scrapes would drown the request log.
UNLOGGED_PATHS = frozenset({"/metrics", "/healthz", "/readyz"})
# The answer of a generation whose client left: nobody receives it, and the generation is
# counted and logged (``client_cancelled``) at its settlement already.
CLIENT_GONE = 499


@bp.before_app_request
def _start_clock():
    g.kiln_started_s = time.monotonic()


@bp.after_app_request
def _observe_response(response):
    """Count an error response by status and code; log a request that got no generation."""
    if response.status_code == CLIENT_GONE:
        return response
    if response.status_code >= 400:
        current_app.extensions["kiln.metrics"].errors.labels(
            str(response.status_code), error_code(response)).inc()
    if (GENERATION_HEADER not in response.headers and request.path not in UNLOGGED_PATHS
            and current_app.config["KILN"].log_requests):
        log.info(json.dumps(request_record(response)))
    return response


def error_code(response):
    """Return the error's ``code``: as raised (also for plain-text 502s), else from the JSON
    envelope, else ``"none"``."""
    code = g.get("kiln_error_code")
    if code is None and response.is_json:
        envelope = response.get_json(silent=True)
        if isinstance(envelope, dict) and isinstance(envelope.get("error"), dict):
            code = envelope["error"].get("code")
    return str(code or "none")


def request_record(response):
    """Return the log record of a request that got no generation: who, what, outcome, time.

    Never the key (only its display prefix) and never the body.
    """
    principal = g.get("principal")
    started = g.get("kiln_started_s")
    return {"event": "request", "method": request.method, "path": request.path[:200],
            "http_status": response.status_code,
            "code": error_code(response) if response.status_code >= 400 else None,
            "org_id": getattr(principal, "org_id", None),
            "key_prefix": getattr(principal, "key_prefix", None),
            "client_addr": request.environ.get("kiln.client_addr"),
            "duration_ms": None if started is None else round(
                (time.monotonic() - started) * 1000, 1)}
