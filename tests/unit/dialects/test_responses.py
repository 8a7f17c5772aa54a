"""The Responses dialect's translation, in process: every request field (mapped, dropped or
refused, against the installed openai SDK's list), every input item kind, hosted tools, text
formats; the Response object and the event stream checked by the SDK's own types and its own
stream accumulation (``responses.stream(...).get_final_response()``)."""
import json
import typing
from decimal import Decimal

import openai
from types import SimpleNamespace

import pytest
from openai.types.responses import Response, ResponseStreamEvent, response_create_params
from openai.types.responses.tool_param import ToolParam
from pydantic import TypeAdapter

from factories import model_entry
from gateway.billing import Usage
from gateway.dialects.responses import ResponsesCodec
from gateway.dialects import responses_request as rr
from gateway.errors import InvalidRequest

try:  # the HTTP library the installed openai SDK is built on
    import httpx2 as httpx
except ImportError:
    import httpx

pytestmark = pytest.mark.unit


def relayed(cut, matched_stops=None, usage_payload=None, reported=None):
    """What the flow tells a stream's end of what it relayed (gateway.flow.rules.StreamRules):
    the cut, the stops, the backend's held usage-only chunk and its last usage."""
    return SimpleNamespace(cut=cut, matched_stops=matched_stops or {},
                           usage_payload=usage_payload,
                           meter=SimpleNamespace(reported=reported))


CATALOG = {"m": model_entry(), "vision": model_entry(
    id="vision", input=("text", "image"), response_format=True, forced_tool_choice=True,
    parallel_tool_calls=True, extra_params=("top_k",))}
CODEC = ResponsesCodec()
FN = {"type": "function", "name": "get_weather", "description": "Weather now.",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
      "strict": True}
EVENTS = TypeAdapter(ResponseStreamEvent)


def parse(model="m", history=None, **fields):
    body = {"model": model, "input": "Hello", **fields}
    return CODEC.parse(body, CATALOG, len(json.dumps(body)), history)


def refused(param, code=None, **fields):
    with pytest.raises(InvalidRequest) as err:
        parse(**fields)
    assert err.value.param == param, err.value.message
    if code:
        assert err.value.code == code
    assert "messages[" not in err.value.message  # told in the Responses API's words
    return err.value


# -- the field table ------------------------------------------------------------------------

def _literals(annotation):
    out = set()
    for arg in typing.get_args(annotation):
        out |= set(typing.get_args(arg)) if typing.get_origin(arg) is typing.Literal \
            else _literals(arg)
    return out | (set(typing.get_args(annotation))
                  if typing.get_origin(annotation) is typing.Literal else set())


def test_every_sdk_field_has_a_row_and_no_other():
    sdk = set(response_create_params.ResponseCreateParamsBase.__annotations__) | {"stream"}
    assert set(rr.FIELDS) == sdk


def test_enumerations_match_the_sdk():
    hints = typing.get_type_hints(response_create_params.ResponseCreateParamsBase)
    assert set(rr.INCLUDABLES) == {v for v in _literals(hints["include"]) if isinstance(v, str)}
    assert set(rr.SERVICE_TIERS) == {v for v in _literals(hints["service_tier"]) if v}
    assert set(rr.TRUNCATIONS) == {v for v in _literals(hints["truncation"]) if v}
    kinds = set()
    for tool in typing.get_args(ToolParam):
        kinds |= set(typing.get_args(typing.get_type_hints(tool)["type"]))
    assert kinds - {"function"} <= set(rr.HOSTED_TOOLS)


