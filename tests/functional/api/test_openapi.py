"""``GET /openapi.json``: a valid OpenAPI 3.1 document, kept true by checking real requests and
responses of the running gateway against it (JSON Schema 2020-12, the dialect of OpenAPI 3.1).

The document itself is checked with ``openapi-spec-validator`` (the OpenAPI Initiative's 3.1
schema plus its semantic checks).
"""
import http.client
import json

import pytest
import requests
from jsonschema import Draft202012Validator
from openapi_spec_validator import OpenAPIV31SpecValidator
from openapi_spec_validator import validate as validate_spec
from openapi_spec_validator.validation.exceptions import OpenAPIValidationError
from referencing import Registry
from referencing.jsonschema import DRAFT202012
from requests.structures import CaseInsensitiveDict

from factories import MESSAGES
from fake_upstream import Close, Send, Status, chat_chunk, error_reply, make_usage, sse, \
    sse_event
from gateway_proc import make_org
from openapi_checks import DOC_URI, check_response, component, media_pointer, validator

CHAT = "/v1/chat/completions"
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                         "parameters": {"type": "object"}}}


def sse_payloads(text):
    """The ``data`` payloads of an SSE body, JSON-decoded (``[DONE]`` kept as a string)."""
    out = []
    for event in text.split("\n\n"):
        data = "\n".join(line[6:] for line in event.split("\n") if line.startswith("data: "))
        if data:
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# -- the document itself -------------------------------------------------------------------------

def test_document_is_valid_openapi_3_1(document):
    validate_spec(document, cls=OpenAPIV31SpecValidator)
    broken = {**document, "paths": {CHAT: {"post": {"responses": {"200": {"content": {}}}}}}}
    # The check bites: a response needs a description.
    with pytest.raises(OpenAPIValidationError):
        validate_spec(broken, cls=OpenAPIV31SpecValidator)
    assert document["openapi"].startswith("3.1.")


def refs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from refs(item)


def test_every_schema_is_json_schema_2020_12_and_every_ref_resolves(document):
    for schema in document["components"]["schemas"].values():
        Draft202012Validator.check_schema(schema)
    resolver = Registry().with_resource(
        DOC_URI, DRAFT202012.create_resource(document)).resolver(DOC_URI)
    targets = set(refs(document))
    assert "#/components/schemas/ChatCompletionRequest" in targets
    for ref in targets:
        assert resolver.lookup(ref).contents is not None


def test_paths_statuses_and_media_types(document):
    paths = document["paths"]
    assert {"/v1/chat/completions", "/v1/models", "/v1/credits", "/v1/generation", "/healthz",
            "/readyz"} <= set(paths)
    chat = paths[CHAT]["post"]["responses"]
    assert set(chat) == {"200", "400", "401", "402", "403", "404", "413", "429", "500", "502",
                         "503"}
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "X-Neocloud-Generation-Id" in chat["200"]["headers"]
    # plain text; upstream_too_large in the envelope (docs/RELIABILITY.md, "Big answers")
    assert set(chat["502"]["content"]) == {"text/plain", "application/json"}
    assert "Retry-After" in chat["503"]["headers"]
    assert paths["/healthz"]["get"]["security"] == [] == paths["/readyz"]["get"]["security"]


def test_request_schema_states_the_contract(document):
    props = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]

    def inner(name):
        return props[name]["anyOf"][0]  # optional parameters also take null
    assert [(inner(n)["minimum"], inner(n)["maximum"]) for n in (
        "temperature", "top_p", "presence_penalty", "frequency_penalty")] == [
        (0, 2), (0, 1), (-2, 2), (-2, 2)]
    assert inner("reasoning_effort")["enum"] == ["none", "minimal", "low", "medium", "high",
                                                 "xhigh", "max"]
    assert inner("n") == {"type": "integer", "minimum": 1, "maximum": 128}
    assert inner("stop")["oneOf"][1]["maxItems"] == 4
    assert props["stream"]["enum"] == [True, "true", 1, False, "false", 0, None]
    assert props["messages"]["minItems"] == 1


