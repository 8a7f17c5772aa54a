"""Kiln's spans with OpenTelemetry (docs/TRACES.md); imported only when tracing is on
(:mod:`gateway.ops.tracing`).

:class:`TracingMiddleware` gives every request a server span, continuing an incoming W3C
``traceparent`` (W3C Trace Context, Level 1), and a :class:`RequestSpans` handle in ``environ``
that the flow and the backend traffic use for the spans under it (:mod:`gateway.backends.spans`).
Each worker process has its own tracer provider (:class:`Tracing`), made after gunicorn forks,
with a ``BatchSpanProcessor`` exporting over OTLP/HTTP (protobuf), flushed when the worker exits.
The sampler is the SDK's, set by ``OTEL_TRACES_SAMPLER`` (default: parent-based, always on).

Attribute names follow the OpenTelemetry semantic conventions: HTTP server and client spans
(``http.request.method``, ``http.route``, ``http.response.status_code``, ``server.address``,
``error.type``) and the GenAI ones (``gen_ai.*``, set by :mod:`gateway.flow.traces`). No
attribute carries a prompt, a completion, a message or a key: only ids, names, counts, codes.
"""
import functools
import os
from urllib.parse import urlsplit

from opentelemetry import propagate
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

from ..backends.relay import ClientGone
from ..backends.spans import ENVIRON_KEY, NO_SPANS

TRACES_PATH = "/v1/traces"  # OTLP/HTTP: the traces signal's path under the endpoint
TRACER_NAME = "kiln.gateway"
ERROR_TYPE = "error.type"
OPERATION = "gen_ai.operation.name"
CLIENT_LEFT = (ClientGone, GeneratorExit)  # how a span's block ends when its client left
__all__ = ["ENVIRON_KEY", "RequestSpans", "Tracing", "TracingMiddleware"]


class Tracing:
    """This app's tracing: where spans go, and this process's tracer provider.

    :param endpoint: the OTLP/HTTP base URL (``http://collector:4318``); spans are POSTed to
        ``{endpoint}/v1/traces``, as the OTLP exporter specification builds it from
        ``OTEL_EXPORTER_OTLP_ENDPOINT``.
    :param service_name: the resource's ``service.name``.
    """

    def __init__(self, endpoint, service_name):
        self.endpoint, self.service_name = endpoint, service_name
        self.provider = self.tracer = self.propagator = None
        self._pid = None

    def start(self):
        """Make this process's tracer provider, unless it has one; return its tracer. A worker
        forked from a process that had one makes its own (a batch processor's thread does not
        survive a fork)."""
        if self._pid == os.getpid():
            return self.tracer
        provider = TracerProvider(resource=Resource.create({"service.name": self.service_name}))
        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=self.endpoint.rstrip("/") + TRACES_PATH)))
        self.provider, self.tracer = provider, provider.get_tracer(TRACER_NAME)
        self.propagator = propagate.get_global_textmap()  # W3C tracecontext and baggage
        self._pid = os.getpid()
        return self.tracer

    def stop(self, timeout_s=5.0):
        """Export the spans this process still holds, then stop its provider (a worker's exit)."""
        if self._pid != os.getpid() or self.provider is None:
            return
        self.provider.force_flush(int(timeout_s * 1000))
        self.provider.shutdown()
        self._pid = None


class _EnvironGetter:
    """Reads a propagation header (``traceparent``) from a WSGI environ (PEP 3333 ``HTTP_*``)."""

    @staticmethod
    def get(environ, key):
        value = environ.get("HTTP_" + key.upper().replace("-", "_"))
        return None if value is None else [value]

    @staticmethod
    def keys(environ):
        return [k[5:].lower().replace("_", "-") for k in environ if k.startswith("HTTP_")]


ENVIRON_GETTER = _EnvironGetter()


class TracingMiddleware:
    """WSGI middleware: one server span per request, ended when the response's body is closed
    (after a stream's last byte and its settlement)."""

    def __init__(self, app, tracing):
        self.app, self.tracing = app, tracing

    def __call__(self, environ, start_response):
        tracer = self.tracing.start()
        parent = self.tracing.propagator.extract(environ, getter=ENVIRON_GETTER)
        method, path = environ.get("REQUEST_METHOD", "GET"), environ.get("PATH_INFO", "/")
        span = tracer.start_span(method, context=parent, kind=SpanKind.SERVER, attributes={
            "http.request.method": method, "url.path": path,
            "url.scheme": environ.get("wsgi.url_scheme", "http")})
        spans = environ[ENVIRON_KEY] = RequestSpans(tracer, span, self.tracing.propagator,
                                                    method)

        def traced_start_response(status, headers, exc_info=None):
            spans.http_status = int(status.split(" ", 1)[0])
            return start_response(status, headers, exc_info)
        try:
            body = self.app(environ, traced_start_response)
        except BaseException as exc:
            spans.finish(exc)
            raise
        return _Body(body, spans)


class _Body:
    """The app's response body, unchanged; closing it ends the request's span."""

    def __init__(self, body, spans):
        self.body, self.spans = body, spans

    def __iter__(self):
        return iter(self.body)

    def close(self):
        try:
            close = getattr(self.body, "close", None)
            if close is not None:
                close()
        finally:
            self.spans.finish()