# (field, value, where it lands in the chat request's params or None for dropped)
MAPPED = [
    ("temperature", 0.5, ("temperature", 0.5)),
    ("top_p", 0.9, ("top_p", 0.9)),
    ("metadata", {"a": "b"}, ("metadata", {"a": "b"})),
    ("user", "u1", ("user", "u1")),
    ("safety_identifier", "s1", ("safety_identifier", "s1")),
    ("prompt_cache_key", "k", ("prompt_cache_key", "k")),
    ("prompt_cache_retention", "24h", ("prompt_cache_retention", "24h")),
    ("reasoning", {"effort": "low", "summary": "auto"}, ("reasoning_effort", "low")),
    ("text", {"format": {"type": "text"}, "verbosity": "low"}, ("verbosity", "low")),
    ("service_tier", "flex", None), ("store", False, None), ("include", [
        "reasoning.encrypted_content", "message.output_text.logprobs"], None),
    ("truncation", "auto", None), ("top_logprobs", 5, None), ("max_tool_calls", 3, None),
    ("prompt_cache_options", {"mode": "explicit", "ttl": "12h", "prewarm": False}, None),
    ("context_management", [{"type": "compaction", "compact_threshold": 1000}], None),
    ("image", {"context_compression": "auto"}, None),
    ("access_programs", {"cyber": "standard"}, None),
    ("background", False, None), ("background_options", {"completion_window": "soonest"}, None),
    ("previous_response_id", "resp_abc", None), ("instructions", "Be brief.", None),
    ("stream", True, None), ("parallel_tool_calls", False, None),
    ("max_output_tokens", 77, None), ("tool_choice", "none", ("tool_choice", "none")),
]


@pytest.mark.parametrize("name,value,lands", MAPPED, ids=[m[0] for m in MAPPED])
def test_accepted_fields(name, value, lands):
    req = parse(**{name: value})
    if lands is not None:
        assert req.params[lands[0]] == lands[1]
    elif name not in ("parallel_tool_calls",):
        assert name not in req.params
    echoed = json.loads(CODEC.render_json(_completion("hi"), Usage(1, 0, 1), Decimal(0), req))
    Response.model_validate(echoed)


def test_every_field_is_covered_by_the_tests():
    tested = {m[0] for m in MAPPED} | set(REFUSED) | {"model", "input", "tools", "stream_options"}
    assert tested == set(rr.FIELDS)


REFUSED = {"conversation": "conv_1", "prompt": {"id": "pmpt_1"},
           "moderation": {"model": "omni-moderation-latest"}}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_fields(name):
    err = refused(name, "unsupported_parameter", **{name: REFUSED[name]})
    assert err.status == 400


def test_background_true_is_refused_clearly():
    err = refused("background", "unsupported_parameter", background=True)
    assert "stream" in err.message


def test_unknown_and_chat_only_fields_are_refused_as_openai_does():
    refused("max_tokens", "unknown_parameter", max_tokens=5)
    refused("messages", "unknown_parameter", messages=[])
    assert parse("vision", top_k=5).extras == {"top_k": 5}  # the catalog's extra_params


def test_null_is_absent():
    req = parse(temperature=None, tools=None, conversation=None)
    assert "temperature" not in req.params and req.echo["tools"] == []


def test_max_output_tokens_is_the_cap_and_checked_under_its_own_name():
    assert parse(max_output_tokens=77).max_tokens == 77
    assert parse().max_tokens == CATALOG["m"].max_output_tokens
    err = refused("max_output_tokens", "invalid_value", max_output_tokens=10 ** 6)
    assert "'max_output_tokens'" in err.message


def test_stream_and_store():
    req = parse(stream=True, stream_options={"include_obfuscation": False})
    assert req.stream and req.include_usage
    refused("stream_options", "invalid_value", stream_options={"include_obfuscation": True})
    assert parse().store is True and parse(store=False).store is False
    assert ResponsesCodec(store_default=False).parse(
        {"model": "m", "input": "x"}, CATALOG, 30).store is False
    refused("store", "invalid_type", store="yes")


def test_malformed_dropped_fields_are_still_400():
    refused("include", "invalid_value", include=["everything"])
    refused("truncation", "invalid_value", truncation="sometimes")
    refused("top_logprobs", "invalid_value", top_logprobs=21)
    refused("service_tier", "invalid_value", service_tier="gold")
    refused("reasoning.summary", "invalid_value", reasoning={"summary": "long"})
    refused("reasoning.effort", "invalid_value", reasoning={"effort": "extreme"})
    refused("reasoning.colour", "unknown_parameter", reasoning={"colour": "x"})


# -- input items ------------------------------------------------------------------------------