# -- recorded requests and responses ---------------------------------------------------------------

VALID_BODIES = [
    {"model": "fake-model", "messages": MESSAGES},
    {"model": "fake-model", "messages": MESSAGES, "stream": "false", "max_tokens": 1024,
     "temperature": 0.2, "top_p": 1, "n": 1, "seed": 7, "stop": ["END", "\n\n"],
     "presence_penalty": -2, "frequency_penalty": 2, "tools": [TOOL], "tool_choice": "auto",
     "parallel_tool_calls": False, "response_format": {"type": "text"}},
    {"model": "fake-vision", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                     {"type": "image_url", "image_url": {
                                         "url": "data:image/png;base64,iVBORw0KGgo="}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}],
     "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
     "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
    {"model": "gpt-oss-fake", "messages": MESSAGES, "reasoning_effort": "high",
     "ignore_eos": False, "max_completion_tokens": 100, "stream": 0},
]


@pytest.mark.parametrize("body", VALID_BODIES)
def test_valid_requests_and_json_replies_match_the_document(gateway, fake, org, document, body):
    component(document, "ChatCompletionRequest").validate(body)
    r = requests.post(gateway.base_url + CHAT, json=body, headers=org.headers, timeout=30)
    assert r.status_code == 200
    assert check_response(document, CHAT, r, "post") == "application/json"
    assert r.headers["X-Neocloud-Generation-Id"]


TOOL_STREAM = [chat_chunk(role="assistant", tool_calls=[
    {"index": 0, "id": "c0", "type": "function", "function": {"name": "f", "arguments": ""}}]),
    chat_chunk(tool_calls=[{"index": 0, "function": {"arguments": "{}"}}]),
    chat_chunk(finish_reason="tool_calls"), chat_chunk(choices=False, usage=make_usage(4, 2))]
MID_STREAM_FAILURE = [Status(200, {"Content-Type": "text/event-stream"}),
                      Send(sse_event(chat_chunk("partial"))), Close()]


@pytest.mark.parametrize("script,options", [
    pytest.param(None, {"include_usage": True}, id="usage"),
    pytest.param(None, None, id="no-usage"),
    pytest.param(sse(TOOL_STREAM), {"include_usage": True}, id="tool-calls"),
    pytest.param(MID_STREAM_FAILURE, None, id="mid-stream-failure"),
])
def test_streams_match_the_document(gateway, fake, org, document, script, options):
    if script is not None:
        fake.enqueue(script)
    body = {"model": "fake-model", "messages": MESSAGES, "stream": True,
            **({"stream_options": options} if options else {})}
    component(document, "ChatCompletionRequest").validate(body)
    r = requests.post(gateway.base_url + CHAT, json=body, headers=org.headers, timeout=30)
    assert check_response(document, CHAT, r, "post") == "text/event-stream"
    event_data = validator(document, media_pointer(CHAT, "post", 200, "text/event-stream")
                           + "/x-sse-data")
    payloads = sse_payloads(r.text)
    for payload in payloads:
        event_data.validate(payload)
    if script is MID_STREAM_FAILURE:
        component(document, "ErrorResponse").validate(payloads[-1])
    else:
        assert payloads[-1] == "[DONE]"
    if options:
        assert "cost" in payloads[-2]["usage"]


