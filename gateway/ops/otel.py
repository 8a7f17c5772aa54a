"""Kiln's spans with OpenTelemetry (docs/TRACES.md); imported only when tracing is on
(:mod:`gateway.ops.tracing`).

:class:`TracingMiddleware` gives every request a server span, continuing an incoming W3C
``traceparent`` (W3C Trace Context, Level 1), and a :class:`RequestSpans` handle in ``environ``
that the flow and the backend traffic use for the spans under it (:mod:`gateway.backends.spans`).

A request's spans are recorded as plain values while it runs (a name, ids, two timestamps, a
dict of attributes: a few microseconds each) and become the SDK's ``ReadableSpan`` objects only
when the request ends and its trace is kept: the SDK's live spans cost tens of microseconds each
(a sampler call, locks, bounded attribute maps) on every request, sampled or not, and the
exporter needs only the finished ones (``SpanProcessor.on_end``). What the SDK is used for: the
resource, the sampler (its decision taken once per request, at the server span, as the SDK's
tracer would), the W3C propagator, the span ids (``RandomIdGenerator``), and the
``BatchSpanProcessor`` with the OTLP/HTTP (protobuf) exporter, per worker process, made after
gunicorn forks and flushed when the worker exits.

Which traces are exported (docs/TRACES.md, "Sampling"): those the sampler samples, set by the
standard ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``; unset, Kiln's default is
``parentbased_traceidratio`` at :data:`DEFAULT_SAMPLE_RATIO` (a caller's sampled flag is
followed either way); and, whatever the ratio, every request that failed, unless a caller's
``traceparent`` said not to sample it (the OpenTelemetry Collector's tail sampling keeps errors
the same way: its ``tail_sampling`` processor's ``status_code`` policy).

Attribute names follow the OpenTelemetry semantic conventions: HTTP server and client spans
(``http.request.method``, ``http.route``, ``http.response.status_code``, ``server.address``,
``error.type``) and the GenAI ones (``gen_ai.*``, set by :mod:`gateway.flow.traces`). No
attribute carries a prompt, a completion, a message or a key: only ids, names, counts, codes.
"""
import functools
import os
from time import time_ns
from urllib.parse import urlsplit

from opentelemetry import propagate
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode,
                                 TraceFlags, get_current_span, set_span_in_context)

from ..backends.client import ClientGone
from ..backends.spans import ENVIRON_KEY

TRACES_PATH = "/v1/traces"  # OTLP/HTTP: the traces signal's path under the endpoint
TRACER_NAME = "kiln.gateway"
ERROR_TYPE = "error.type"
OPERATION = "gen_ai.operation.name"
CLIENT_LEFT = (ClientGone, GeneratorExit)  # how a span's block ends when its client left
# The share of requests whose traces are exported when OTEL_TRACES_SAMPLER is unset (failed
# requests are exported whatever it is): bench/tracing.py measures what each share costs.
DEFAULT_SAMPLE_RATIO = 0.1
# Spans per export: the export encodes its batch in the worker's event loop (the batch
# processor's thread is a greenlet under gevent), ~40 us a span, so a smaller batch than the
# SDK's 512 keeps other requests' streams from waiting ~20 ms on it. OTEL_BSP_MAX_EXPORT_BATCH_SIZE
# overrides it.
EXPORT_BATCH_SPANS = 64
SAMPLED = TraceFlags(TraceFlags.SAMPLED)
NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
UNSET = Status(StatusCode.UNSET)
SCOPE = InstrumentationScope(TRACER_NAME)
__all__ = ["ENVIRON_KEY", "RequestSpans", "Tracing", "TracingMiddleware"]