def test_string_input_is_one_user_message_and_instructions_lead():
    req = parse(instructions="Be brief.")
    assert req.messages == [{"role": "developer", "content": "Be brief."},
                            {"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    assert req.input_items[0]["role"] == "user" and req.input_items[0]["id"].startswith("msg_")


def test_every_item_kind():
    items = [
        {"role": "system", "content": "sys"},
        {"type": "message", "role": "developer", "content": [{"type": "input_text",
                                                              "text": "dev"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "look"},
                                     {"type": "input_image", "detail": "low",
                                      "image_url": "data:image/png;base64,iVBORw0KGgo="}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me check.", "annotations": []},
                     {"type": "refusal", "refusal": "not that"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}",
         "id": "fc_2", "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "rain"}]},
        {"role": "assistant", "content": "Sunny and rain."},
        {"type": "item_reference", "id": "msg_1"},
    ]
    req = parse("vision", input=items, tools=[FN])
    m = req.messages
    assert [x["role"] for x in m] == ["system", "developer", "user", "assistant", "tool",
                                      "tool", "assistant", "assistant"]
    assert m[2]["content"][1] == {"type": "image_url", "image_url": {
        "url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}}
    assert m[3]["content"] == [{"type": "text", "text": "Let me check."},
                               {"type": "refusal", "refusal": "not that"}]
    assert [c["id"] for c in m[3]["tool_calls"]] == ["c1", "c2"]
    assert m[4] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert m[5]["content"] == [{"type": "text", "text": "rain"}]
    assert m[7]["content"][0]["text"] == "Let me check."  # the reference, resolved
    assert len(req.input_items) == len(items) and req.has_images


def test_a_call_without_a_preceding_message_is_its_own_assistant_turn():
    req = parse(input=[{"role": "user", "content": "hi"},
                       {"type": "function_call", "call_id": "c", "name": "f",
                        "arguments": "{}"},
                       {"type": "function_call_output", "call_id": "c", "output": "ok"}])
    assert req.messages[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_history_is_prepended_after_instructions_and_counted_in_the_hold():
    history = [{"type": "message", "role": "user", "id": "msg_a",
                "content": [{"type": "input_text", "text": "earlier " * 200}]},
               {"type": "message", "role": "assistant", "id": "msg_b", "status": "completed",
                "content": [{"type": "output_text", "text": "ok", "annotations": []}]}]
    req = parse(history=history, instructions="new rules", input="next")
    assert [x["role"] for x in req.messages] == ["developer", "user", "assistant", "user"]
    assert [i["content"][0]["text"] for i in req.input_items] == ["next"]  # only this turn's
    assert req.body_bytes > len(json.dumps(history))
    assert req.prompt_bound > parse(input="next").prompt_bound


def test_item_errors_name_the_responses_path():
    refused("input[0].content[0].file_id", "unsupported_parameter", model="vision", input=[
        {"role": "user", "content": [{"type": "input_image", "file_id": "file_1",
                                      "detail": "auto"}]}])
    refused("input[0].content[1]", "unsupported_parameter", input=[  # text-only model
        {"role": "user", "content": [{"type": "input_text", "text": "x"}, {
            "type": "input_image", "image_url": "https://example.com/a.png", "detail": "auto"}]}])
    refused("input[0].content[0].image_url", "invalid_image_url", model="vision", input=[
        {"role": "user", "content": [{"type": "input_image", "detail": "auto",
                                      "image_url": "http://169.254.169.254/x.png"}]}])
    refused("input[1].type", "unsupported_parameter", input=[
        {"role": "user", "content": "x"}, {"type": "web_search_call", "id": "ws_1"}])
    refused("input[0].role", "invalid_value", input=[{"role": "tool", "content": "x"}])
    refused("input[0].content[0].type", "invalid_value", input=[
        {"role": "assistant", "content": [{"type": "input_image", "image_url": "x"}]}])
    refused("input[0].foo", "unknown_parameter", input=[{"role": "user", "content": "x",
                                                         "foo": 1}])
    refused("input[0].arguments", "missing_required_parameter", input=[
        {"type": "function_call", "call_id": "c", "name": "f"}])
    refused("input[0].id", "invalid_value", input=[{"type": "item_reference", "id": "msg_x"}])
    refused("input", "missing_required_parameter", input=[])
    refused("model", "missing_required_parameter", model=None)


# -- tools ------------------------------------------------------------------------------------

HOSTED = [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs"]},
          {"type": "code_interpreter", "container": {"type": "auto"}},
          {"type": "mcp", "server_label": "x", "server_url": "https://x"},
          {"type": "image_generation"}, {"type": "computer_use_preview", "display_width": 1,
                                         "display_height": 1, "environment": "linux"},
          {"type": "local_shell"}, {"type": "custom", "name": "c"}, {"type": "brand_new_tool"}]


def test_function_tools_become_chat_tools_and_hosted_ones_are_left_out_and_told():
    req = parse("vision", tools=[HOSTED[0], FN, *HOSTED[1:]], tool_choice="auto")
    assert req.params["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather now.", "parameters": FN["parameters"],
        "strict": True}}]
    assert [d["type"] for d in req.dropped_tools] == [t["type"] for t in HOSTED]
    assert [d["index"] for d in req.dropped_tools] == [0, *range(2, len(HOSTED) + 1)]
    body = json.loads(CODEC.render_json(_completion("x"), Usage(1, 0, 1), Decimal(0), req))
    assert body["dropped_tools"] == req.dropped_tools and body["tools"] == [FN]
    only_hosted = parse(tools=HOSTED)
    assert "tools" not in only_hosted.params


@pytest.mark.parametrize("choice", [{"type": "web_search_preview"}, {"type": "file_search"},
                                    {"type": "mcp", "server_label": "x"},
                                    {"type": "custom", "name": "c"}, {"type": "shell"},
                                    {"type": "apply_patch"}])
def test_forcing_a_hosted_tool_is_a_clear_400(choice):
    err = refused("tool_choice", "unsupported_parameter", model="vision", tools=[FN, *HOSTED],
                  tool_choice=choice)
    assert "cannot run" in err.message


def test_tool_choice_shapes():
    named = parse("vision", tools=[FN], tool_choice={"type": "function", "name": "get_weather"})
    assert named.params["tool_choice"] == {"type": "function",
                                           "function": {"name": "get_weather"}}
    other = dict(FN, name="other")
    allowed = parse("vision", tools=[FN, other, HOSTED[0]], tool_choice={
        "type": "allowed_tools", "mode": "required",
        "tools": [{"type": "function", "name": "other"}, {"type": "web_search"}]})
    assert allowed.params["tool_choice"] == "required"
    assert [t["function"]["name"] for t in allowed.params["tools"]] == ["other"]
    refused("tool_choice.tools", "unsupported_parameter", model="vision", tools=[FN, HOSTED[0]],
            tool_choice={"type": "allowed_tools", "mode": "required",
                         "tools": [{"type": "web_search"}]})
    refused("tool_choice", "unsupported_parameter", tools=[FN], tool_choice="required")


def test_tool_errors_name_the_responses_index():
    refused("tools[1].parameters", "invalid_type",
            tools=[HOSTED[0], dict(FN, parameters="an object")])
    refused("tools[0].colour", "unknown_parameter", tools=[dict(FN, colour=1)])
    assert parse(tools=[dict(FN, defer_loading=False, output_schema=None)]).params["tools"]


# -- text.format --------------------------------------------------------------------------------

def test_text_format():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    req = parse("vision", text={"format": {"type": "json_schema", "name": "out",
                                           "schema": schema, "strict": True}})
    assert req.params["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "out", "schema": schema, "strict": True}}
    assert parse("vision", text={"format": {"type": "json_object"}}).params[
        "response_format"] == {"type": "json_object"}
    assert parse(text={"format": {"type": "text"}}).params["response_format"]["type"] == "text"
    refused("text.format", "unsupported_parameter", text={"format": {"type": "json_object"}})
    refused("text.format.type", "invalid_value", text={"format": {"type": "yaml"}})
    refused("text.format.schema", "invalid_type", model="vision",
            text={"format": {"type": "json_schema", "name": "x"}})


# -- the Response object ------------------------------------------------------------------------

def _completion(content=None, finish="stop", tool_calls=None, reasoning=None, usage=None):
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": usage}


def test_render_json_text_reasoning_and_calls_with_exact_cost():
    req = parse(tools=[FN], instructions="Be brief.", metadata={"k": "v"})
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]
    completion = _completion("Checking.", "tool_calls", calls, "think first",
                             {"completion_tokens_details": {"reasoning_tokens": 4}})
    raw = CODEC.render_json(completion, Usage(prompt=20, cached=5, completion=9),
                            Decimal("0.000012345"), req)
    assert b'"cost":0.000012345' in raw and b"output_text\":" not in raw.replace(
        b'"type":"output_text"', b"")
    resp = Response.model_validate_json(raw)
    assert resp.id == req.response_id and resp.id.startswith("resp_")
    assert resp.status == "completed" and resp.model == "m"
    assert [o.type for o in resp.output] == ["reasoning", "message", "function_call"]
    assert resp.output[0].content[0].text == "think first"
    assert resp.output_text == "Checking."
    call = resp.output[2]
    assert (call.call_id, call.name, call.arguments) == ("call_1", "get_weather",
                                                          "{\"city\":\"Oslo\"}")
    assert call.id.startswith("fc_")
    u = resp.usage
    assert (u.input_tokens, u.input_tokens_details.cached_tokens, u.output_tokens,
            u.output_tokens_details.reasoning_tokens, u.total_tokens) == (20, 5, 9, 4, 29)
    assert json.loads(raw, parse_float=Decimal)["usage"]["cost"] == Decimal("0.000012345")
    assert (resp.instructions, resp.metadata, resp.store) == ("Be brief.", {"k": "v"}, True)
    assert resp.tools[0].name == "get_weather"


def test_render_json_length_is_incomplete():
    raw = CODEC.render_json(_completion("cut", "length"), Usage(3, 0, 5), Decimal("1"),
                            parse(max_output_tokens=5))
    resp = Response.model_validate_json(raw)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete" and resp.max_output_tokens == 5
    assert json.loads(raw)["usage"]["cost"] == 1


def test_error_body_is_the_openai_envelope():
    err = refused("store", "invalid_type", store=1)
    status, body = CODEC.error_body(err)
    assert status == 400 and body == {"error": {"message": err.message,
                                                "type": "invalid_request_error",
                                                "param": "store", "code": "invalid_type"}}


# -- streams ------------------------------------------------------------------------------------

def chunk(delta=None, finish=None, usage=None, index=0):
    obj = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
           "choices": [{"index": index, "delta": delta or {}, "finish_reason": finish}]}
    if usage is not None:
        obj["usage"] = usage
    return obj


USAGE = Usage(10, 2, 7)


def run(chunks, req=None, usage=USAGE, charged=Decimal("0.000003001"), cut=False,
        error=None, usage_payload=None, reported=None):
    req = req or parse(stream=True, tools=[FN])
    stream = CODEC.stream_renderer(req)
    out = b"".join(stream.chunk(json.dumps(c).encode(), c) for c in chunks)
    out += stream.error(error) if error else stream.end(
        usage, charged, relayed(cut, usage_payload=usage_payload, reported=reported))
    return out, stream


def events(raw):
    """Parse and type-check every framed event; check the framing and the numbering."""
    out = []
    for block in raw.decode().split("\n\n")[:-1]:
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        obj = json.loads(data[6:], parse_float=Decimal)
        assert obj["type"] == head[7:]
        EVENTS.validate_python(json.loads(data[6:]))
        out.append(obj)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def sdk_final(raw, **kwargs):
    """Feed ``raw`` to the openai SDK's own ``responses.stream`` and return its final
    response (what a client of Kiln would get)."""
    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=raw))
    client = openai.OpenAI(api_key="k", base_url="http://kiln.test/v1",
                           http_client=httpx.Client(transport=transport))
    with client.responses.stream(model="m", input="Hello", **kwargs) as stream:
        seen = [e.type for e in stream]
        return stream.get_final_response(), seen


def test_text_stream_in_openais_order_and_the_sdk_accumulates_it():
    raw, stream = run([chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}),
                       chunk({"content": "lo"}), chunk(finish="stop")])
    ev = events(raw)
    assert [e["type"] for e in ev] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert ev[-1]["response"]["usage"]["cost"] == Decimal("0.000003001")
    assert ev[0]["response"]["status"] == "in_progress" and ev[0]["response"]["output"] == []
    final, _ = sdk_final(raw)
    assert final.output_text == "Hello" and final.status == "completed"
    assert final.usage.input_tokens == 10 and final.usage.output_tokens == 7
    assert stream.response()["usage"]["cost"] == Decimal("0.000003001")
    assert stream.response() == ev[-1]["response"]  # what is stored is what was told