SCHEMA_INVALID = [
    {"model": "fake-model"},
    {"model": "fake-model", "messages": []},
    {"model": "fake-model", "messages": "hi"},
    {"model": "fake-model", "messages": [{"role": "wizard", "content": "x"}]},
    {"model": "fake-model", "messages": [{"role": "system", "content": [{"type": "text"}]}]},
    {"model": "fake-model", "messages": [{"role": "assistant", "content": None}]},
    {"model": "fake-model", "messages": [{"role": "tool", "content": "x"}]},
    {"model": 3, "messages": MESSAGES},
    {"model": "fake-model", "messages": MESSAGES, "max_tokens": 0},
    {"model": "fake-model", "messages": MESSAGES, "stream": "yes"},
    {"model": "fake-model", "messages": MESSAGES, "stream_options": {"include_usage": True}},
    {"model": "fake-model", "messages": MESSAGES, "stream": "false", "stream_options": {}},
    {"model": "fake-model", "messages": MESSAGES, "tools": [
        {"type": "function", "function": {"name": "f"}}]},
    {"model": "fake-model", "messages": MESSAGES, "tools": [
        {"type": "function", "function": {"name": "f", "description": "  "}}]},
    {"model": "fake-model", "messages": MESSAGES, "tool_choice": "any"},
    {"model": "fake-model", "messages": MESSAGES, "parallel_tool_calls": "false"},
    {"model": "fake-model", "messages": MESSAGES, "reasoning_effort": "extreme"},
    {"model": "fake-model", "messages": [{"role": "user", "content": "x", "max_tokens": 9}]},
    {"model": "fake-model", "messages": [{"role": "tool", "tool_call_id": "c", "content": "x",
                                          "name": "f"}]},
    {"model": "fake-model", "messages": [{"role": "assistant", "content": "x", "prefix": True}]},
    {"model": "fake-model", "messages": MESSAGES, "temperature": 2.5},
    {"model": "fake-model", "messages": MESSAGES, "top_p": -0.1},
    {"model": "fake-model", "messages": MESSAGES, "presence_penalty": 3},
    {"model": "fake-model", "messages": MESSAGES, "frequency_penalty": -2.1},
    {"model": "fake-model", "messages": MESSAGES, "n": 0},
    {"model": "fake-model", "messages": MESSAGES, "seed": "7"},
    {"model": "fake-model", "messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]},
    {"model": "fake-model", "messages": MESSAGES, "response_format": {"type": "xml"}},
]
MODEL_DEPENDENT = [  # valid by the schema, refused by the catalog's entry for the model
    {"model": "no-such-model", "messages": MESSAGES},
    {"model": "fake-model", "messages": MESSAGES, "max_tokens": 5000},
    {"model": "fake-model", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
    {"model": "fake-model", "messages": MESSAGES, "tools": [TOOL], "tool_choice": "required"},
    {"model": "fake-model", "messages": MESSAGES, "response_format": {"type": "json_object"}},
    {"model": "gpt-oss-fake", "messages": MESSAGES, "ignore_eos": True},
]


@pytest.mark.parametrize("body", SCHEMA_INVALID)
def test_bodies_the_schema_rejects_the_gateway_rejects(gateway, fake, org, document, body):
    assert not component(document, "ChatCompletionRequest").is_valid(body)
    r = requests.post(gateway.base_url + CHAT, json=body, headers=org.headers, timeout=30)
    assert r.status_code == 400
    check_response(document, CHAT, r, "post")
    assert fake.requests == []


@pytest.mark.parametrize("body", MODEL_DEPENDENT)
def test_model_dependent_rejections_are_documented_errors(gateway, fake, org, document, body):
    component(document, "ChatCompletionRequest").validate(body)
    r = requests.post(gateway.base_url + CHAT, json={**body, "stream": True},
                      headers=org.headers, timeout=30)
    assert r.status_code in (400, 404)
    check_response(document, CHAT, r, "post")
    assert fake.requests == []


class Raw:
    """A response read by ``http.client``, shaped like a ``requests`` one."""

    def __init__(self, resp):
        self.status_code = resp.status
        self.headers = CaseInsensitiveDict(resp.getheaders())
        self.text = resp.read().decode()

    def json(self):
        return json.loads(self.text)


def announce_huge_body(gateway, org):
    """Send only headers announcing a 64 MiB body; return the answer."""
    conn = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=30)
    try:
        conn.putrequest("POST", CHAT)
        for name, value in {**org.headers, "Content-Type": "application/json",
                            "Content-Length": str(64 * 1024 * 1024)}.items():
            conn.putheader(name, value)
        conn.endheaders()
        return Raw(conn.getresponse())
    finally:
        conn.close()


def test_gateway_errors_match_the_document(gateway, fake, org, engine, document):
    url = gateway.base_url + CHAT
    body = {"model": "fake-model", "messages": MESSAGES}
    seen = {}

    def record(resp, path=CHAT, method="post"):
        check_response(document, path, resp, method)
        seen[resp.status_code] = resp

    record(requests.post(url, data=b"{", headers={**org.headers,
                                                  "Content-Type": "application/json"}))
    record(requests.post(url, json=body))  # no key: 401
    record(requests.post(url, json=body, headers={"Authorization": "Bearer kiln-nope"}))
    poor = make_org(engine, f"poor-openapi-{org.id}", usd="0.0000001")
    record(requests.post(url, json=body, headers=poor.headers))  # 402
    record(requests.post(url, json={**body, "model": "nope"}, headers=org.headers))
    record(announce_huge_body(gateway, org))  # 413 from Content-Length
    fake.enqueue(error_reply(500, "boom"))
    record(requests.post(url, json=body, headers=org.headers))  # 502, plain text
    fake.enqueue(error_reply(429, "busy"))
    record(requests.post(url, json=body, headers=org.headers))  # 503
    assert set(seen) == {400, 401, 402, 404, 413, 502, 503}
    assert seen[502].headers["Content-Type"].startswith("text/plain")


def test_other_endpoints_match_the_document(gateway, fake, org, document):
    base = gateway.base_url
    r = requests.post(base + CHAT, json={"model": "fake-model", "messages": MESSAGES},
                      headers=org.headers, timeout=30)
    gid = r.headers["X-Neocloud-Generation-Id"]
    for path, params, headers, status in [
        ("/v1/models", None, org.headers, 200), ("/v1/credits", None, org.headers, 200),
        ("/v1/generation", {"id": gid}, org.headers, 200),
        ("/v1/generation", {"id": "gen-nope"}, org.headers, 404),
        ("/v1/generation", None, org.headers, 400), ("/v1/models", None, {}, 401),
        ("/healthz", None, {}, 200), ("/readyz", None, {}, 200),
    ]:
        resp = requests.get(base + path, params=params, headers=headers, timeout=30)
        assert resp.status_code == status, (path, resp.text)
        check_response(document, path, resp)


# -- the Anthropic Messages API (docs/MESSAGES.md) ----------------------------------------------

MESSAGES_PATH, COUNT_PATH = "/v1/messages", "/v1/messages/count_tokens"
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01", "content-type": "application/json"}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Weather now.",
                  "input_schema": {"type": "object", "properties": {}}}
