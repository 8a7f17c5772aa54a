"""Tracing's two sides in process (docs/TRACES.md): off, a generation goes through the null
handle and OpenTelemetry is never imported; on, the same request exports its spans. The null
handle and the real one answer the same calls; the endpoint comes from Kiln's setting or the
standard OpenTelemetry variable."""
import inspect
import json
import os
import subprocess
import sys

import pytest

from gateway.backends.spans import NO_SPANS, NoSpans, _NoTry
from gateway.config import Config
from gateway.ops.otel import RequestSpans, _Try
from gateway_proc import ROOT
from otlp_collector import OtlpCollector

pytestmark = pytest.mark.unit

# One generation through an in-process Kiln (its backend unreachable: admitted, tried, settled
# as a 502), then the OpenTelemetry modules loaded, as JSON.
ONE_REQUEST = """
import json, sys, tempfile
import factories
settings = json.loads(sys.argv[1])
app, engine = factories.sqlite_app(tempfile.mkdtemp(), factories.CATALOG.format(
    url=factories.UNREACHABLE_BACKEND), probe_interval_s=0, upstream_retries=0, **settings)
org = factories.org(engine)
resp = app.test_client().post("/v1/chat/completions", json=factories.chat_body(),
                              headers=org.headers)
resp.close()  # as a server does: the request's span ends with its body
tracing = app.extensions.get("kiln.tracing")
if tracing is not None:
    tracing.stop()
print(json.dumps({"status": resp.status_code,
                  "generation": resp.headers.get("X-Neocloud-Generation-Id"),
                  "otel": sorted(m for m in sys.modules if m.startswith("opentelemetry"))}))
"""


def one_request(**settings):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "KILN_"))}
    env["PYTHONPATH"] = str(ROOT / "tests" / "support")
    out = subprocess.run([sys.executable, "-c", ONE_REQUEST, json.dumps(settings)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_with_tracing_off_a_generation_imports_no_opentelemetry():
    result = one_request()
    assert result["status"] == 502 and result["generation"].startswith("gen-")
    assert result["otel"] == []


def test_with_tracing_on_the_same_generation_exports_its_spans():
    with OtlpCollector() as collector:
        result = one_request(otel_endpoint=collector.endpoint)
        assert result["status"] == 502
        assert "opentelemetry.sdk.trace" in result["otel"]
        spans = collector.wait_for(lambda spans: len(spans) >= 4 and spans)
    names = {s.name for s in spans}
    assert {"POST /v1/chat/completions", "kiln.admission", "chat upstream-fake",
            "kiln.settlement"} <= names
    (server,) = [s for s in spans if s.kind == "server"]
    assert server.attributes["kiln.generation_id"] == result["generation"]
    assert server.attributes["error.type"] == "upstream_error" and server.status == "error"
    (attempt,) = [s for s in spans if s.kind == "client"]
    assert attempt.attributes["kiln.backend.outcome"] == "upstream_unreachable"
    assert attempt.parent_id == server.span_id


def methods(cls):
    return {name: list(inspect.signature(member).parameters)
            for name, member in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_")}


@pytest.mark.parametrize("null,real", [(NoSpans, RequestSpans), (_NoTry, _Try)])
def test_the_null_handle_answers_every_call_the_flow_makes_as_the_real_one_does(null, real):
    """Every call of the interface (the null handle's methods) has the same parameters on the
    real handle; the real one's ``finish`` is the middleware's own."""
    real_methods = methods(real)
    for name, parameters in methods(null).items():
        assert real_methods.get(name) == parameters, name
    assert set(real_methods) - set(methods(null)) <= {"finish"}
    assert getattr(null, "recording", False) is False


def test_the_null_handle_does_nothing():
    assert NO_SPANS.recording is False
    with NO_SPANS.span("kiln.admission"):
        pass
    attempt = NO_SPANS.backend_try(object())
    assert attempt.headers() is None
    attempt.end(error=ValueError())


def test_the_endpoint_is_kilns_setting_else_the_standard_variable(monkeypatch):
    monkeypatch.delenv("KILN_OTEL_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert Config.from_mapping().otel_endpoint == ""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert Config.from_mapping().otel_endpoint == "http://collector:4318"
    monkeypatch.setenv("KILN_OTEL_ENDPOINT", "http://kiln-collector:4318")
    assert Config.from_mapping().otel_endpoint == "http://kiln-collector:4318"
    assert Config.from_mapping({"otel_endpoint": ""}).otel_endpoint == ""