def test_reasoning_then_text():
    raw, stream = run([chunk({"reasoning_content": "Think"}), chunk({"reasoning": "ing."}),
                       chunk({"content": "Answer"}), chunk(finish="stop")])
    types = [e["type"] for e in events(raw)]
    assert types.index("response.reasoning_text.done") < types.index(
        "response.output_text.delta")
    assert types.count("response.reasoning_text.delta") == 2
    final, _ = sdk_final(raw)
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Thinking." and final.output_text == "Answer"


def _frag(index, id=None, name=None, arguments=None):
    call = {"index": index, "type": "function", "function": {}}
    if id:
        call["id"] = id
    if name:
        call["function"]["name"] = name
    if arguments is not None:
        call["function"]["arguments"] = arguments
    return chunk({"tool_calls": [call]})


def test_tool_call_fragments_by_index():
    raw, _ = run([chunk({"content": "Let me look."}),
                  _frag(0, "call_a", "get_weather", ""), _frag(0, arguments="{\"ci"),
                  _frag(1, "call_b", "get_weather", "{\"city\""), _frag(0, arguments="ty\":1}"),
                  _frag(1, arguments=":2}"), chunk(finish="tool_calls")])
    ev = events(raw)
    deltas = [e["delta"] for e in ev if e["type"] == "response.function_call_arguments.delta"]
    assert deltas == ["{\"ci", "{\"city\"", "ty\":1}", ":2}"]
    final, _ = sdk_final(raw, tools=[FN])
    calls = [o for o in final.output if o.type == "function_call"]
    assert [(c.call_id, c.arguments) for c in calls] == [("call_a", "{\"city\":1}"),
                                                         ("call_b", "{\"city\":2}")]
    assert final.output_text == "Let me look."