MESSAGES_BODIES = [
    {"model": "fake-model", "max_tokens": 100, "messages": MESSAGES},
    {"model": "fake-model", "max_tokens": 32000, "system": [{"type": "text", "text": "Brief."}],
     "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                                     "name": "get_weather", "input": {}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                "content": "sunny"}]}],
     "tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "auto"}, "temperature": 0.5,
     "stop_sequences": ["END"], "metadata": {"user_id": "u1"}, "thinking": {"type": "adaptive"},
     "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
     "output_config": {"effort": "high"}, "service_tier": "auto"},
]


def test_messages_paths_are_documented(document):
    paths = document["paths"]
    create = paths[MESSAGES_PATH]["post"]
    assert set(create["responses"]) == {"200", "400", "401", "402", "403", "404", "413", "429",
                                        "500", "502", "503"}
    assert set(create["responses"]["200"]["content"]) == {"application/json",
                                                          "text/event-stream"}
    assert "X-Kiln-Max-Tokens-Lowered" in create["responses"]["200"]["headers"]
    assert {"apiKey": []} in create["security"] and {"anthropicApiKey": []} in create["security"]
    assert document["components"]["securitySchemes"]["anthropicApiKey"]["name"] == "x-api-key"
    assert set(paths[COUNT_PATH]["post"]["responses"]) >= {"200", "400", "401", "404"}
    refs_ = set(refs(document))
    assert {"#/components/schemas/MessagesRequest", "#/components/schemas/Message",
            "#/components/schemas/AnthropicError"} <= refs_


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body", MESSAGES_BODIES, ids=["plain", "every-kind"])
def test_messages_requests_and_answers_match_the_document(gateway, fake, org, document, body,
                                                          stream):
    body = {**body, "stream": stream}
    component(document, "MessagesRequest").validate(body)
    r = requests.post(gateway.base_url + MESSAGES_PATH, json=body, timeout=30,
                      headers={**ANTHROPIC_HEADERS, "x-api-key": org.key})
    assert r.status_code == 200, r.text
    media = check_response(document, MESSAGES_PATH, r, "post")
    assert media == ("text/event-stream" if stream else "application/json")
    if stream:
        event = validator(document, media_pointer(MESSAGES_PATH, "post", 200,
                                                  "text/event-stream") + "/schema")
        data = validator(document, media_pointer(MESSAGES_PATH, "post", 200,
                                                 "text/event-stream") + "/x-sse-data")
        frames = [dict(line.split(": ", 1) for line in frame.split("\n"))
                  for frame in r.text.strip().split("\n\n")]
        for frame in frames:
            event.validate(frame)
            data.validate(json.loads(frame["data"]))
        assert frames[-1]["event"] == "message_stop"
    if body["max_tokens"] > 1024:
        assert r.headers["X-Kiln-Max-Tokens-Lowered"] == f"{body['max_tokens']}->1024"


