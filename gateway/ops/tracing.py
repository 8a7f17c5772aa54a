"""OpenTelemetry traces of Kiln's requests (docs/TRACES.md), off unless an OTLP endpoint is set
(``KILN_OTEL_ENDPOINT``, else the standard ``OTEL_EXPORTER_OTLP_ENDPOINT``).

When on, :func:`install` wraps the WSGI app in :class:`gateway.ops.otel.TracingMiddleware`;
each worker process starts its own tracer provider after gunicorn forks (:func:`start_worker`,
from ``post_worker_init``) and flushes it when it exits (:func:`stop_worker`). When off, this
module is all that is imported: :mod:`gateway.ops.otel` and the OpenTelemetry packages (the
``otel`` extra) never are, and every request goes through the null handle of
:mod:`gateway.backends.spans`.
"""


def install(app, config):
    """Trace ``app``'s requests when ``config.otel_endpoint`` is set; return its
    :class:`gateway.ops.otel.Tracing`, or None (tracing off: the app is left as it is).

    :raises ImportError: tracing is on and the ``otel`` extra is not installed.
    """
    if not config.otel_endpoint:
        return None
    from flask import request

    from .otel import ENVIRON_KEY, Tracing, TracingMiddleware
    tracing = Tracing(config.otel_endpoint, config.otel_service_name)
    app.wsgi_app = TracingMiddleware(app.wsgi_app, tracing)
    app.extensions["kiln.tracing"] = tracing

    @app.before_request
    def _note_route():
        spans = request.environ.get(ENVIRON_KEY)
        if spans is not None and request.url_rule is not None:
            spans.route = request.url_rule.rule
    return tracing


def start_worker(app):
    """Start tracing in this worker (gunicorn's ``post_worker_init``), if ``app`` traces (an
    app that is not Kiln's, served under the same gunicorn config, has no extensions)."""
    tracing = getattr(app, "extensions", {}).get("kiln.tracing")
    if tracing is not None:
        tracing.start()


def stop_worker(app):
    """Flush and stop this worker's tracing (gunicorn's ``worker_exit``), if ``app`` traces."""
    tracing = getattr(app, "extensions", {}).get("kiln.tracing")
    if tracing is not None:
        tracing.stop()
