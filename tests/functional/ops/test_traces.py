"""Traces (docs/TRACES.md): a real gateway (gunicorn, gevent workers, Postgres) exporting its
spans over OTLP/HTTP to an in-process collector, against the scripted fake upstream.

Each request's spans and their structure (the server span, admission, each backend try as a
client span, the stream with its first token, the settlement), their attributes checked against
the request's own usage event, an incoming ``traceparent`` continued and passed on to the
backend, and no prompt, completion or key in any span.
"""
import json
import secrets

import pytest
import requests

from factories import chat_body
from fake_upstream import (COMPLETIONS_PATH, EMBEDDINGS_PATH, Hang, Send, Status, chat_chunk,
                           chat_completion, embeddings_list, error_reply, json_reply, make_usage,
                           sse, sse_event, text_completion)
from gateway_proc import Gateway, gateway_env, settled_event
from otlp_collector import OtlpCollector

from gateway.ops.otel import DEFAULT_SAMPLE_RATIO

PROMPT = "the-secret-plum-" + secrets.token_hex(6)  # a prompt no attribute may carry
ANSWER = "a-private-answer-" + secrets.token_hex(6)
GENERATION_HEADER = "X-Neocloud-Generation-Id"


@pytest.fixture(scope="module")
def collector():
    with OtlpCollector() as c:
        yield c


@pytest.fixture(scope="module")
def traced(pg_url, catalog_path, collector):
    """A gateway (one worker) exporting to the collector, batches sent every 50 ms."""
    env = {**gateway_env(pg_url, catalog_path, otel_endpoint=collector.endpoint),
           "OTEL_BSP_SCHEDULE_DELAY": "50"}
    gw = Gateway(env, workers=1).start()
    yield gw
    gw.stop()


