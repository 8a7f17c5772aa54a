"""The request contract of ``POST /v1/chat/completions``, row by row (README "API",
docs/PARAMETERS.md).

Rejections: status, ``error.type``/``code``/``param`` in the OpenAI envelope (JSON also when a
stream was asked for), and nothing left behind: no upstream call, no usage event, no charge, no
in-flight slot. Acceptances: exactly what the model server received, through the fake upstream's
record. Output rules Kiln enforces itself: ``stop``, single tool call, replies cut by
``max_tokens``.
"""
import json
import socket

import openai
import pytest
import requests
import sqlalchemy as sa

from fake_upstream import chat_chunk, chat_completion, json_reply, make_usage, sse
from factories import MESSAGES, fake_model_nanos
from gateway_proc import balance_nanos, usage_event, wait_until

START = (10 * 10**9, 0, 0)  # a fresh org: $10, nothing held, nothing in flight
DROP = object()  # marks a key to leave out of the body
BACKEND_MODEL = {"fake-model": "upstream-fake", "fake-vision": "upstream-vision",
                 "gpt-oss-fake": "openai/gpt-oss-120b"}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                         "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{}"}}




def nanos(prompt, completion):
    """The cost of fake-model ``prompt``/``completion`` tokens in nano-dollars."""
    return fake_model_nanos(prompt=prompt, completion=completion)


def body_with(**changes):
    """The base request with ``changes`` applied (``DROP`` removes a key)."""
    body = {"model": "fake-model", "messages": MESSAGES}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not DROP}


def assert_no_trace(engine, fake, org):
    """A rejected request calls no upstream, writes no usage event, charges nothing, holds no
    in-flight slot."""
    assert fake.requests == []
    with engine.connect() as conn:
        events, leases = (conn.execute(sa.text(f"SELECT count(*) FROM {table} WHERE org_id = :o"),
                                       {"o": org.id}).scalar_one()
                          for table in ("usage_events", "in_flight"))
    assert (events, leases) == (0, 0)
    assert balance_nanos(engine, org.id) == START


def send(client, gateway, org, body, stream=False):
    """Send ``body`` as is: by the openai SDK (odd values in ``extra_body``) when it has
    ``model`` and ``messages``, else raw. Return ``(status, headers, envelope)`` of the error."""
    if "model" not in body or "messages" not in body or not sdk_can_send(body):
        r = requests.post(gateway.base_url + "/v1/chat/completions", json=body,
                          headers=org.headers, timeout=30)
        return r.status_code, r.headers, r.json()
    rest = dict(body)
    kwargs = {"model": rest.pop("model"), "messages": rest.pop("messages"), "extra_body": rest}
    if stream:
        kwargs["stream"] = True
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(**kwargs)
    return err.value.status_code, err.value.response.headers, err.value.response.json()


def sdk_can_send(body):
    """Whether the openai SDK can encode ``body``: it sends UTF-8, which has no lone surrogate
    (requests escapes one as ``\\ud800``, as Python's json does by default)."""
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def check_error(result, status, code, param, type_="invalid_request_error"):
    got_status, headers, envelope = result
    assert headers["Content-Type"].startswith("application/json")
    assert set(envelope) == {"error"}
    error = envelope["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (got_status, error["type"], error["code"], error["param"]) == (status, type_, code,
                                                                         param)
    assert isinstance(error["message"], str) and error["message"]
    return error


def user(content):
    return {"role": "user", "content": content}


def history(*extra):
    return [user("hi"), *extra]