def test_messages_stream_failure_matches_the_document(gateway, fake, org, document):
    fake.enqueue(MID_STREAM_FAILURE)
    r = requests.post(gateway.base_url + MESSAGES_PATH, timeout=30,
                      json={**MESSAGES_BODIES[0], "stream": True},
                      headers={**ANTHROPIC_HEADERS, "x-api-key": org.key})
    data = validator(document, media_pointer(MESSAGES_PATH, "post", 200, "text/event-stream")
                     + "/x-sse-data")
    payloads = sse_payloads(r.text)
    for payload in payloads:
        data.validate(payload)
    assert payloads[-1]["type"] == "error"
    component(document, "AnthropicError").validate(payloads[-1])


def test_count_tokens_matches_the_document(gateway, org, document):
    body = {"model": "fake-model", "messages": MESSAGES, "system": "Brief."}
    component(document, "MessageCountTokensRequest").validate(body)
    r = requests.post(gateway.base_url + COUNT_PATH, json=body, timeout=30,
                      headers={**ANTHROPIC_HEADERS, "x-api-key": org.key})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    check_response(document, COUNT_PATH, r, "post")
    assert not component(document, "MessageCountTokensRequest").is_valid(
        {**body, "max_tokens": 10})
    r = requests.post(gateway.base_url + COUNT_PATH, json={**body, "max_tokens": 10},
                      timeout=30, headers={**ANTHROPIC_HEADERS, "x-api-key": org.key})
    assert r.status_code == 400
    check_response(document, COUNT_PATH, r, "post")


MESSAGES_INVALID = [
    {"model": "fake-model", "messages": MESSAGES},  # no max_tokens
    {"model": "fake-model", "max_tokens": 10, "messages": []},
    {"model": "fake-model", "max_tokens": 10, "messages": MESSAGES, "n": 2},
    {"model": "fake-model", "max_tokens": 10, "messages": MESSAGES, "temperature": 1.5},
    {"model": "fake-model", "max_tokens": 10, "messages": MESSAGES,
     "stop_sequences": ["a", "b", "c", "d", "e"]},
    {"model": "fake-model", "max_tokens": 10, "messages": [{"role": "wizard", "content": "x"}]},
]


