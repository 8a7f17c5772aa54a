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

from contract_table import (BACKEND_MODEL, CALL, IMAGE, REJECTED, START, assert_no_trace,
                            check_error, raw_post, user)
from fake_upstream import chat_chunk, chat_completion, json_reply, make_usage, sse
from factories import DROP, MESSAGES, TOOL, chat_body, fake_model_nanos
from gateway_proc import balance_nanos, settled_event, usage_event


def nanos(prompt, completion):
    """The cost of fake-model ``prompt``/``completion`` tokens in nano-dollars."""
    return fake_model_nanos(prompt=prompt, completion=completion)


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


@pytest.mark.parametrize("body,status,code,param",
                         [pytest.param(*case[1:], id=case[0]) for case in REJECTED])
def test_rejected_before_admission(client, gateway, fake, org, engine, body, status, code,
                                   param):
    check_error(send(client, gateway, org, body), status, code, param)
    assert_no_trace(engine, fake, org)


STREAMED_REJECTIONS = ["messages-empty", "model-unknown", "image-text-model",
                       "max_tokens=1025", "tool_choice-required", "temperature=2.01",
                       "stop=['a', 'b', 'c', 'd', 'e']", "response_format-json_object-fake-model",
                       "ignore_eos-gpt-oss", "include_usage-string",
                       "n-top_logprobs-too-large"]


@pytest.mark.parametrize("name", STREAMED_REJECTIONS)
def test_rejection_is_json_even_when_streaming(client, gateway, fake, org, engine, name):
    _, body, status, code, param = next(case for case in REJECTED if case[0] == name)
    check_error(send(client, gateway, org, {**body, "stream": True}, stream=True), status, code,
                param)
    assert_no_trace(engine, fake, org)


def test_empty_messages_error_is_exactly_the_reference(client, gateway, fake, org, engine):
    _, _, envelope = send(client, gateway, org, chat_body(messages=[]))
    assert envelope == {"error": {
        "message": "Invalid 'messages': the array must contain at least one message.",
        "type": "invalid_request_error", "param": "messages", "code": "empty_array"}}


def test_forced_tool_choice_error_says_to_send_auto(client, gateway, fake, org, engine):
    error = check_error(send(client, gateway, org, chat_body(tools=[TOOL],
                                                             tool_choice="required")),
                        400, "unsupported_parameter", "tool_choice")
    assert '"auto"' in error["message"] and "fake-model" in error["message"]


# -- the body itself ---------------------------------------------------------------------------

VALID_JSON = json.dumps(chat_body()).encode()


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
    base = json.dumps(chat_body(messages=[user("")])).encode()
    filler = size - len(base)
    return json.dumps(chat_body(messages=[user("x" * filler)])).encode()


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


# The catalog's max output per model (factories.CATALOG): sent when the client gives no cap.
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
    ("all-roles-vision", chat_body(model="fake-vision", messages=FULL_HISTORY), ()),
    ("openai-extras", chat_body(user="u-1", metadata={"k": "v"}, logit_bias={"50256": -100},
                                logprobs=True, top_logprobs=2), ()),
    ("max_tokens-at-cap", chat_body(max_tokens=1024), ()),
    ("max_tokens-1", chat_body(max_tokens=1, max_completion_tokens=1), ()),
    ("tools", chat_body(tools=[TOOL, {"type": "function", "function": {
        "name": "noargs", "description": "No arguments."}}]), ()),
    *[(f"tool_choice={c}", chat_body(tools=[TOOL], tool_choice=c), ()) for c in ("auto", "none")],
    ("tool_choice-required-vision", chat_body(model="fake-vision", tools=[TOOL],
                                              tool_choice="required"), ()),
    ("tool_choice-named-vision", chat_body(model="fake-vision", tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), ()),
    *[(f"parallel_tool_calls={v}-vision", chat_body(model="fake-vision", tools=[TOOL],
                                                    parallel_tool_calls=v), ())
      for v in (True, False)],
    *[(f"parallel_tool_calls={v}-removed", chat_body(tools=[TOOL], parallel_tool_calls=v),
       ("parallel_tool_calls",)) for v in (True, False)],
    *[(f"reasoning_effort={v}", chat_body(model="gpt-oss-fake", reasoning_effort=v), ())
      for v in ("low", "medium", "high")],
    *[(f"{name}={v}", chat_body(**{name: v}), ())
      for name, values in (("temperature", (0, 0.7, 2)), ("top_p", (0, 1)),
                           ("presence_penalty", (-2, 2)), ("frequency_penalty", (-2, 1.5)),
                           ("n", (1, 3)), ("seed", (0, -7, 2**40)))
      for v in values],
    ("stop-string", chat_body(stop="\n\n"), ()),
    ("stop-four", chat_body(stop=["a1", "b2", "c3", "d4"]), ()),
    ("response_format-text", chat_body(response_format={"type": "text"}), ()),
    *[(f"response_format-{kind}-vision", chat_body(model="fake-vision", response_format={
        "type": kind, "json_schema": {"name": "x", "schema": {"type": "object"}}}), ())
      for kind in ("json_object", "json_schema")],
    # ignore_eos is read by vLLM, SGLang and llama.cpp; these backends are "generic"
    ("ignore_eos-other-model", chat_body(ignore_eos=True), ("ignore_eos",)),
    ("ignore_eos-false-gpt-oss", chat_body(model="gpt-oss-fake", ignore_eos=False),
     ("ignore_eos",)),
    ("system-text-parts", chat_body(messages=[{"role": "system", "content": [
        {"type": "text", "text": "x"}]}, *MESSAGES]), ()),
    ("dropped-fields", chat_body(store=True, service_tier="auto", prompt_cache_key="k",
                                 safety_identifier="s", verbosity="low", modalities=["text"],
                                 prediction={"type": "content", "content": "x"}), ()),
    ("nulls", chat_body(temperature=None, tools=None, tool_choice=None, stop=None,
                        response_format=None, stream_options=None), ()),
]


@pytest.mark.parametrize("body,drop", [pytest.param(*c[1:], id=c[0]) for c in ACCEPTED])
def test_accepted_and_forwarded_exactly(client, fake, body, drop):
    assert forwarded(client, fake, body) == upstream_body(body, drop=drop)


@pytest.mark.parametrize("value", [True, "true", 1])
def test_stream_true_values_stream_and_send_a_boolean(gateway, fake, org, value):
    r = requests.post(gateway.base_url + "/v1/chat/completions", json=chat_body(stream=value),
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
    r = requests.post(gateway.base_url + "/v1/chat/completions", json=chat_body(stream=value),
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
    event = settled_event(engine, gid)
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