REJECTED = [
    # model
    ("model-missing", body_with(model=DROP), 400, "missing_required_parameter", "model"),
    ("model-not-string", body_with(model=7), 400, "invalid_type", "model"),
    ("model-unknown", body_with(model="no-such-model"), 404, "model_not_found", "model"),
    # messages
    ("messages-missing", body_with(messages=DROP), 400, "empty_array", "messages"),
    ("messages-empty", body_with(messages=[]), 400, "empty_array", "messages"),
    ("messages-null", body_with(messages=None), 400, "empty_array", "messages"),
    ("messages-string", body_with(messages="hi"), 400, "invalid_type", "messages"),
    ("messages-object", body_with(messages=user("hi")), 400, "invalid_type", "messages"),
    ("message-not-object", body_with(messages=["hi"]), 400, "invalid_type", "messages[0]"),
    ("role-unknown", body_with(messages=[{"role": "wizard", "content": "x"}]), 400,
     "invalid_value", "messages[0].role"),
    ("role-missing", body_with(messages=history({"content": "x"})), 400, "invalid_value",
     "messages[1].role"),
    # a lone surrogate (json.dumps sends it as the escape \ud800): no Unicode character
    ("lone-surrogate", body_with(messages=history(user("ok \ud800 then"))), 400,
     "invalid_value", "messages[1].content"),
    ("lone-low-surrogate-in-name", body_with(
        messages=[{"role": "user", "content": "x", "name": "\udc00"}]), 400, "invalid_value",
     "messages[0].name"),
    ("system-no-content", body_with(messages=[{"role": "system"}]), 400,
     "missing_required_parameter", "messages[0].content"),
    ("system-image-part", body_with(model="fake-vision", messages=[{"role": "system",
                                                                      "content": [IMAGE]}]),
     400, "invalid_value", "messages[0].content[0].type"),
    ("assistant-junk-tool-call", body_with(messages=history(
        {"role": "assistant", "content": None, "tool_calls": [CALL, {"id": "x", "junk": 1}]})),
     400, "invalid_type", "messages[1].tool_calls[1].function"),
    ("unknown-parameter", body_with(top_k=40), 400, "unknown_parameter", "top_k"),
    ("unknown-chat-template-kwargs", body_with(chat_template_kwargs={"enable_thinking": False}),
     400, "unknown_parameter", "chat_template_kwargs"),
    ("stream_options-unknown", body_with(stream=True, stream_options={
        "continuous_usage_stats": True}), 400, "unknown_parameter",
     "stream_options.continuous_usage_stats"),
    ("min_tokens-above-cap", body_with(max_tokens=5, min_tokens=6), 400, "invalid_value",
     "min_tokens"),
    ("audio-output", body_with(modalities=["text", "audio"]), 400, "unsupported_parameter",
     "modalities"),
    ("web-search", body_with(web_search_options={}), 400, "unsupported_parameter",
     "web_search_options"),
    ("user-no-content", body_with(messages=[{"role": "user"}]), 400,
     "missing_required_parameter", "messages[0].content"),
    ("user-number", body_with(messages=[user(5)]), 400, "invalid_type", "messages[0].content"),
    ("user-part-not-object", body_with(messages=[user(["hi"])]), 400, "invalid_type",
     "messages[0].content[0]"),
    ("user-part-no-type", body_with(messages=[user([{"type": "text", "text": "a"},
                                                    {"text": "b"}])]), 400, "invalid_type",
     "messages[0].content[1]"),
    ("assistant-empty", body_with(messages=history({"role": "assistant"})), 400,
     "missing_required_parameter", "messages[1].content"),
    ("assistant-null-no-calls", body_with(messages=history(
        {"role": "assistant", "content": None, "tool_calls": []})), 400,
     "missing_required_parameter", "messages[1].content"),
    ("assistant-calls-object", body_with(messages=history(
        {"role": "assistant", "content": None, "tool_calls": CALL})), 400, "invalid_type",
     "messages[1].tool_calls"),
    ("tool-no-id", body_with(messages=history({"role": "tool", "content": "{}"})), 400,
     "missing_required_parameter", "messages[1].tool_call_id"),
    ("tool-id-number", body_with(messages=history({"role": "tool", "tool_call_id": 1,
                                                   "content": "{}"})), 400, "invalid_type",
     "messages[1].tool_call_id"),
    ("tool-no-content", body_with(messages=history({"role": "tool", "tool_call_id": "c"})),
     400, "missing_required_parameter", "messages[1].content"),
    # image parts on models without image input
    ("image-text-model", body_with(messages=[user([{"type": "text", "text": "what?"}, IMAGE])]),
     400, "unsupported_parameter", "messages[0].content[1]"),
    ("image-gpt-oss", body_with(model="gpt-oss-fake", messages=history(user([IMAGE]))), 400,
     "unsupported_parameter", "messages[1].content[0]"),
    # max_tokens
    *[(f"max_tokens={v!r}", body_with(max_tokens=v), 400, "invalid_value", "max_tokens")
      for v in (0, -5, "100", 10.5, True, 1025)],
    ("max_completion_tokens-over", body_with(max_completion_tokens=5000), 400, "invalid_value",
     "max_completion_tokens"),
    # stream
    *[(f"stream={v!r}", body_with(stream=v), 400, "invalid_value", "stream")
      for v in ("yes", "TRUE", "1", "", 2, -1)],
    *[(f"stream={v!r}", body_with(stream=v), 400, "invalid_type", "stream")
      for v in (1.0, [], {})],
    # stream_options
    ("stream_options-no-stream", body_with(stream_options={"include_usage": True}), 400,
     "invalid_value", "stream_options"),
    ("stream_options-stream-false", body_with(stream=False, stream_options={}), 400,
     "invalid_value", "stream_options"),
    ("stream_options-stream-0", body_with(stream=0, stream_options={"include_usage": False}),
     400, "invalid_value", "stream_options"),
    ("stream_options-not-object", body_with(stream=True, stream_options="usage"), 400,
     "invalid_type", "stream_options"),
    ("include_usage-string", body_with(stream=True, stream_options={"include_usage": "true"}),
     400, "invalid_type", "stream_options.include_usage"),
    # tools
    ("tools-object", body_with(tools=TOOL), 400, "invalid_type", "tools"),
    ("tool-type", body_with(tools=[{**TOOL, "type": "retrieval"}]), 400, "invalid_value",
     "tools[0].type"),
    ("tool-no-function", body_with(tools=[{"type": "function"}]), 400,
     "missing_required_parameter", "tools[0].function"),
    ("tool-no-name", body_with(tools=[{"type": "function", "function": {
        "description": "d"}}]), 400, "missing_required_parameter", "tools[0].function.name"),
    *[(f"tool-description={v!r}", body_with(tools=[{"type": "function", "function": {
        "name": "f", **({} if v is DROP else {"description": v})}}]), 400,
       "missing_required_parameter", "tools[0].function.description")
      for v in (DROP, "", "   ", None, 3)],
    ("second-tool-no-description", body_with(tools=[TOOL, {"type": "function", "function": {
        "name": "g"}}]), 400, "missing_required_parameter", "tools[1].function.description"),
    ("tool-parameters-string", body_with(tools=[{"type": "function", "function": {
        **TOOL["function"], "parameters": "object"}}]), 400, "invalid_type",
     "tools[0].function.parameters"),
    # tool_choice
    ("tool_choice-required", body_with(tools=[TOOL], tool_choice="required"), 400,
     "unsupported_parameter", "tool_choice"),
    ("tool_choice-named", body_with(tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), 400,
     "unsupported_parameter", "tool_choice"),
    ("tool_choice-required-gpt-oss", body_with(model="gpt-oss-fake", tools=[TOOL],
                                               tool_choice="required"), 400,
     "unsupported_parameter", "tool_choice"),
    ("tool_choice-unknown", body_with(tools=[TOOL], tool_choice="any"), 400, "invalid_value",
     "tool_choice"),
    ("tool_choice-no-function", body_with(model="fake-vision", tools=[TOOL],
                                          tool_choice={"type": "function"}), 400,
     "invalid_value", "tool_choice"),
    # parallel_tool_calls
    *[(f"parallel_tool_calls={v!r}", body_with(parallel_tool_calls=v), 400, "invalid_type",
       "parallel_tool_calls") for v in ("false", 0)],
    # reasoning_effort
    *[(f"reasoning_effort={v!r}", body_with(reasoning_effort=v), 400, "invalid_value",
       "reasoning_effort") for v in ("extreme", "LOW", "", 2, ["low"])],
    # sampling parameters: type and range
    *[(f"{name}={v!r}", body_with(**{name: v}), 400, "invalid_value", name)
      for name, values in (("temperature", (-0.01, 2.01, "0.5", True)),
                           ("top_p", (-0.5, 1.01)), ("presence_penalty", (-2.01, 2.5)),
                           ("frequency_penalty", (-3, 2.01)), ("n", (0, -1, 1.5, "2", 129, 2**63)))
      for v in values],
    *[(f"seed={v!r}", body_with(seed=v), 400, "invalid_type", "seed")
      for v in (1.5, "42", True)],
    # stop
    *[(f"stop={v!r}", body_with(stop=v), 400, "invalid_value", "stop")
      for v in (["a", "b", "c", "d", "e"], [""], "", [1], {"s": 1}, 7)],
    # response_format
    *[(f"response_format-{kind}-{model}", body_with(model=model, response_format={
        "type": kind}), 400, "unsupported_parameter", "response_format")
      for kind in ("json_object", "json_schema") for model in ("fake-model", "gpt-oss-fake")],
    *[(f"response_format={v!r}", body_with(response_format=v), 400, "invalid_value",
       "response_format") for v in ({"type": "xml"}, "json_object", {})],
    # ignore_eos on gpt-oss
    ("ignore_eos-gpt-oss", body_with(model="gpt-oss-fake", ignore_eos=True), 400,
     "unsupported_parameter", "ignore_eos"),
    # OpenAI parameters a model server answers with a 500 when malformed: refused here
    *[(f"{name}={v!r}", body_with(**{name: v}), 400, code, name) for name, v, code in (
        ("user", 5, "invalid_type"), ("user", {}, "invalid_type"),
        ("metadata", 5, "invalid_type"), ("logit_bias", "x", "invalid_type"),
        ("logit_bias", {"50256": 101}, "invalid_value"),
        ("logit_bias", {"50256": "1"}, "invalid_value"),
        ("logprobs", "yes", "invalid_type"))],
    ("top_logprobs=-1", body_with(logprobs=True, top_logprobs=-1), 400, "invalid_value",
     "top_logprobs"),
    ("top_logprobs=21", body_with(logprobs=True, top_logprobs=21), 400, "invalid_value",
     "top_logprobs"),
    ("top_logprobs-string", body_with(logprobs=True, top_logprobs="2"), 400, "invalid_value",
     "top_logprobs"),
    ("top_logprobs-without-logprobs", body_with(top_logprobs=2), 400, "invalid_value",
     "top_logprobs"),
    ("part-type-unknown", body_with(messages=[{"role": "user", "content": [
        {"type": "foo"}]}]), 400, "invalid_value", "messages[0].content[0].type"),
    ("part-text-missing", body_with(messages=[{"role": "user", "content": [
        {"type": "text"}]}]), 400, "missing_required_parameter", "messages[0].content[0].text"),
    ("part-image-no-url", body_with(model="fake-vision", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {}}]}]), 400, "invalid_type",
     "messages[0].content[0].image_url"),
]