def test_tool_calls_all_at_index_0_with_different_ids_are_separate_calls():
    raw, stream = run([_frag(0, "call_a", "f", "{\"a\":"), _frag(0, "call_a", None, "1}"),
                       _frag(0, "call_b", "g", "{}"), chunk(finish="tool_calls")])
    final, _ = sdk_final(raw, tools=[FN])
    assert [(c.call_id, c.name, c.arguments) for c in final.output] == [
        ("call_a", "f", "{\"a\":1}"), ("call_b", "g", "{}")]
    assert len({c.id for c in final.output}) == 2


def test_usage_missing_end_still_tells_kilns_usage():
    raw, stream = run([chunk({"content": "x"})], usage=Usage(4, 0, 1, estimated=True),
                      charged=Decimal("0.0000007"))
    last = events(raw)[-1]
    assert last["type"] == "response.completed"
    assert last["response"]["usage"]["estimated"] is True
    assert last["response"]["usage"]["cost"] == Decimal("0.0000007")


def test_cut_is_incomplete():
    raw, stream = run([chunk({"content": "long"})], cut=True)
    ev = events(raw)
    assert ev[-1]["type"] == "response.incomplete"
    assert ev[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert "response.completed" not in [e["type"] for e in ev]
    final = stream.response()
    assert final["status"] == "incomplete" and final["output"][0]["status"] == "incomplete"
    Response.model_validate(json.loads(json.dumps(final, default=float)))


def test_length_finish_is_incomplete_too():
    raw, _ = run([chunk({"content": "x"}), chunk(finish="length")])
    assert events(raw)[-1]["type"] == "response.incomplete"


def test_error_after_start_fails_the_response_and_never_completes():
    from gateway.errors import UpstreamError
    err = UpstreamError("The model backend failed mid-stream.")
    raw, stream = run([chunk({"content": "par"})], error=err)
    ev = events(raw)
    types = [e["type"] for e in ev]
    assert types[-2:] == ["error", "response.failed"] and "response.completed" not in types
    assert ev[-2]["code"] == "upstream_error" and ev[-2]["message"] == err.message
    failed = ev[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert stream.response()["status"] == "failed"
    with pytest.raises(RuntimeError, match="response.completed"):  # the SDK has none to give
        sdk_final(raw)


def test_error_before_any_chunk_still_starts_the_stream():
    from gateway.errors import UpstreamError
    raw, _ = run([], error=UpstreamError("gone"))
    assert [e["type"] for e in events(raw)] == ["response.created", "response.in_progress",
                                                "error", "response.failed"]


def test_refusal_stream():
    raw, _ = run([chunk({"refusal": "I can't"}), chunk({"refusal": " help."}),
                  chunk(finish="stop")])
    final, _ = sdk_final(raw)
    assert final.output[0].content[0].refusal == "I can't help."


REASONING_USAGE = {"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17,
                   "completion_tokens_details": {"reasoning_tokens": 5}}


@pytest.mark.parametrize("where", ["usage_chunk", "running_usage"])
def test_stream_reports_the_backends_reasoning_tokens(where):
    """The usage-only chunk is held by the flow (never a ``chunk``): ``end`` reads it, or the
    backend's last running usage, for ``output_tokens_details.reasoning_tokens``."""
    held = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [], "usage": REASONING_USAGE}
    kwargs = ({"usage_payload": json.dumps(held).encode()} if where == "usage_chunk"
              else {"reported": REASONING_USAGE})
    raw, stream = run([chunk({"reasoning_content": "Hmm."}), chunk({"content": "Hi"}),
                       chunk(finish="stop")], **kwargs)
    last = events(raw)[-1]
    assert last["response"]["usage"]["output_tokens_details"] == {"reasoning_tokens": 5}
    assert stream.response()["usage"]["output_tokens_details"]["reasoning_tokens"] == 5
    final, _ = sdk_final(raw)
    assert final.usage.output_tokens_details.reasoning_tokens == 5


@pytest.mark.parametrize("reported", [None, {"completion_tokens": 7},
                                      {"completion_tokens_details": {"reasoning_tokens": -3}},
                                      {"completion_tokens_details": {"reasoning_tokens": "5"}}])
def test_stream_reasoning_tokens_are_zero_unless_the_backend_says_them(reported):
    raw, _ = run([chunk({"content": "Hi"}), chunk(finish="stop")], reported=reported,
                 usage_payload=b"not json")
    usage = events(raw)[-1]["response"]["usage"]
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}


@pytest.mark.parametrize("tool", [
    {"type": "function", "name": "lookup", "parameters": {"type": "object"}},
    {"type": "function", "name": "lookup", "description": "", "parameters": {"type": "object"}},
    {"type": "function", "name": "lookup", "description": "  ", "strict": False,
     "parameters": {"type": "object"}}])
def test_a_function_tool_without_a_description_is_accepted_as_openai_does(tool):
    """The Agents SDK sends a function's docstring as its description, and none without one;
    OpenAI accepts that, and the backend gets the tool's name in its place."""
    req = parse(tools=[tool])
    assert req.params["tools"][0]["function"]["description"] == "lookup"
    assert req.params["tools"][0]["function"]["name"] == "lookup"
    body = json.loads(CODEC.render_json(_completion("x"), Usage(1, 0, 1), Decimal(0), req))
    assert body["tools"] == [tool]  # echoed as sent


def test_a_function_tool_description_of_the_wrong_type_is_still_a_400():
    refused("tools[0].description", "invalid_type",
            tools=[{"type": "function", "name": "f", "description": 3}])
    refused("tools[0].name", tools=[{"type": "function", "description": "d"}])
