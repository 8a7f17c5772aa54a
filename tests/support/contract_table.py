"""The request contract's table and its checks, shared by the in-process tests (unit/api) and
the ones through the real gateway (functional/api/test_validation.py).

``REJECTED`` lists bodies refused before admission: ``(id, body, status, error.code, param)``.
"""
import requests
import sqlalchemy as sa

from factories import DROP, TOOL, chat_body
from gateway_proc import balance_nanos

START_NANOS = 10 * 10**9  # a fresh org's $10
START = (START_NANOS, 0, 0)  # a fresh org: $10, nothing held, nothing in flight
BACKEND_MODEL = {"fake-model": "upstream-fake", "fake-vision": "upstream-vision",
                 "gpt-oss-fake": "openai/gpt-oss-120b"}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{}"}}


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


def trace(engine, org_id):
    """``(usage events, leases, balance nanos, held nanos, in flight)`` of an org."""
    with engine.connect() as conn:
        counts = [conn.execute(sa.text(f"SELECT count(*) FROM {t} WHERE org_id = :o"),
                               {"o": org_id}).scalar_one() for t in ("usage_events", "in_flight")]
        row = conn.execute(sa.text("SELECT balance_nanos, held_nanos, in_flight FROM "
                                   "credit_balances WHERE org_id = :o"), {"o": org_id}).one()
    return (*counts, *row)


def raw_post(gateway, org, data, content_type="application/json"):
    headers = dict(org.headers)
    if content_type is not None:
        headers["Content-Type"] = content_type
    r = requests.post(gateway.base_url + "/v1/chat/completions", data=data, headers=headers,
                      timeout=30)
    return r.status_code, r.headers, r.json()


def user(content):
    return {"role": "user", "content": content}


def history(*extra):
    return [user("hi"), *extra]