@pytest.mark.parametrize("body,status,code,param",
                         [pytest.param(*case[1:], id=case[0]) for case in REJECTED])
def test_rejected_before_admission(client, gateway, fake, org, engine, body, status, code,
                                   param):
    check_error(send(client, gateway, org, body), status, code, param)
    assert_no_trace(engine, fake, org)


STREAMED_REJECTIONS = ["messages-empty", "model-unknown", "image-text-model",
                       "max_tokens=1025", "tool_choice-required", "temperature=2.01",
                       "stop=['a', 'b', 'c', 'd', 'e']", "response_format-json_object-fake-model",
                       "ignore_eos-gpt-oss", "include_usage-string"]


@pytest.mark.parametrize("name", STREAMED_REJECTIONS)
def test_rejection_is_json_even_when_streaming(client, gateway, fake, org, engine, name):
    _, body, status, code, param = next(case for case in REJECTED if case[0] == name)
    check_error(send(client, gateway, org, {**body, "stream": True}, stream=True), status, code,
                param)
    assert_no_trace(engine, fake, org)


def test_empty_messages_error_is_exactly_the_reference(client, gateway, fake, org, engine):
    _, _, envelope = send(client, gateway, org, body_with(messages=[]))
    assert envelope == {"error": {
        "message": "Invalid 'messages': the array must contain at least one message.",
        "type": "invalid_request_error", "param": "messages", "code": "empty_array"}}