class Tracing:
    """This app's tracing: where spans go, and this process's sampler and batch processor.

    :param endpoint: the OTLP/HTTP base URL (``http://collector:4318``); spans are POSTed to
        ``{endpoint}/v1/traces``, as the OTLP exporter specification builds it from
        ``OTEL_EXPORTER_OTLP_ENDPOINT``.
    :param service_name: the resource's ``service.name``.
    """

    def __init__(self, endpoint, service_name):
        self.endpoint, self.service_name = endpoint, service_name
        self.provider = self.processor = self.propagator = None
        self.sampler = self.ids = self.resource = None
        self._pid = None

    def start(self):
        """Make this process's provider and batch processor, unless it has them. A worker
        forked from a process that had one makes its own (a batch processor's thread does not
        survive a fork)."""
        if self._pid == os.getpid():
            return self
        sampler = None
        if not os.environ.get("OTEL_TRACES_SAMPLER"):
            sampler = ParentBased(TraceIdRatioBased(DEFAULT_SAMPLE_RATIO))
        # The provider reads OTEL_TRACES_SAMPLER when no sampler is given (the SDK's rule).
        provider = TracerProvider(resource=Resource.create({"service.name": self.service_name}),
                                  sampler=sampler)
        batch = None if os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE") else EXPORT_BATCH_SPANS
        processor = BatchSpanProcessor(
            OTLPSpanExporter(endpoint=self.endpoint.rstrip("/") + TRACES_PATH),
            max_export_batch_size=batch)
        provider.add_span_processor(processor)
        self.provider, self.processor = provider, processor
        self.sampler, self.ids, self.resource = (provider.sampler, provider.id_generator,
                                                 provider.resource)
        self.propagator = propagate.get_global_textmap()  # W3C tracecontext and baggage
        self._pid = os.getpid()
        return self

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
        tracing = self.tracing.start()
        context = tracing.propagator.extract(environ, getter=ENVIRON_GETTER)
        spans = environ[ENVIRON_KEY] = RequestSpans(tracing, context, environ)

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


class _Record:
    """One span while its request runs: plain values, made a ``ReadableSpan`` only if kept."""

    __slots__ = ("name", "span_id", "kind", "start", "end", "attributes", "events", "error")

    def __init__(self, name, span_id, kind, attributes):
        self.name, self.span_id, self.kind = name, span_id, kind
        self.attributes = dict(attributes) if attributes else {}
        self.events, self.error, self.end = [], None, None
        self.start = time_ns()

    def fail(self, error):
        self.attributes[ERROR_TYPE] = self.error = str(error)

    def readable(self, tracing, trace_id, trace_state, parent, end):
        return ReadableSpan(
            self.name, context=SpanContext(trace_id, self.span_id, False, SAMPLED, trace_state),
            parent=parent, resource=tracing.resource, attributes=self.attributes,
            events=tuple(Event(name, timestamp=ts) for name, ts in self.events), kind=self.kind,
            status=UNSET if self.error is None else Status(StatusCode.ERROR, self.error),
            start_time=self.start, end_time=self.end or end, instrumentation_scope=SCOPE)


class RequestSpans:
    """One traced request's spans (the handle :mod:`gateway.backends.spans` describes).

    Every span has the request's as its parent, given explicitly: the backend is called from a
    greenlet of its own, with no ambient context. A request whose trace is not sampled is still
    recorded (it is exported if it fails) and still passes its trace on to the backend, marked
    not sampled (W3C Trace Context, ``trace-flags``).

    :param tracing: the started :class:`Tracing`.
    :param context: the OpenTelemetry context extracted from the request's headers.
    :param environ: the request's WSGI environ.
    """

    recording = True  # every request is recorded; which are exported is decided at the end

    def __init__(self, tracing, context, environ):
        self.tracing, self.context = tracing, context
        caller = get_current_span(context).get_span_context()
        self.caller = caller if caller.is_valid else None
        self.trace_id = caller.trace_id if self.caller else tracing.ids.generate_trace_id()
        method = self.method = environ.get("REQUEST_METHOD", "GET")
        decision = tracing.sampler.should_sample(context, self.trace_id, method, SpanKind.SERVER)
        self.sampled = decision.decision.is_sampled()
        self.trace_state = decision.trace_state
        self.root = _Record(method, tracing.ids.generate_span_id(), SpanKind.SERVER, {
            "http.request.method": method, "url.path": environ.get("PATH_INFO", "/"),
            "url.scheme": environ.get("wsgi.url_scheme", "http")})
        self.route = self.http_status = self.operation = None
        self.response_id = self.response_model = None
        self.finish_reasons = []
        self._records = []  # the internal and client spans, in the order they started
        self._open = []  # the internal spans open now, innermost last
        self._ended = False

    def span(self, name, attributes=None):
        """An internal span under the request's, as a context manager."""
        return _Internal(self, name, attributes)

    def backend_try(self, backend):
        """Start the client span of one try of ``backend``; return its :class:`_Try`."""
        operation = self.operation or "chat"
        attributes = {OPERATION: operation, "gen_ai.provider.name": "openai",
                      "gen_ai.system": "openai", "gen_ai.request.model": backend.model,
                      "kiln.backend": backend.url, "kiln.backend.server": backend.server}
        attributes.update(_server_of(backend.url))
        record = _Record(f"{operation} {backend.model}", self.tracing.ids.generate_span_id(),
                         SpanKind.CLIENT, attributes)
        self._records.append(record)
        return _Try(self, record)

    def event(self, name):
        """Add event ``name`` to the innermost open span (else the request's)."""
        (self._open[-1] if self._open else self.root).events.append((name, time_ns()))

    def note_reply(self, obj):
        """Note a reply's (or stream chunk's) id, model and finish reasons: nothing else."""
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
        self.root.attributes.update(attributes)

    def finish(self, exc=None):
        """End the request's span (once): its route, status and what the replies told; export
        the request's spans if its trace is kept (the module's docstring says which are)."""
        if self._ended:
            return
        self._ended = True
        root = self.root
        root.end = time_ns()
        attrs = root.attributes
        if self.route is not None:  # the HTTP conventions' span name: "{method} {route}"
            attrs["http.route"] = self.route
            root.name = f"{self.method} {self.route}"
        if self.http_status is not None:
            attrs["http.response.status_code"] = self.http_status
        if self.response_id is not None:
            attrs["gen_ai.response.id"] = self.response_id
        if self.response_model is not None:
            attrs["gen_ai.response.model"] = self.response_model
        if self.finish_reasons:
            attrs["gen_ai.response.finish_reasons"] = self.finish_reasons
        failed = attrs.get(ERROR_TYPE) or (type(exc).__name__ if exc is not None else None) or (
            str(self.http_status) if (self.http_status or 0) >= 500 else None)
        if failed:
            root.fail(failed)
        if self.sampled or (failed and not (self.caller and self.caller.is_remote)):
            self._export()

    def _export(self):
        tracing, trace_id, state, end = self.tracing, self.trace_id, self.trace_state, self.root.end
        on_end = tracing.processor.on_end
        on_end(self.root.readable(tracing, trace_id, state, self.caller, end))
        parent = SpanContext(trace_id, self.root.span_id, False, SAMPLED, state)
        for record in self._records:
            on_end(record.readable(tracing, trace_id, state, parent, end))


