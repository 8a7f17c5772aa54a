"""A small OTLP/HTTP collector for tests: accepts ``POST /v1/traces`` (protobuf), decodes each
``ExportTraceServiceRequest`` with ``opentelemetry-proto`` and keeps its spans, plainly:
name, kind, ids (hex), parent id, attributes (Python values), events, status, resource.

    with OtlpCollector() as collector:      # collector.endpoint: the base URL to export to
        ...
        spans = collector.wait_for(lambda spans: ...)
"""
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto
from opentelemetry.proto.trace.v1.trace_pb2 import Status as StatusProto

KINDS = {SpanProto.SPAN_KIND_SERVER: "server", SpanProto.SPAN_KIND_CLIENT: "client",
         SpanProto.SPAN_KIND_INTERNAL: "internal", SpanProto.SPAN_KIND_PRODUCER: "producer",
         SpanProto.SPAN_KIND_CONSUMER: "consumer"}
STATUSES = {StatusProto.STATUS_CODE_UNSET: "unset", StatusProto.STATUS_CODE_OK: "ok",
            StatusProto.STATUS_CODE_ERROR: "error"}


@dataclass
class Span:
    """One exported span."""

    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    attributes: dict
    events: list  # [(name, time in ns)]
    status: str
    start_ns: int
    end_ns: int
    resource: dict = field(default_factory=dict)


def value_of(any_value):
    """An OTLP ``AnyValue`` as a Python value (lists for arrays)."""
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(v) for v in any_value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: value_of(kv.value) for kv in any_value.kvlist_value.values}
    return getattr(any_value, kind) if kind else None


def decode(body):
    """The spans of one ``ExportTraceServiceRequest`` (bytes)."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    out = []
    for resource_spans in request.resource_spans:
        resource = {a.key: value_of(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                out.append(Span(
                    name=s.name, kind=KINDS.get(s.kind, str(s.kind)), trace_id=s.trace_id.hex(),
                    span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex(),
                    attributes={a.key: value_of(a.value) for a in s.attributes},
                    events=[(e.name, e.time_unix_nano) for e in s.events],
                    status=STATUSES.get(s.status.code, str(s.status.code)),
                    start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                    resource=resource))
    return out


class OtlpCollector:
    """An OTLP/HTTP trace receiver on a free loopback port."""

    def __init__(self):
        self.spans, self.lock = [], threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                spans = decode(body)
                with collector.lock:
                    collector.spans.extend(spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def snapshot(self):
        """The spans received so far."""
        with self.lock:
            return list(self.spans)

    def wait_for(self, predicate, timeout_s=20.0):
        """Poll the spans received until ``predicate(spans)`` is truthy; return its value, or
        raise AssertionError (the batch processor exports every few seconds)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate(self.snapshot())
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"spans not received within {timeout_s} s: "
                                     f"{[s.name for s in self.snapshot()]}")
            time.sleep(0.05)

    def trace(self, trace_id):
        """The spans of one trace, by name: ``{name: [Span, ...]}``."""
        out = {}
        for span in self.snapshot():
            if span.trace_id == trace_id:
                out.setdefault(span.name, []).append(span)
        return out