class RequestSpans:
    """One traced request's spans (the handle :mod:`gateway.backends.spans` describes).

    Every span is started with an explicit parent, never the ambient context: the backend is
    called from a greenlet of its own, and a greenlet starts with an empty context. A request
    the sampler left out records nothing (:attr:`recording` false) but still passes its trace
    on to the backend, marked not sampled (W3C Trace Context, ``trace-flags``).
    """

    def __init__(self, tracer, root, propagator, method):
        self.tracer, self.root, self.propagator = tracer, root, propagator
        self.recording = root.is_recording()
        self.context = set_span_in_context(root)
        self.method, self.route, self.http_status = method, None, None
        self.operation = None
        self.response_id = self.response_model = None
        self.finish_reasons = []
        self._open = []  # the internal spans open now, innermost last
        self._error_type = None
        self._ended = False

    def span(self, name, attributes=None):
        """An internal span under the request's, as a context manager."""
        return _Internal(self, name, attributes) if self.recording else NO_SPANS.span(name)

    def backend_try(self, backend):
        """Start the client span of one try of ``backend``; return its :class:`_Try`."""
        name = f"{self.operation or 'chat'} {backend.model}"
        attributes = {OPERATION: self.operation or "chat", "gen_ai.provider.name": "openai",
                      "gen_ai.system": "openai", "gen_ai.request.model": backend.model,
                      "kiln.backend": backend.url, "kiln.backend.server": backend.server}
        attributes.update(_server_of(backend.url))
        span = self.tracer.start_span(name, context=self.context, kind=SpanKind.CLIENT,
                                      attributes=attributes)
        return _Try(span, self.propagator)

    def event(self, name):
        """Add event ``name`` to the innermost open span (else the request's)."""
        (self._open[-1] if self._open else self.root).add_event(name)

    def note_reply(self, obj):
        """Note a reply's (or stream chunk's) id, model and finish reasons: nothing else."""
        if not self.recording:
            return
        if self.response_id is None and isinstance(obj.get("id"), str):
            self.response_id = obj["id"]
        if self.response_model is None and isinstance(obj.get("model"), str):
            self.response_model = obj["model"]
        choices = obj.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            reason = choice.get("finish_reason") if isinstance(choice, dict) else None
            if isinstance(reason, str):
                self.finish_reasons.append(reason)

    def set(self, attributes):
        """Set attributes of the request's span; an ``error.type`` among them marks it failed
        (the semantic conventions' rule for an operation that ended in error)."""
        self.operation = attributes.get(OPERATION, self.operation)
        if attributes.get(ERROR_TYPE):
            self._error_type = attributes[ERROR_TYPE]
        self.root.set_attributes(attributes)

    def finish(self, exc=None):
        """End the request's span (once): its route, status and what the replies told."""
        if self._ended:
            return
        self._ended = True
        root = self.root
        if not self.recording:
            return
        if self.route is not None:  # the HTTP conventions' span name: "{method} {route}"
            root.set_attribute("http.route", self.route)
            root.update_name(f"{self.method} {self.route}")
        if self.http_status is not None:
            root.set_attribute("http.response.status_code", self.http_status)
        if self.response_id is not None:
            root.set_attribute("gen_ai.response.id", self.response_id)
        if self.response_model is not None:
            root.set_attribute("gen_ai.response.model", self.response_model)
        if self.finish_reasons:
            root.set_attribute("gen_ai.response.finish_reasons", self.finish_reasons)
        failed = self._error_type or (type(exc).__name__ if exc is not None else None) or (
            str(self.http_status) if (self.http_status or 0) >= 500 else None)
        if failed:
            root.set_attribute(ERROR_TYPE, failed)
            root.set_status(Status(StatusCode.ERROR, failed))
        root.end()


class _Internal:
    """An internal span under the request's, open for a ``with`` block."""

    def __init__(self, spans, name, attributes):
        self.spans, self.name, self.attributes = spans, name, attributes

    def __enter__(self):
        self.span = self.spans.tracer.start_span(self.name, context=self.spans.context,
                                                 attributes=self.attributes)
        self.spans._open.append(self.span)
        return self.span

    def __exit__(self, kind, exc, tb):
        self.spans._open.remove(self.span)
        if kind is not None and issubclass(kind, CLIENT_LEFT):
            self.span.set_attribute("kiln.client_gone", True)  # the client's doing, no error
        elif kind is not None:
            # The type (or the gateway's code) only: an error's message may quote a backend's
            # answer, which may quote the prompt.
            error = getattr(exc, "code", None) or kind.__name__
            self.span.set_attribute(ERROR_TYPE, str(error))
            self.span.set_status(Status(StatusCode.ERROR, str(error)))
        self.span.end()
        return False


class _Try:
    """The client span of one backend try."""

    def __init__(self, span, propagator):
        self.span, self.propagator = span, propagator
        self._ended = False

    def headers(self):
        """The W3C Trace Context headers to send the backend: this try's span as the parent."""
        carrier = {}
        self.propagator.inject(carrier, context=set_span_in_context(self.span))
        return carrier

    def end(self, error=None, status=None):
        """End the try (once): answered with HTTP ``status``, or failed with ``error`` (a
        gateway error's code, else its type, as ``error.type`` and ``kiln.backend.outcome``)."""
        if self._ended:
            return
        self._ended = True
        if status is not None:
            self.span.set_attribute("http.response.status_code", status)
        if error is None:
            self.span.set_attribute("kiln.backend.outcome", "answered")
        else:
            kind = str(getattr(error, "code", None) or type(error).__name__)
            self.span.set_attributes({"kiln.backend.outcome": kind, ERROR_TYPE: kind})
            self.span.set_status(Status(StatusCode.ERROR, kind))
        self.span.end()


@functools.lru_cache(maxsize=256)
def _server_of(url):
    """``server.address`` and ``server.port`` of a backend's base URL."""
    parts = urlsplit(url)
    out = {"server.address": parts.hostname or ""}
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    if port:
        out["server.port"] = port
    return out