class _Internal:
    """An internal span under the request's, open for a ``with`` block."""

    __slots__ = ("spans", "name", "attributes", "record")

    def __init__(self, spans, name, attributes):
        self.spans, self.name, self.attributes = spans, name, attributes

    def __enter__(self):
        spans = self.spans
        self.record = _Record(self.name, spans.tracing.ids.generate_span_id(), SpanKind.INTERNAL,
                              self.attributes)
        spans._records.append(self.record)
        spans._open.append(self.record)
        return self.record

    def __exit__(self, kind, exc, tb):
        record = self.record
        self.spans._open.remove(record)
        if kind is not None and issubclass(kind, CLIENT_LEFT):
            record.attributes["kiln.client_gone"] = True  # the client's doing, no error
        elif kind is not None:
            # The type (or the gateway's code) only: an error's message may quote a backend's
            # answer, which may quote the prompt.
            record.fail(getattr(exc, "code", None) or kind.__name__)
        record.end = time_ns()
        return False


class _Try:
    """The client span of one backend try."""

    __slots__ = ("spans", "record")

    def __init__(self, spans, record):
        self.spans, self.record = spans, record

    def headers(self):
        """The W3C Trace Context headers to send the backend: this try's span as the parent,
        the trace's sampled flag, the caller's ``tracestate`` and baggage."""
        spans = self.spans
        span = NonRecordingSpan(SpanContext(spans.trace_id, self.record.span_id, False,
                                            SAMPLED if spans.sampled else NOT_SAMPLED,
                                            spans.trace_state))
        carrier = {}
        spans.tracing.propagator.inject(carrier, context=set_span_in_context(span, spans.context))
        return carrier

    def end(self, error=None, status=None):
        """End the try (once): answered with HTTP ``status``, or failed with ``error`` (a
        gateway error's code, else its type, as ``error.type`` and ``kiln.backend.outcome``)."""
        record = self.record
        if record.end is not None:
            return
        if status is not None:
            record.attributes["http.response.status_code"] = status
        if error is None:
            record.attributes["kiln.backend.outcome"] = "answered"
        else:
            kind = str(getattr(error, "code", None) or type(error).__name__)
            record.attributes["kiln.backend.outcome"] = kind
            record.fail(kind)
        record.end = time_ns()


@functools.lru_cache(maxsize=256)
def _server_of(url):
    """``server.address`` and ``server.port`` of a backend's base URL."""
    parts = urlsplit(url)
    out = {"server.address": parts.hostname or ""}
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    if port:
        out["server.port"] = port
    return out