def new_traceparent():
    """A W3C ``traceparent`` (version 00, sampled): ``(header, trace id, parent span id)``."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def post(gateway, org, path, body, traceparent=None, stream=False):
    headers = {**org.headers, "Content-Type": "application/json"}
    if traceparent:
        headers["traceparent"] = traceparent
    return requests.post(gateway.base_url + path, data=json.dumps(body), headers=headers,
                         stream=stream, timeout=30)


def request_trace(collector, trace_id, *names):
    """The spans of ``trace_id`` by name, once the server span and every one of ``names`` came."""
    def complete(_spans):
        found = collector.trace(trace_id)
        servers = [s for group in found.values() for s in group if s.kind == "server"]
        return found if servers and all(n in found for n in names) else None
    return collector.wait_for(complete)


def server_span(spans):
    (server,) = [s for group in spans.values() for s in group if s.kind == "server"]
    return server


def check_usage(span, event):
    """The request span's GenAI usage and Kiln's attributes are the usage event's."""
    attrs = span.attributes
    assert attrs["kiln.generation_id"] == event["id"]
    assert attrs["kiln.status"] == event["status"]
    assert attrs["gen_ai.usage.input_tokens"] == event["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == event["completion_tokens"]
    assert attrs["kiln.endpoint"] == event["endpoint"]
    assert attrs["gen_ai.request.model"] == event["model"]


def test_a_stream_continues_the_callers_trace_and_passes_it_to_the_backend(
        traced, collector, fake, org, engine):
    header, trace_id, caller_span = new_traceparent()
    fake.enqueue(sse([chat_chunk(ANSWER[:8], role="assistant", model="upstream-fake",
                                 completion_id="chatcmpl-traced"),
                      chat_chunk(ANSWER[8:], model="upstream-fake",
                                 completion_id="chatcmpl-traced"),
                      chat_chunk(finish_reason="stop", model="upstream-fake",
                                 completion_id="chatcmpl-traced"),
                      chat_chunk(choices=False, usage=make_usage(21, 2), model="upstream-fake",
                                 completion_id="chatcmpl-traced")]))
    resp = post(traced, org, "/v1/chat/completions",
                chat_body(messages=[{"role": "user", "content": PROMPT}], stream=True,
                          max_tokens=64), traceparent=header, stream=True)
    assert resp.status_code == 200 and b"[DONE]" in resp.content
    gid = resp.headers[GENERATION_HEADER]
    event = settled_event(engine, gid)
    spans = request_trace(collector, trace_id, "kiln.admission", "kiln.stream",
                          "kiln.settlement", "chat upstream-fake")

    server = server_span(spans)
    assert server.parent_id == caller_span  # the caller's span is the request's parent
    assert server.name == "POST /v1/chat/completions"
    assert server.attributes["http.route"] == "/v1/chat/completions"
    assert server.attributes["http.response.status_code"] == 200
    assert server.status == "unset"
    assert server.resource["service.name"] == "kiln-gateway"
    check_usage(server, event)
    assert (event["prompt_tokens"], event["completion_tokens"]) == (21, 2)
    attrs = server.attributes
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.provider.name"] == "openai"
    assert attrs["gen_ai.request.max_tokens"] == 64
    assert attrs["gen_ai.response.model"] == "upstream-fake"
    assert attrs["gen_ai.response.id"] == "chatcmpl-traced"
    assert attrs["gen_ai.response.finish_reasons"] == ["stop"]
    assert attrs["kiln.backend"] == event["backend"]

    (attempt,) = spans["chat upstream-fake"]
    assert attempt.kind == "client" and attempt.parent_id == server.span_id
    assert attempt.attributes["kiln.backend"] == event["backend"]
    assert attempt.attributes["kiln.backend.outcome"] == "answered"
    assert attempt.attributes["gen_ai.request.model"] == "upstream-fake"
    assert attempt.attributes["http.response.status_code"] == 200
    # The backend was sent this try's span as its parent, in the caller's trace.
    sent = fake.requests[-1].headers["traceparent"]
    assert sent == f"00-{trace_id}-{attempt.span_id}-01"

    for name in ("kiln.admission", "kiln.stream", "kiln.settlement"):
        (span,) = spans[name]
        assert span.kind == "internal" and span.parent_id == server.span_id, name
        assert span.start_ns >= server.start_ns and span.end_ns <= server.end_ns, name
    (stream,) = spans["kiln.stream"]
    assert [name for name, _ in stream.events] == ["kiln.first_token"]
    first_token_ns = stream.events[0][1]
    assert stream.start_ns <= first_token_ns <= stream.end_ns
    assert spans["kiln.admission"][0].end_ns <= attempt.start_ns
    assert stream.end_ns <= spans["kiln.settlement"][0].start_ns


@pytest.mark.parametrize("path,body,operation,provider,script,upstream_path", [
    ("/v1/chat/completions", chat_body(messages=[{"role": "user", "content": PROMPT}]),
     "chat", "openai", json_reply(chat_completion(ANSWER, make_usage(13, 4))), None),
    ("/v1/messages", {"model": "fake-model", "max_tokens": 40,
                      "messages": [{"role": "user", "content": PROMPT}]},
     "chat", "anthropic", json_reply(chat_completion(ANSWER, make_usage(14, 5))), None),
    ("/v1/responses", {"model": "fake-model", "input": PROMPT, "store": False},
     "chat", "openai", json_reply(chat_completion(ANSWER, make_usage(15, 6))), None),
    ("/v1/completions", {"model": "fake-model", "prompt": PROMPT, "max_tokens": 20},
     "text_completion", "openai", json_reply(text_completion(ANSWER, make_usage(16, 7))),
     COMPLETIONS_PATH),
    ("/v1/embeddings", {"model": "fake-embed", "input": [PROMPT, PROMPT]},
     "embeddings", "openai", json_reply(embeddings_list(2, usage=make_usage(17, 0))),
     EMBEDDINGS_PATH),
], ids=["chat", "messages", "responses", "completions", "embeddings"])
def test_every_endpoint_has_its_request_span_with_the_usage_it_was_billed(
        traced, collector, fake, org, engine, path, body, operation, provider, script,
        upstream_path):
    if upstream_path:
        fake.enqueue(script, upstream_path)
    else:
        fake.enqueue(script)
    header, trace_id, _ = new_traceparent()
    resp = post(traced, org, path, body, traceparent=header)
    assert resp.status_code == 200, resp.text
    event = settled_event(engine, resp.headers[GENERATION_HEADER])
    spans = request_trace(collector, trace_id, "kiln.admission", "kiln.settlement")
    server = server_span(spans)
    check_usage(server, event)
    assert server.attributes["gen_ai.operation.name"] == operation
    assert server.attributes["gen_ai.provider.name"] == provider
    assert server.attributes["http.route"] == path
    (attempt,) = [s for group in spans.values() for s in group if s.kind == "client"]
    assert attempt.parent_id == server.span_id
    assert attempt.attributes["gen_ai.operation.name"] == operation
    assert fake.requests[-1].headers["traceparent"].split("-")[1:3] == [trace_id,
                                                                         attempt.span_id]
    if operation != "embeddings":
        assert server.attributes["gen_ai.response.finish_reasons"]


def test_a_failed_try_is_a_failed_client_span_and_the_request_says_how_it_ended(
        traced, collector, fake, org, engine):
    fake.enqueue(error_reply(500, f"backend exploded on {PROMPT}"))
    header, trace_id, _ = new_traceparent()
    resp = post(traced, org, "/v1/chat/completions",
                chat_body(messages=[{"role": "user", "content": PROMPT}]), traceparent=header)
    assert resp.status_code == 502
    event = settled_event(engine, resp.headers[GENERATION_HEADER])
    spans = request_trace(collector, trace_id, "kiln.settlement", "chat upstream-fake")
    server = server_span(spans)
    check_usage(server, event)
    assert event["status"] == "upstream_error"
    assert server.status == "error"
    assert server.attributes["error.type"] == event["error_code"] == "upstream_error"
    assert server.attributes["http.response.status_code"] == 502
    (attempt,) = spans["chat upstream-fake"]
    assert attempt.status == "error"
    assert attempt.attributes["kiln.backend.outcome"] == "upstream_error"


def test_a_client_that_leaves_mid_stream_ends_the_stream_span_without_error(
        traced, collector, fake, org, engine):
    fake.enqueue([Status(200, {"Content-Type": "text/event-stream"}),
                  Send(sse_event(chat_chunk("Hi", role="assistant"))), Hang()])
    header, trace_id, _ = new_traceparent()
    resp = post(traced, org, "/v1/chat/completions", chat_body(stream=True),
                traceparent=header, stream=True)
    assert resp.status_code == 200
    next(line for line in resp.iter_lines() if line.startswith(b"data:"))
    resp.close()
    event = settled_event(engine, resp.headers[GENERATION_HEADER])
    assert event["status"] == "client_cancelled"
    spans = request_trace(collector, trace_id, "kiln.stream", "kiln.settlement")
    (stream,) = spans["kiln.stream"]
    assert stream.attributes.get("kiln.client_gone") is True and stream.status == "unset"
    server = server_span(spans)
    check_usage(server, event)
    assert server.status == "unset" and "error.type" not in server.attributes


def ratio_samples(trace_id_hex, ratio=DEFAULT_SAMPLE_RATIO):
    """The SDK's ``TraceIdRatioBased`` rule (OpenTelemetry trace SDK specification,
    "TraceIdRatioBased"): sampled when the trace id's low 64 bits are below ratio x 2**64."""
    return int(trace_id_hex, 16) & (2 ** 64 - 1) < round(ratio * 2 ** 64)


def test_a_request_without_traceparent_starts_a_trace_of_its_own_sampled_one_in_ten(
        traced, collector, fake, org):
    """No caller's decision: Kiln's default sampler (``parentbased_traceidratio``, one in ten)
    decides by the new trace's id; the backend is told the decision, and exactly the sampled
    requests' spans are exported."""
    sampled, left_out = [], []
    while len(sampled) < 2 or len(left_out) < 2:
        resp = post(traced, org, "/v1/chat/completions", chat_body())
        assert resp.status_code == 200
        version, trace_id, _span, flags = fake.requests[-1].headers["traceparent"].split("-")
        assert flags == ("01" if ratio_samples(trace_id) else "00"), trace_id
        (sampled if flags == "01" else left_out).append((trace_id, resp.headers[GENERATION_HEADER]))
        assert len(sampled) + len(left_out) < 400  # 1 in 10: two of each come long before
    for trace_id, gid in sampled:
        server = server_span(request_trace(collector, trace_id, "kiln.settlement"))
        assert server.parent_id == "" and server.attributes["kiln.generation_id"] == gid
    # Every request's spans were handed to the exporter at its end, in order: once the last
    # sampled one is in, a left-out one exported before it would be there too.
    assert all(collector.trace(trace_id) == {} for trace_id, _ in left_out)


def test_a_failed_request_is_exported_whatever_the_ratio_unless_its_caller_said_not_to(
        traced, collector, fake, org, engine):
    """Failures are the traces an operator needs: one left out by the ratio is exported all
    the same; a caller's explicit not-sampled flag is still followed."""
    while True:  # a request the ratio leaves out
        fake.enqueue(error_reply(500, "backend exploded"))
        resp = post(traced, org, "/v1/chat/completions", chat_body())
        assert resp.status_code == 502
        trace_id = fake.requests[-1].headers["traceparent"].split("-")[1]
        if not ratio_samples(trace_id):
            break
    spans = request_trace(collector, trace_id, "kiln.settlement", "chat upstream-fake")
    server = server_span(spans)
    assert server.status == "error" and server.attributes["error.type"] == "upstream_error"
    assert server.attributes["kiln.generation_id"] == resp.headers[GENERATION_HEADER]
    (attempt,) = spans["chat upstream-fake"]
    assert attempt.status == "error" and attempt.parent_id == server.span_id

    _, declined, caller_span = new_traceparent()
    fake.enqueue(error_reply(500, "backend exploded"))
    resp = post(traced, org, "/v1/chat/completions", chat_body(),
                traceparent=f"00-{declined}-{caller_span}-00")
    assert resp.status_code == 502
    header, later_trace, _ = new_traceparent()
    assert post(traced, org, "/v1/chat/completions", chat_body(),
                traceparent=header).status_code == 200
    request_trace(collector, later_trace, "kiln.settlement")
    assert collector.trace(declined) == {}


def test_a_caller_that_does_not_sample_is_followed_and_its_trace_passed_on(
        traced, collector, fake, org):
    """A ``traceparent`` whose flags say not sampled: Kiln exports nothing of the request (the
    sampler follows its parent) and passes the trace on, still not sampled."""
    _, trace_id, caller_span = new_traceparent()
    resp = post(traced, org, "/v1/chat/completions", chat_body(),
                traceparent=f"00-{trace_id}-{caller_span}-00")
    assert resp.status_code == 200
    version, sent_trace, sent_span, flags = fake.requests[-1].headers["traceparent"].split("-")
    assert (version, sent_trace, flags) == ("00", trace_id, "00") and sent_span != caller_span
    # A sampled request after it: once its spans are in, the first one's would be too.
    header, later_trace, _ = new_traceparent()
    assert post(traced, org, "/v1/chat/completions", chat_body(),
                traceparent=header).status_code == 200
    request_trace(collector, later_trace, "kiln.settlement")
    assert collector.trace(trace_id) == {}


def test_a_worker_that_stops_exports_the_spans_it_still_holds(
        pg_url, catalog_path, collector, fake, org):
    """Batches leave every 10 minutes here: the request's spans are held until the graceful
    stop, whose ``worker_exit`` flushes them before the worker exits."""
    env = {**gateway_env(pg_url, catalog_path, otel_endpoint=collector.endpoint),
           "OTEL_BSP_SCHEDULE_DELAY": "600000"}
    gw = Gateway(env, workers=1).start()
    try:
        header, trace_id, _ = new_traceparent()
        resp = post(gw, org, "/v1/chat/completions", chat_body(), traceparent=header)
        assert resp.status_code == 200
        assert collector.trace(trace_id) == {}  # still in the worker's batch
    finally:
        gw.stop()
    spans = collector.trace(trace_id)
    assert {"kiln.admission", "chat upstream-fake", "kiln.settlement"} <= set(spans)
    assert server_span(spans).attributes["kiln.generation_id"] == \
        resp.headers[GENERATION_HEADER]


def test_no_span_carries_a_prompt_an_answer_or_a_key(traced, collector, fake, org):
    """Run after the others in this module: every span the collector holds is checked."""
    fake.enqueue(json_reply(chat_completion(ANSWER)))
    resp = post(traced, org, "/v1/chat/completions",
                chat_body(messages=[{"role": "user", "content": PROMPT}]),
                traceparent=new_traceparent()[0])
    assert resp.status_code == 200
    gid = resp.headers[GENERATION_HEADER]
    collector.wait_for(lambda spans: any(s.attributes.get("kiln.generation_id") == gid
                                         for s in spans))
    spans = collector.snapshot()
    display_prefix = org.key[:12]  # "kiln-" and the key's first 7 random characters
    secret = org.key[5:]
    for span in spans:
        texts = [span.name] + [name for name, _ in span.events] + [
            json.dumps(v) if not isinstance(v, str) else v for v in span.attributes.values()]
        for text in texts:
            assert PROMPT not in text and ANSWER not in text, (span.name, text)
            assert display_prefix not in text and secret[:7] not in text, (span.name, text)
    assert len(spans) >= 5


def test_with_tracing_off_a_callers_traceparent_is_not_passed_on(gateway, fake, org):
    """The shared gateway has no endpoint: Kiln takes no part in the caller's trace, and a
    client's headers never reach a backend."""
    header, _, _ = new_traceparent()
    resp = post(gateway, org, "/v1/chat/completions", chat_body(), traceparent=header)
    assert resp.status_code == 200
    assert "traceparent" not in fake.requests[-1].headers
