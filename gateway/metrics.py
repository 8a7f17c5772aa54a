"""Prometheus metrics, correct across gunicorn workers (prometheus-client multiprocess mode).

Multiprocess mode is on when ``PROMETHEUS_MULTIPROC_DIR`` is set before the app is imported
(``deploy/gunicorn.conf.py`` does it); otherwise the app's own registry is served.
"""
import os

from flask import Blueprint, Response, current_app
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest, multiprocess)

bp = Blueprint("metrics", __name__)

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
DB_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class Metrics:
    """The gateway's collectors, registered on a registry of their own (one per app)."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("kiln_requests_total", "Chat requests by model and final status",
                                ["model", "status"], registry=r)
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
                                          "Request sent to upstream status line",
                                          ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.admission = Histogram("kiln_admission_seconds", "Admission transaction time",
                                   buckets=DB_BUCKETS_S, registry=r)
        self.settlement = Histogram("kiln_settlement_seconds", "Settlement transaction time",
                                    buckets=DB_BUCKETS_S, registry=r)


@bp.get("/metrics")
def metrics_view():
    """Serve the metrics in the Prometheus text format (all workers' values when multiprocess)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    else:
        registry = current_app.extensions["kiln.metrics"].registry
    return Response(generate_latest(registry), mimetype=CONTENT_TYPE_LATEST)