def test_forced_tool_choice_error_says_to_send_auto(client, gateway, fake, org, engine):
    error = check_error(send(client, gateway, org, body_with(tools=[TOOL],
                                                             tool_choice="required")),
                        400, "unsupported_parameter", "tool_choice")
    assert '"auto"' in error["message"] and "fake-model" in error["message"]


# -- the body itself ---------------------------------------------------------------------------

def raw_post(gateway, org, data, content_type="application/json"):
    headers = dict(org.headers)
    if content_type is not None:
        headers["Content-Type"] = content_type
    r = requests.post(gateway.base_url + "/v1/chat/completions", data=data, headers=headers,
                      timeout=30)
    return r.status_code, r.headers, r.json()


VALID_JSON = json.dumps(body_with()).encode()


@pytest.mark.parametrize("data,content_type,code", [
    pytest.param(b'{"model": "fake-model", "messages": [', "application/json", "invalid_json",
                 id="truncated"),
    pytest.param(b"{'model': 'fake-model'}", "application/json", "invalid_json", id="python"),
    pytest.param(b'\xff\xfe{"a"', "application/json", "invalid_json", id="not-utf8"),
    *[pytest.param(d, "application/json", "invalid_json", id=f"not-object-{d.decode()}")
      for d in (b"[]", b'"hi"', b"42", b"null", b"true")],
    pytest.param(b"", "application/json", "invalid_json", id="empty"),
    pytest.param(b"  \n ", "application/json", "invalid_json", id="blank"),
    pytest.param(VALID_JSON, "text/plain", "invalid_content_type", id="text-plain"),
    pytest.param(VALID_JSON, "application/x-www-form-urlencoded", "invalid_content_type",
                 id="form"),
    pytest.param(VALID_JSON, None, "invalid_content_type", id="no-content-type"),
])
def test_bad_body_is_400(gateway, fake, org, engine, data, content_type, code):
    check_error(raw_post(gateway, org, data, content_type), 400, code, None)
    assert_no_trace(engine, fake, org)