REJECTED = [
    # model
    ("model-missing", chat_body(model=DROP), 400, "missing_required_parameter", "model"),
    ("model-not-string", chat_body(model=7), 400, "invalid_type", "model"),
    ("model-unknown", chat_body(model="no-such-model"), 404, "model_not_found", "model"),
    # messages
    ("messages-missing", chat_body(messages=DROP), 400, "empty_array", "messages"),
    ("messages-empty", chat_body(messages=[]), 400, "empty_array", "messages"),
    ("messages-null", chat_body(messages=None), 400, "empty_array", "messages"),
    ("messages-string", chat_body(messages="hi"), 400, "invalid_type", "messages"),
    ("messages-object", chat_body(messages=user("hi")), 400, "invalid_type", "messages"),
    ("message-not-object", chat_body(messages=["hi"]), 400, "invalid_type", "messages[0]"),
    ("role-unknown", chat_body(messages=[{"role": "wizard", "content": "x"}]), 400,
     "invalid_value", "messages[0].role"),
    ("role-missing", chat_body(messages=history({"content": "x"})), 400, "invalid_value",
     "messages[1].role"),
    # a lone surrogate (json.dumps sends it as the escape \ud800): no Unicode character
    ("lone-surrogate", chat_body(messages=history(user("ok \ud800 then"))), 400,
     "invalid_value", "messages[1].content"),
    ("lone-low-surrogate-in-name", chat_body(
        messages=[{"role": "user", "content": "x", "name": "\udc00"}]), 400, "invalid_value",
     "messages[0].name"),
    ("system-no-content", chat_body(messages=[{"role": "system"}]), 400,
     "missing_required_parameter", "messages[0].content"),
    ("system-image-part", chat_body(model="fake-vision", messages=[{"role": "system",
                                                                      "content": [IMAGE]}]),
     400, "invalid_value", "messages[0].content[0].type"),
    ("assistant-junk-tool-call", chat_body(messages=history(
        {"role": "assistant", "content": None, "tool_calls": [CALL, {"id": "x", "junk": 1}]})),
     400, "invalid_type", "messages[1].tool_calls[1].function"),
    ("unknown-parameter", chat_body(top_k=40), 400, "unknown_parameter", "top_k"),
    # an answer larger than the model allows: n × max_tokens × (1 + top_logprobs) above
    # max_reply_tokens (docs/RELIABILITY.md, "Big answers")
    ("n-top_logprobs-too-large", chat_body(n=128, logprobs=True, top_logprobs=20,
                                           max_tokens=1024), 400, "invalid_value",
     "top_logprobs"),
    ("unknown-chat-template-kwargs", chat_body(chat_template_kwargs={"enable_thinking": False}),
     400, "unknown_parameter", "chat_template_kwargs"),
    ("stream_options-unknown", chat_body(stream=True, stream_options={
        "continuous_usage_stats": True}), 400, "unknown_parameter",
     "stream_options.continuous_usage_stats"),
    ("min_tokens-above-cap", chat_body(max_tokens=5, min_tokens=6), 400, "invalid_value",
     "min_tokens"),
    ("audio-output", chat_body(modalities=["text", "audio"]), 400, "unsupported_parameter",
     "modalities"),
    ("web-search", chat_body(web_search_options={}), 400, "unsupported_parameter",
     "web_search_options"),
    ("user-no-content", chat_body(messages=[{"role": "user"}]), 400,
     "missing_required_parameter", "messages[0].content"),
    ("user-number", chat_body(messages=[user(5)]), 400, "invalid_type", "messages[0].content"),
    ("user-part-not-object", chat_body(messages=[user(["hi"])]), 400, "invalid_type",
     "messages[0].content[0]"),
    ("user-part-no-type", chat_body(messages=[user([{"type": "text", "text": "a"},
                                                    {"text": "b"}])]), 400, "invalid_type",
     "messages[0].content[1]"),
    ("assistant-empty", chat_body(messages=history({"role": "assistant"})), 400,
     "missing_required_parameter", "messages[1].content"),
    ("assistant-null-no-calls", chat_body(messages=history(
        {"role": "assistant", "content": None, "tool_calls": []})), 400,
     "missing_required_parameter", "messages[1].content"),
    ("assistant-calls-object", chat_body(messages=history(
        {"role": "assistant", "content": None, "tool_calls": CALL})), 400, "invalid_type",
     "messages[1].tool_calls"),
    ("tool-no-id", chat_body(messages=history({"role": "tool", "content": "{}"})), 400,
     "missing_required_parameter", "messages[1].tool_call_id"),
    ("tool-id-number", chat_body(messages=history({"role": "tool", "tool_call_id": 1,
                                                   "content": "{}"})), 400, "invalid_type",
     "messages[1].tool_call_id"),
    ("tool-no-content", chat_body(messages=history({"role": "tool", "tool_call_id": "c"})),
     400, "missing_required_parameter", "messages[1].content"),
    # image parts on models without image input
    ("image-text-model", chat_body(messages=[user([{"type": "text", "text": "what?"}, IMAGE])]),
     400, "unsupported_parameter", "messages[0].content[1]"),
    ("image-gpt-oss", chat_body(model="gpt-oss-fake", messages=history(user([IMAGE]))), 400,
     "unsupported_parameter", "messages[1].content[0]"),
    # max_tokens
    *[(f"max_tokens={v!r}", chat_body(max_tokens=v), 400, "invalid_value", "max_tokens")
      for v in (0, -5, "100", 10.5, True, 1025)],
    ("max_completion_tokens-over", chat_body(max_completion_tokens=5000), 400, "invalid_value",
     "max_completion_tokens"),
    # stream
    *[(f"stream={v!r}", chat_body(stream=v), 400, "invalid_value", "stream")
      for v in ("yes", "TRUE", "1", "", 2, -1)],
    *[(f"stream={v!r}", chat_body(stream=v), 400, "invalid_type", "stream")
      for v in (1.0, [], {})],
    # stream_options
    ("stream_options-no-stream", chat_body(stream_options={"include_usage": True}), 400,
     "invalid_value", "stream_options"),
    ("stream_options-stream-false", chat_body(stream=False, stream_options={}), 400,
     "invalid_value", "stream_options"),
    ("stream_options-stream-0", chat_body(stream=0, stream_options={"include_usage": False}),
     400, "invalid_value", "stream_options"),
    ("stream_options-not-object", chat_body(stream=True, stream_options="usage"), 400,
     "invalid_type", "stream_options"),
    ("include_usage-string", chat_body(stream=True, stream_options={"include_usage": "true"}),
     400, "invalid_type", "stream_options.include_usage"),
    # tools
    ("tools-object", chat_body(tools=TOOL), 400, "invalid_type", "tools"),
    ("tool-type", chat_body(tools=[{**TOOL, "type": "retrieval"}]), 400, "invalid_value",
     "tools[0].type"),
    ("tool-no-function", chat_body(tools=[{"type": "function"}]), 400,
     "missing_required_parameter", "tools[0].function"),
    ("tool-no-name", chat_body(tools=[{"type": "function", "function": {
        "description": "d"}}]), 400, "missing_required_parameter", "tools[0].function.name"),
    *[(f"tool-description={v!r}", chat_body(tools=[{"type": "function", "function": {
        "name": "f", **({} if v is DROP else {"description": v})}}]), 400,
       "missing_required_parameter", "tools[0].function.description")
      for v in (DROP, "", "   ", None, 3)],
    ("second-tool-no-description", chat_body(tools=[TOOL, {"type": "function", "function": {
        "name": "g"}}]), 400, "missing_required_parameter", "tools[1].function.description"),
    ("tool-parameters-string", chat_body(tools=[{"type": "function", "function": {
        **TOOL["function"], "parameters": "object"}}]), 400, "invalid_type",
     "tools[0].function.parameters"),
    # tool_choice
    ("tool_choice-required", chat_body(tools=[TOOL], tool_choice="required"), 400,
     "unsupported_parameter", "tool_choice"),
    ("tool_choice-named", chat_body(tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), 400,
     "unsupported_parameter", "tool_choice"),
    ("tool_choice-required-gpt-oss", chat_body(model="gpt-oss-fake", tools=[TOOL],
                                               tool_choice="required"), 400,
     "unsupported_parameter", "tool_choice"),
    ("tool_choice-unknown", chat_body(tools=[TOOL], tool_choice="any"), 400, "invalid_value",
     "tool_choice"),
    ("tool_choice-no-function", chat_body(model="fake-vision", tools=[TOOL],
                                          tool_choice={"type": "function"}), 400,
     "invalid_value", "tool_choice"),
    # parallel_tool_calls
    *[(f"parallel_tool_calls={v!r}", chat_body(parallel_tool_calls=v), 400, "invalid_type",
       "parallel_tool_calls") for v in ("false", 0)],
    # reasoning_effort
    *[(f"reasoning_effort={v!r}", chat_body(reasoning_effort=v), 400, "invalid_value",
       "reasoning_effort") for v in ("extreme", "LOW", "", 2, ["low"])],
    # sampling parameters: type and range
    *[(f"{name}={v!r}", chat_body(**{name: v}), 400, "invalid_value", name)
      for name, values in (("temperature", (-0.01, 2.01, "0.5", True)),
                           ("top_p", (-0.5, 1.01)), ("presence_penalty", (-2.01, 2.5)),
                           ("frequency_penalty", (-3, 2.01)), ("n", (0, -1, 1.5, "2", 129, 2**63)))
      for v in values],
    *[(f"seed={v!r}", chat_body(seed=v), 400, "invalid_type", "seed")
      for v in (1.5, "42", True)],
    # stop
    *[(f"stop={v!r}", chat_body(stop=v), 400, "invalid_value", "stop")
      for v in (["a", "b", "c", "d", "e"], [""], "", [1], {"s": 1}, 7)],
    # response_format
    *[(f"response_format-{kind}-{model}", chat_body(model=model, response_format={
        "type": kind}), 400, "unsupported_parameter", "response_format")
      for kind in ("json_object", "json_schema") for model in ("fake-model", "gpt-oss-fake")],
    *[(f"response_format={v!r}", chat_body(response_format=v), 400, "invalid_value",
       "response_format") for v in ({"type": "xml"}, "json_object", {})],
    # ignore_eos on gpt-oss
    ("ignore_eos-gpt-oss", chat_body(model="gpt-oss-fake", ignore_eos=True), 400,
     "unsupported_parameter", "ignore_eos"),
    # OpenAI parameters a model server answers with a 500 when malformed: refused here
    *[(f"{name}={v!r}", chat_body(**{name: v}), 400, code, name) for name, v, code in (
        ("user", 5, "invalid_type"), ("user", {}, "invalid_type"),
        ("metadata", 5, "invalid_type"), ("logit_bias", "x", "invalid_type"),
        ("logit_bias", {"50256": 101}, "invalid_value"),
        ("logit_bias", {"50256": "1"}, "invalid_value"),
        ("logprobs", "yes", "invalid_type"))],
    ("top_logprobs=-1", chat_body(logprobs=True, top_logprobs=-1), 400, "invalid_value",
     "top_logprobs"),
    ("top_logprobs=21", chat_body(logprobs=True, top_logprobs=21), 400, "invalid_value",
     "top_logprobs"),
    ("top_logprobs-string", chat_body(logprobs=True, top_logprobs="2"), 400, "invalid_value",
     "top_logprobs"),
    ("top_logprobs-without-logprobs", chat_body(top_logprobs=2), 400, "invalid_value",
     "top_logprobs"),
    ("part-type-unknown", chat_body(messages=[{"role": "user", "content": [
        {"type": "foo"}]}]), 400, "invalid_value", "messages[0].content[0].type"),
    ("part-text-missing", chat_body(messages=[{"role": "user", "content": [
        {"type": "text"}]}]), 400, "missing_required_parameter", "messages[0].content[0].text"),
    ("part-image-no-url", chat_body(model="fake-vision", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {}}]}]), 400, "invalid_type",
     "messages[0].content[0].image_url"),
]