def test_messages_errors_match_the_document(gateway, fake, org, engine, document):
    url = gateway.base_url + MESSAGES_PATH
    seen = {}

    def record(resp):
        check_response(document, MESSAGES_PATH, resp, "post")
        seen[resp.status_code] = resp

    for body in MESSAGES_INVALID:
        assert not component(document, "MessagesRequest").is_valid(body)
        r = requests.post(url, json=body, headers={"x-api-key": org.key}, timeout=30)
        assert r.status_code == 400, body
        record(r)
    body = MESSAGES_BODIES[0]
    record(requests.post(url, json=body, timeout=30))  # no key: 401
    poor = make_org(engine, f"poor-openapi-msg-{org.id}", usd="0.0000001")
    record(requests.post(url, json=body, headers={"x-api-key": poor.key}, timeout=30))
    record(requests.post(url, json={**body, "model": "nope"}, headers={"x-api-key": org.key},
                         timeout=30))
    fake.enqueue(error_reply(500, "boom"))
    record(requests.post(url, json=body, headers={"x-api-key": org.key}, timeout=30))
    fake.enqueue(error_reply(429, "busy"))
    record(requests.post(url, json=body, headers={"x-api-key": org.key}, timeout=30))
    assert set(seen) == {400, 401, 402, 404, 502, 503}
    assert seen[502].json()["error"]["type"] == "api_error"  # JSON here, not plain text
    assert seen[503].json()["error"]["type"] == "overloaded_error"


# -- the Responses API -------------------------------------------------------------------------

RESPONSES = "/v1/responses"
STORED = "/v1/responses/{response_id}"
INPUT_ITEMS = "/v1/responses/{response_id}/input_items"
RESPONSE_TOOL = {"type": "function", "name": "get_weather",
                 "parameters": {"type": "object", "properties": {}}}


def typed_events(text):
    """``(event line, data)`` of each event of a Responses stream."""
    out = []
    for block in text.split("\n\n"):
        lines = block.split("\n")
        data = [line[6:] for line in lines if line.startswith("data: ")]
        if data:
            event = [line[7:] for line in lines if line.startswith("event: ")]
            out.append((event[0] if event else None, json.loads("\n".join(data))))
    return out