def test_json_with_charset_is_accepted(gateway, fake, org):
    r = requests.post(gateway.base_url + "/v1/chat/completions", data=VALID_JSON, timeout=30,
                      headers={**org.headers, "Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"


def http_request(port, head, body=b"", timeout_s=10):
    """Send raw HTTP/1.1 bytes; return the whole response (the server closes or answers in
    full within ``timeout_s``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return head.decode("latin-1"), payload


def _length(data):
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1 << 30


def test_oversized_content_length_is_413_before_the_body_is_read(gateway, fake, org, engine):
    """Headers announce 16 MiB + 1 and no body follows: a server that read the body would wait
    until the socket timeout; Kiln answers at once from Content-Length."""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {org.key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {16 * 1024 * 1024 + 1}\r\n\r\n").encode()
    response_head, payload = http_request(gateway.port, head)
    assert response_head.startswith("HTTP/1.1 413")
    assert "content-type: application/json" in response_head.lower()
    error = json.loads(payload)["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error", "request_too_large", None)
    assert_no_trace(engine, fake, org)


def pieces(data, size=1000):
    """``data`` as a chunked upload of ``size``-byte chunks."""
    return iter([data[i:i + size] for i in range(0, len(data), size)])


def padded(size):
    """A valid request body of exactly ``size`` bytes."""
    base = json.dumps(body_with(messages=[user("")])).encode()
    filler = size - len(base)
    return json.dumps(body_with(messages=[user("x" * filler)])).encode()


def test_body_size_limit_is_configurable_and_exact(start_gateway, fake, org, engine):
    gw = start_gateway(workers=1, max_body_bytes=2048)
    url = gw.base_url + "/v1/chat/completions"
    headers = {**org.headers, "Content-Type": "application/json"}
    for data in (padded(2049), pieces(padded(4096))):  # Content-Length, then chunked
        r = requests.post(url, data=data, headers=headers, timeout=30)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large"
    assert_no_trace(engine, fake, org)
    for data in (padded(2048), pieces(padded(2048), 100)):
        r = requests.post(url, data=data, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
    assert len(fake.requests) == 2


def test_chunked_body_is_held_by_its_real_size(gateway, fake, org, engine):
    """A chunked upload has no Content-Length; the hold still counts its bytes."""
    url = gateway.base_url + "/v1/chat/completions"
    headers = {**org.headers, "Content-Type": "application/json"}
    data = padded(40000)
    holds = []
    for body in (data, pieces(data)):
        r = requests.post(url, data=body, headers=headers, timeout=30)
        assert r.status_code == 200
        holds.append(usage_event(engine, r.headers["X-Neocloud-Generation-Id"])["hold_nanos"])
    assert holds[0] == holds[1]


# -- accepted and forwarded --------------------------------------------------------------------

def forwarded(client, fake, body, stream=False):
    """Send ``body`` by the SDK; return what the model server received."""
    rest = dict(body)
    reply = client.chat.completions.create(model=rest.pop("model"),
                                           messages=rest.pop("messages"), extra_body=rest,
                                           **({"stream": True} if stream else {}))
    if stream:
        list(reply)
    assert len(fake.requests) == 1
    return fake.requests[-1].json


# The catalog's max output per model (tests/conftest.py): sent when the client gives no cap.
MAX_OUTPUT = {"fake-model": 1024, "fake-vision": 4096, "gpt-oss-fake": 32768}


# Accepted and never sent (docs/PARAMETERS.md).
DROPPED = {"user", "metadata", "store", "service_tier", "prompt_cache_key",
           "prompt_cache_retention", "safety_identifier", "verbosity", "modalities",
           "prediction"}


def upstream_body(body, stream=False, drop=()):
    """What the fake backend (family ``generic``) must receive for ``body``: the backend's
    model, no null or dropped field, and the cap Kiln held for in both length fields."""
    lengths = [body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k)]
    cap = min(lengths) if lengths else MAX_OUTPUT[body["model"]]
    out = {k: v for k, v in body.items()
           if v is not None and k not in DROPPED and k not in drop}
    out.update(model=BACKEND_MODEL[body["model"]], stream=stream, max_tokens=cap,
               max_completion_tokens=cap)
    return out


FULL_HISTORY = [
    {"role": "system", "content": "Answer briefly."},
    user([{"type": "text", "text": "What is in this image?"}, IMAGE]),
    # tool_calls in the history are forwarded unchanged
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "assistant", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "ok"}]},
    {"role": "user", "content": "Thanks", "name": "ann"},
]
ACCEPTED = [
    ("all-roles-vision", body_with(model="fake-vision", messages=FULL_HISTORY), ()),
    ("openai-extras", body_with(user="u-1", metadata={"k": "v"}, logit_bias={"50256": -100},
                                logprobs=True, top_logprobs=2), ()),
    ("max_tokens-at-cap", body_with(max_tokens=1024), ()),
    ("max_tokens-1", body_with(max_tokens=1, max_completion_tokens=1), ()),
    ("tools", body_with(tools=[TOOL, {"type": "function", "function": {
        "name": "noargs", "description": "No arguments."}}]), ()),
    *[(f"tool_choice={c}", body_with(tools=[TOOL], tool_choice=c), ()) for c in ("auto", "none")],
    ("tool_choice-required-vision", body_with(model="fake-vision", tools=[TOOL],
                                              tool_choice="required"), ()),
    ("tool_choice-named-vision", body_with(model="fake-vision", tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), ()),
    *[(f"parallel_tool_calls={v}-vision", body_with(model="fake-vision", tools=[TOOL],
                                                    parallel_tool_calls=v), ())
      for v in (True, False)],
    *[(f"parallel_tool_calls={v}-removed", body_with(tools=[TOOL], parallel_tool_calls=v),
       ("parallel_tool_calls",)) for v in (True, False)],
    *[(f"reasoning_effort={v}", body_with(model="gpt-oss-fake", reasoning_effort=v), ())
      for v in ("low", "medium", "high")],
    *[(f"{name}={v}", body_with(**{name: v}), ())
      for name, values in (("temperature", (0, 0.7, 2)), ("top_p", (0, 1)),
                           ("presence_penalty", (-2, 2)), ("frequency_penalty", (-2, 1.5)),
                           ("n", (1, 3)), ("seed", (0, -7, 2**40)))
      for v in values],
    ("stop-string", body_with(stop="\n\n"), ()),
    ("stop-four", body_with(stop=["a1", "b2", "c3", "d4"]), ()),
    ("response_format-text", body_with(response_format={"type": "text"}), ()),
    *[(f"response_format-{kind}-vision", body_with(model="fake-vision", response_format={
        "type": kind, "json_schema": {"name": "x", "schema": {"type": "object"}}}), ())
      for kind in ("json_object", "json_schema")],
    # ignore_eos is read by vLLM, SGLang and llama.cpp; these backends are "generic"
    ("ignore_eos-other-model", body_with(ignore_eos=True), ("ignore_eos",)),
    ("ignore_eos-false-gpt-oss", body_with(model="gpt-oss-fake", ignore_eos=False),
     ("ignore_eos",)),
    ("system-text-parts", body_with(messages=[{"role": "system", "content": [
        {"type": "text", "text": "x"}]}, *MESSAGES]), ()),
    ("dropped-fields", body_with(store=True, service_tier="auto", prompt_cache_key="k",
                                 safety_identifier="s", verbosity="low", modalities=["text"],
                                 prediction={"type": "content", "content": "x"}), ()),
    ("nulls", body_with(temperature=None, tools=None, tool_choice=None, stop=None,
                        response_format=None, stream_options=None), ()),
]


@pytest.mark.parametrize("body,drop", [pytest.param(*c[1:], id=c[0]) for c in ACCEPTED])
def test_accepted_and_forwarded_exactly(client, fake, body, drop):
    assert forwarded(client, fake, body) == upstream_body(body, drop=drop)


@pytest.mark.parametrize("value", [True, "true", 1])
def test_stream_true_values_stream_and_send_a_boolean(gateway, fake, org, value):
    r = requests.post(gateway.base_url + "/v1/chat/completions", json=body_with(stream=value),
                      headers=org.headers, timeout=30)
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/event-stream")
    assert r.text.endswith("data: [DONE]\n\n")
    sent = fake.requests[-1].json
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert {k: v for k, v in sent.items() if k not in ("stream", "stream_options")} == {
        "model": "upstream-fake", "messages": MESSAGES, "max_tokens": 1024,
        "max_completion_tokens": 1024}


@pytest.mark.parametrize("value", [False, "false", 0, None, DROP])
def test_stream_false_values_answer_json_and_send_a_boolean(gateway, fake, org, value):
    r = requests.post(gateway.base_url + "/v1/chat/completions", json=body_with(stream=value),
                      headers=org.headers, timeout=30)
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("application/json")
    assert r.json()["object"] == "chat.completion"
    assert fake.requests[-1].json == {"model": "upstream-fake", "messages": MESSAGES,
                                      "stream": False, "max_tokens": 1024,
                                      "max_completion_tokens": 1024}


def test_stream_options_are_kilns_and_usage_is_always_asked(client, fake):
    options = {"include_usage": False, "include_obfuscation": True}
    reply = client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True,
                                           extra_body={"stream_options": options})
    chunks = list(reply)
    assert all(c.usage is None for c in chunks)  # not asked for: the usage chunk is removed
    assert fake.requests[-1].json["stream_options"] == {"include_usage": True}


# -- output rules Kiln enforces ----------------------------------------------------------------

def test_stop_is_enforced_on_a_json_reply(client, fake):
    fake.enqueue(json_reply(chat_completion("one two STOP three four", finish_reason="length")))
    resp = client.chat.completions.create(model="fake-model", messages=MESSAGES,
                                          stop=["four", "STOP"])
    assert resp.choices[0].message.content == "one two "
    assert resp.choices[0].finish_reason == "stop"
    assert fake.requests[-1].json["stop"] == ["four", "STOP"]


def streamed_text(chunks):
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and
               c.choices[0].finish_reason]
    return text, reasons


@pytest.mark.parametrize("pieces,stop,expected", [
    pytest.param(["Hel", "lo E", "ND and", " more"], "END", "Hello ", id="split-E|ND"),
    pytest.param(["a E", "x b E", "N", "D c"], "END", "a Ex b ", id="false-start-then-hit"),
    pytest.param(["xy", "z", "ab"], ["yz", "zab"], "x", id="first-of-several"),
])
def test_stop_is_enforced_across_chunk_boundaries(client, fake, org, engine, pieces, stop,
                                                  expected):
    usage = make_usage(prompt=9, completion=len(pieces))
    fake.enqueue(sse([chat_chunk(p) for p in pieces] + [chat_chunk(finish_reason="length"),
                                                        chat_chunk(choices=False, usage=usage)]))
    raw = client.chat.completions.with_raw_response.create(
        model="fake-model", messages=MESSAGES, stop=stop, stream=True,
        stream_options={"include_usage": True})
    chunks = list(raw.parse())
    assert streamed_text(chunks) == (expected, ["stop"])
    assert chunks[-1].usage.completion_tokens == len(pieces)  # billed as generated
    assert fake.requests[-1].json["stop"] == stop
    gid = raw.headers["X-Neocloud-Generation-Id"]
    event = wait_until(lambda: (e := usage_event(engine, gid)) and e["status"] != "pending" and e)
    assert event["cost_nanos"] == nanos(9, len(pieces))


def test_held_back_stop_prefix_is_released_at_the_end(client, fake):
    fake.enqueue(sse([chat_chunk("abc E"), chat_chunk(finish_reason="stop")]))
    chunks = list(client.chat.completions.create(model="fake-model", messages=MESSAGES,
                                                 stop="END", stream=True))
    assert streamed_text(chunks) == ("abc E", ["stop"])


def tool_call(i, name, args):
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": name, "arguments": args}}


def test_single_tool_call_enforced_on_json_reply(client, fake):
    calls = [tool_call(0, "get_weather", '{"city":"Oslo"}'),
             tool_call(1, "get_time", '{"tz":"UTC"}')]
    fake.enqueue(json_reply(chat_completion(None, tool_calls=calls, finish_reason="tool_calls")))
    resp = client.chat.completions.create(model="fake-model", messages=MESSAGES, tools=[TOOL],
                                          parallel_tool_calls=False)
    message = resp.choices[0].message
    assert [c.id for c in message.tool_calls] == ["call_0"]
    assert message.tool_calls[0].function.arguments == '{"city":"Oslo"}'
    assert resp.choices[0].finish_reason == "tool_calls"
    assert "parallel_tool_calls" not in fake.requests[-1].json


def stream_delta(index, name=None, args="", call_id=None):
    function = {"arguments": args, **({"name": name} if name else {})}
    return {"index": index, **({"id": call_id, "type": "function"} if call_id else {}),
            "function": function}


def tool_call_stream():
    return sse([
        chat_chunk(tool_calls=[stream_delta(0, "get_weather", "", "call_0")], role="assistant"),
        chat_chunk(tool_calls=[stream_delta(0, args='{"city":'), stream_delta(1, "get_time", "",
                                                                              "call_1")]),
        chat_chunk(tool_calls=[stream_delta(1, args='{"tz":"UTC"}')]),
        chat_chunk(tool_calls=[stream_delta(0, args='"Oslo"}')]),
        chat_chunk(finish_reason="tool_calls")])


def streamed_calls(chunks):
    calls = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(delta.index, {"name": None, "arguments": ""})
            entry["name"] = entry["name"] or delta.function.name
            entry["arguments"] += delta.function.arguments or ""
    return calls


def test_single_tool_call_enforced_in_a_stream(client, fake):
    fake.enqueue(tool_call_stream())
    chunks = list(client.chat.completions.create(model="fake-model", messages=MESSAGES,
                                                 tools=[TOOL], parallel_tool_calls=False,
                                                 stream=True))
    assert streamed_calls(chunks) == {0: {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
    assert streamed_text(chunks)[1] == ["tool_calls"]
    assert "parallel_tool_calls" not in fake.requests[-1].json


def test_parallel_tool_calls_true_keeps_every_call(client, fake):
    fake.enqueue(tool_call_stream())
    chunks = list(client.chat.completions.create(model="fake-model", messages=MESSAGES,
                                                 tools=[TOOL], parallel_tool_calls=True,
                                                 stream=True))
    assert set(streamed_calls(chunks)) == {0, 1}


@pytest.mark.parametrize("content", ["", None])
def test_reply_cut_at_max_tokens_is_passed_on_and_billed_as_reported(client, fake, org, engine,
                                                                     content):
    fake.enqueue(json_reply(chat_completion(content, finish_reason="length",
                                            usage=make_usage(prompt=11, completion=16))))
    raw = client.chat.completions.with_raw_response.create(model="fake-model",
                                                           messages=MESSAGES, max_tokens=16)
    resp = raw.parse()
    assert resp.choices[0].message.content == content
    assert resp.choices[0].finish_reason == "length"
    assert fake.requests[-1].json["max_tokens"] == 16
    event = usage_event(engine, raw.headers["X-Neocloud-Generation-Id"])
    assert (event["status"], event["prompt_tokens"], event["completion_tokens"]) == (
        "completed", 11, 16)
    assert event["cost_nanos"] == nanos(11, 16)
    assert balance_nanos(engine, org.id) == (START[0] - nanos(11, 16), 0, 0)


def test_body_shorter_than_content_length_is_refused_not_served(gateway, fake, org, engine):
    """A client that stops mid-body must not have the part received served and billed, even
    when that part happens to parse."""
    body = json.dumps({"model": "fake-model", "messages": MESSAGES}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nAuthorization: Bearer {org.key}\r\nContent-Length: {len(body) + 10}\r\n"
            f"Connection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as sock:
        sock.sendall(head + body)
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    assert b" 400 " in status_line
    assert json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "incomplete_body"
    assert_no_trace(engine, fake, org)


def test_body_that_cannot_fit_the_context_window_is_refused_early(client, fake, org, engine):
    # fake-model has an 8,192-token window: 600 kB of text cannot fit whatever the tokenizer.
    huge = [{"role": "user", "content": "lorem ipsum " * 50_000}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="fake-model", messages=huge)
    assert err.value.body["code"] == "context_length_exceeded"
    assert err.value.body["param"] == "messages"
    assert_no_trace(engine, fake, org)


@pytest.mark.parametrize("head, status, code", [
    (b"GET /v1/credits HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n", 400, "bad_request"),
    (b"GET /v1/credits HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431,
     "request_header_too_large"),
    (b"GET /v1/credits HTTP/9.9\r\nHost: x\r\n\r\n", 400, "bad_request"),
    (b"G(ET) /v1/credits HTTP/1.1\r\nHost: x\r\n\r\n", 400, "bad_request"),
], ids=["header-name", "header-too-large", "http-version", "method"])
def test_requests_the_server_cannot_parse_are_answered_in_the_envelope(gateway, head, status,
                                                                        code):
    """Without nginx in front, gunicorn itself refuses these before the app sees them; the
    answer is still the envelope, not gunicorn's HTML page."""
    reply_head, body = http_request(gateway.port, head)
    assert reply_head.split()[1] == str(status), reply_head
    assert "Content-Type: application/json" in reply_head
    error = json.loads(body)["error"]
    assert (error["code"], error["type"], error["param"]) == (code, "invalid_request_error",
                                                                None)
    assert error["message"]