def test_responses_paths_are_documented(document):
    paths = document["paths"]
    create = paths[RESPONSES]["post"]["responses"]
    assert set(create) == {"200", "400", "401", "402", "403", "404", "413", "429", "500",
                           "502", "503"}
    assert set(create["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "X-Neocloud-Generation-Id" in create["200"]["headers"]
    assert set(paths[STORED]) == {"parameters", "get", "delete"}
    assert set(paths[STORED]["get"]["responses"]) == {"200", "401", "403", "404"}
    assert set(paths[INPUT_ITEMS]["get"]["responses"]) == {"200", "400", "401", "403", "404"}
    props = document["components"]["schemas"]["ResponseCreateRequest"]["properties"]
    assert {"model", "input", "previous_response_id", "store", "max_output_tokens"} <= \
        set(props) and "conversation" not in props


@pytest.mark.parametrize("body", [
    {"model": "fake-model", "input": "Hi"},
    {"model": "fake-model", "input": [{"role": "user", "content": "Hi"}], "instructions": "x",
     "tools": [RESPONSE_TOOL, {"type": "web_search"}], "max_output_tokens": 64,
     "temperature": 0.5, "store": False, "metadata": {"k": "v"}, "truncation": "auto"},
])
def test_responses_json_and_stored_answers_match_the_document(gateway, fake, org, document,
                                                                body):
    component(document, "ResponseCreateRequest").validate(body)
    base = gateway.base_url
    r = requests.post(base + RESPONSES, json=body, headers=org.headers, timeout=30)
    assert r.status_code == 200 and check_response(document, RESPONSES, r, "post") == \
        "application/json"
    rid = r.json()["id"]
    if body.get("store") is False:
        assert r.json()["dropped_tools"] == [{"index": 1, "type": "web_search"}]
        r = requests.get(f"{base}{RESPONSES}/{rid}", headers=org.headers, timeout=30)
        assert r.status_code == 404
        check_response(document, STORED, r)
        return
    for method, path, url, params, status in [
            ("get", STORED, f"{RESPONSES}/{rid}", None, 200),
            ("get", INPUT_ITEMS, f"{RESPONSES}/{rid}/input_items", {"limit": 1}, 200),
            ("get", INPUT_ITEMS, f"{RESPONSES}/{rid}/input_items", {"limit": 0}, 400),
            ("get", INPUT_ITEMS, f"{RESPONSES}/{rid}/input_items", {"order": "up"}, 400),
            ("delete", STORED, f"{RESPONSES}/{rid}", None, 200),
            ("delete", STORED, f"{RESPONSES}/{rid}", None, 404),
            ("get", STORED, f"{RESPONSES}/{rid}", None, 404),
            ("get", INPUT_ITEMS, f"{RESPONSES}/{rid}/input_items", None, 404)]:
        resp = requests.request(method, base + url, params=params, headers=org.headers,
                                timeout=30)
        assert resp.status_code == status, (method, url, resp.text)
        check_response(document, path, resp, method)
    resp = requests.get(f"{base}{RESPONSES}/resp_x", timeout=30)  # no key
    assert resp.status_code == 401
    check_response(document, STORED, resp)


@pytest.mark.parametrize("script", [
    pytest.param(None, id="text"),
    pytest.param(sse(TOOL_STREAM), id="tool-calls"),
    pytest.param(MID_STREAM_FAILURE, id="mid-stream-failure"),
])
def test_responses_streams_match_the_document(gateway, fake, org, document, script):
    if script is not None:
        fake.enqueue(script)
    body = {"model": "fake-model", "input": "Hi", "stream": True, "tools": [RESPONSE_TOOL]}
    component(document, "ResponseCreateRequest").validate(body)
    r = requests.post(gateway.base_url + RESPONSES, json=body, headers=org.headers, timeout=30)
    assert check_response(document, RESPONSES, r, "post") == "text/event-stream"
    event_data = validator(document, media_pointer(RESPONSES, "post", 200, "text/event-stream")
                           + "/x-sse-data")
    events = typed_events(r.text)
    for name, data in events:
        assert name == data["type"]
        event_data.validate(data)
    last = events[-1][1]
    if script is MID_STREAM_FAILURE:
        assert last["type"] == "response.failed" and events[-2][1]["type"] == "error"
    else:
        assert last["type"] == "response.completed" and "cost" in last["response"]["usage"]
        component(document, "Response").validate(last["response"])


@pytest.mark.parametrize("body,status", [
    ({"model": "fake-model"}, 400),
    ({"model": "fake-model", "input": "Hi", "conversation": "conv_1"}, 400),
    ({"model": "fake-model", "input": "Hi", "colour": "red"}, 400),
    ({"model": "fake-model", "input": "Hi", "max_output_tokens": 0}, 400),
    ({"model": "no-such-model", "input": "Hi"}, 404),
    ({"model": "fake-model", "input": "Hi", "previous_response_id": "resp_nope"}, 404),
])
def test_responses_refusals_are_documented_errors(gateway, fake, org, document, body, status):
    r = requests.post(gateway.base_url + RESPONSES, json=body, headers=org.headers, timeout=30)
    assert r.status_code == status, r.text
    check_response(document, RESPONSES, r, "post")
    assert fake.requests == []


def test_responses_gateway_errors_match_the_document(gateway, fake, org, engine, document):
    url, body = gateway.base_url + RESPONSES, {"model": "fake-model", "input": "Hi"}
    seen = set()
    for resp in [requests.post(url, json=body, timeout=30),
                 requests.post(url, json=body, headers=make_org(
                     engine, f"poor-resp-{org.id}", usd="0.0000001").headers, timeout=30)]:
        check_response(document, RESPONSES, resp, "post")
        seen.add(resp.status_code)
    for script in (error_reply(500, "boom"), error_reply(429, "busy")):
        fake.enqueue(script)
        resp = requests.post(url, json=body, headers=org.headers, timeout=30)
        check_response(document, RESPONSES, resp, "post")
        seen.add(resp.status_code)
    assert seen == {401, 402, 502, 503}
