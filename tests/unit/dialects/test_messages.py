"""The Anthropic Messages codec (gateway/dialects/messages*.py; docs/MESSAGES.md), in process.

The official ``anthropic`` SDK is the judge of shapes: its types give the fields a request may
carry, and its client, on a transport that answers with the codec's bytes, parses the JSON
message, the event stream and the error envelopes.
"""
import json
import re
import typing
from decimal import Decimal

import anthropic
import httpx2
from types import SimpleNamespace

import pytest
from anthropic.types import content_block_param, message_count_tokens_params, tool_param
from anthropic.types.beta import message_count_tokens_params as beta_count_params
from anthropic.types.beta.message_create_params import \
    MessageCreateParamsBase as BetaMessageCreateParamsBase
from anthropic.types.message_create_params import MessageCreateParamsBase

from factories import model_entry
from gateway.billing import Usage
from gateway.dialects import messages_blocks as blocks
from gateway.dialects import messages_request as req
from gateway.dialects.messages import MessagesCodec
from gateway.dialects.messages_stream import ERROR_TYPES, KEEPALIVE
from gateway.errors import (DatabaseBusy, Forbidden, GatewayError, InsufficientCredits,
                            InternalError, InvalidRequest, ModelNotFound, PayloadTooLarge,
                            RateLimited, ServiceUnavailable, Unauthorized, UpstreamError,
                            UpstreamTimeout)

pytestmark = pytest.mark.unit


def relayed(cut, matched_stops=None):
    """What the flow tells a stream's end of what it relayed (gateway.flow.rules.StreamRules)."""
    return SimpleNamespace(cut=cut, matched_stops=matched_stops or {})

CODEC = MessagesCodec()
CATALOG = {
    "m": model_entry(),  # 4096-token window, 1024 max output, text only
    "vision": model_entry(id="vision", input=("text", "image"), forced_tool_choice=True,
                          image_hosts=("93.184.216.34",)),
    "gpt-oss": model_entry(id="gpt-oss", family="gpt-oss", parallel_tool_calls=True,
                           forced_tool_choice=True, extra_params=("top_k",)),
}
USER = [{"role": "user", "content": "Hello"}]
TOOL = {"name": "get_weather", "description": "Weather now.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9aw"
       "AAAABJRU5ErkJggg==")


def body(**changes):
    out = {"model": "m", "max_tokens": 100, "messages": USER, **changes}
    return {k: v for k, v in out.items() if v is not None}


def parse(**changes):
    b = body(**changes)
    return CODEC.parse(b, CATALOG, len(json.dumps(b)))


def chat_of(**changes):
    return req.translate(body(**changes), CATALOG).chat


def refused(**changes):
    with pytest.raises(GatewayError) as info:
        parse(**changes)
    return info.value


# -- the fields, against the SDK ------------------------------------------------------------

def test_fields_are_the_sdks():
    """Every field of the SDK's MessageCreateParams, and of the beta API's (Claude Code's
    ``?beta=true``; ``betas`` is the ``anthropic-beta`` header, not a body field), has a row,
    and no other but ``stream`` and the sampling fields the reference documents: a new SDK
    field fails here."""
    sdk = set(MessageCreateParamsBase.__annotations__) | {"stream"}
    beta = set(BetaMessageCreateParamsBase.__annotations__) - {"betas"}
    assert beta - sdk == set(req.BETA_FIELDS)
    assert set(req.FIELDS) - sdk - beta == set(req.LEGACY_SAMPLING)
    assert sdk | beta <= set(req.FIELDS)
    counted = set(message_count_tokens_params.MessageCountTokensParams.__annotations__)
    beta_counted = set(beta_count_params.MessageCountTokensParams.__annotations__) - {"betas"}
    assert set(req.COUNT_FIELDS) == counted | beta_counted


def _literal(annotation):
    return re.findall(r"'([a-z_0-9]+)'", str(annotation))


def test_block_keys_are_the_sdks():
    """Each block Kiln takes accepts exactly the SDK's keys; each block type of the SDK is
    taken or refused by name."""
    kinds = {}
    for cls in typing.get_args(content_block_param.ContentBlockParam):
        (kind,) = _literal(cls.__annotations__["type"])
        kinds[kind] = set(cls.__annotations__)
    for kind, keys in blocks.BLOCK_KEYS.items():
        assert keys == kinds[kind], kind
    assert set(kinds) <= set(blocks.BLOCK_KEYS) | set(blocks.UNSUPPORTED_BLOCKS)
    assert req.CUSTOM_TOOL_KEYS == set(tool_param.ToolParam.__annotations__)


MAPPED = [
    ("model", "m", lambda c: c.entry.id == "m"),
    ("max_tokens", 77, lambda c: c.max_tokens == 77),
    ("messages", [{"role": "user", "content": "Hi there"}],
     lambda c: c.messages == [{"role": "user", "content": "Hi there"}]),
    ("system", "Be brief.",
     lambda c: c.messages[0] == {"role": "system", "content": "Be brief."}),
    ("stop_sequences", ["\n\n", "END"], lambda c: c.stop == ("\n\n", "END")),
    ("stream", True, lambda c: c.stream and c.include_usage),
    ("temperature", 0.5, lambda c: c.params["temperature"] == 0.5),
    ("top_p", 0.9, lambda c: c.params["top_p"] == 0.9),
    ("tools", [TOOL], lambda c: c.params["tools"][0]["function"]["parameters"]
     == TOOL["input_schema"]),
    ("tool_choice", {"type": "none"}, lambda c: c.params.get("tool_choice") is None),
    ("metadata", {"user_id": "u-1"}, lambda c: c.params["user"] == "u-1"),
    ("thinking", {"type": "enabled", "budget_tokens": 1024},
     lambda c: "reasoning_effort" not in c.params),  # model "m" does not read it
    ("output_config", {"effort": "high"}, lambda c: "reasoning_effort" not in c.params),
    ("top_k", 40, lambda c: "top_k" not in c.extras),  # "m" does not allow it: dropped
]


@pytest.mark.parametrize("field,value,check", MAPPED, ids=[m[0] for m in MAPPED])
def test_mapped_field(field, value, check):
    assert check(parse(**{"max_tokens": 2000, field: value}))


DROPPED = [("service_tier", "standard_only"), ("cache_control", {"type": "ephemeral"}),
           ("container", "container_1"), ("diagnostics", {"previous_message_id": None}),
           ("inference_geo", "us"), ("speed", "fast"), ("user_profile_id", "up_1"),
           ("workspace_id", "wrkspc_1"),
           # what Claude Code sends (docs/MESSAGES.md, "Claude Code")
           ("context_management", {"edits": [{"type": "clear_thinking_20251015",
                                              "keep": "all"}]}),
           ("mcp_servers", [{"type": "url", "url": "https://mcp.example/sse", "name": "x"}]),
           ("fallbacks", "default"), ("fallback_credit_token", "fct_1"),
           ("billing_policy", {"type": "billing_policy", "bill_to": "self"})]
UNSUPPORTED = [("compaction", {"type": "compaction"}), ("thread", {"type": "create"})]


@pytest.mark.parametrize("field,value", DROPPED, ids=[d[0] for d in DROPPED])
def test_dropped_field(field, value):
    """Accepted, checked, and nothing of it reaches the backend."""
    assert req.FIELDS[field] == req.DROPPED
    assert chat_of(**{field: value}) == chat_of()
    parse(**{field: value})


@pytest.mark.parametrize("field,value", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_field(field, value):
    """In the reference, but nothing Kiln can do: a 400 naming it, not a silent drop."""
    assert req.FIELDS[field] == req.UNSUPPORTED
    err = refused(**{field: value})
    assert (err.status, err.param, err.code) == (400, field, "unsupported_parameter")


def test_count_tokens_ignores_compaction_as_anthropic_does():
    b = {"model": "m", "messages": USER, "compaction": {"type": "compaction"},
         "context_management": {"edits": []}}
    assert CODEC.count_tokens(b, CATALOG, len(json.dumps(b)), lambda text: None)["input_tokens"]


def test_billing_someone_else_is_refused():
    err = refused(billing_policy={"type": "billing_policy", "bill_to": "user_profile"})
    assert (err.status, err.param) == (400, "billing_policy.bill_to")


def test_every_field_has_a_test():
    tested = {m[0] for m in MAPPED} | {d[0] for d in DROPPED} | {u[0] for u in UNSUPPORTED}
    assert tested == set(req.FIELDS)


@pytest.mark.parametrize("field", ["n", "frequency_penalty", "response_format", "stop", "user",
                                   "max_completion_tokens", "foo"])
def test_fields_outside_the_reference_are_refused(field):
    err = refused(**{field: 1})
    assert (err.status, err.param) == (400, field)
    assert "Extra inputs are not permitted" in err.message


@pytest.mark.parametrize("changes,param", [
    ({"service_tier": "priority"}, "service_tier"),
    ({"speed": "slow"}, "speed"),
    ({"temperature": 1.5}, "temperature"),  # Anthropic's range is 0..1
    ({"top_p": -0.1}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"metadata": {"user_id": "u", "tier": "x"}}, "metadata.tier"),
    ({"cache_control": {"type": "ephemeral", "ttl": "2h"}}, "cache_control.ttl"),
    ({"stream": "yes"}, "stream"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"thinking": {"type": "enabled", "budget_tokens": 512}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}}},
     "output_config.format"),  # "m" takes no response_format: the chat contract refuses
    ({"model": "nope"}, "model"),
])
def test_bad_values_are_refused_naming_the_field(changes, param):
    assert refused(**changes).param == param


def test_max_tokens_required_and_lowered_to_the_models_maximum():
    assert refused(max_tokens=None).param == "max_tokens"
    assert refused(max_tokens=0).param == "max_tokens"
    chat = parse(max_tokens=32000)
    entry = CATALOG["m"]
    assert chat.max_tokens == entry.max_output_tokens
    assert chat.response_headers == {
        req.MAX_TOKENS_LOWERED_HEADER: f"32000->{entry.max_output_tokens}"}
    assert parse(max_tokens=entry.max_output_tokens).response_headers == {}


def test_thinking_maps_to_reasoning_effort_where_the_model_reads_it():
    for budget, effort in ((1024, "low"), (8000, "medium"), (20000, "high")):
        b = body(model="gpt-oss", max_tokens=32000,
                 thinking={"type": "enabled", "budget_tokens": budget})
        chat = CODEC.parse(b, CATALOG, 500)
        assert chat.params["reasoning_effort"] == effort
        assert chat.max_tokens == CATALOG["gpt-oss"].max_output_tokens  # the hold's cap
    explicit = body(model="gpt-oss", output_config={"effort": "max"},
                    thinking={"type": "adaptive"})
    assert CODEC.parse(explicit, CATALOG, 500).params["reasoning_effort"] == "max"
    off = body(model="gpt-oss", thinking={"type": "disabled"})
    assert "reasoning_effort" not in CODEC.parse(off, CATALOG, 500).params


def test_top_k_forwarded_where_the_catalog_allows_it():
    b = body(model="gpt-oss", top_k=20)
    assert CODEC.parse(b, CATALOG, 500).extras == {"top_k": 20}


# -- blocks ---------------------------------------------------------------------------------

def test_text_and_image_blocks():
    content = [{"type": "text", "text": "What is this?", "cache_control": {"type": "ephemeral"}},
               {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": PNG}},
               {"type": "image", "source": {"type": "url",
                                            "url": "https://93.184.216.34/cat.png"}}]
    chat = parse(model="vision", messages=[{"role": "user", "content": content}])
    assert chat.has_images
    assert chat.messages == [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
        {"type": "image_url", "image_url": {"url": "https://93.184.216.34/cat.png"}}]}]


def test_image_on_a_text_model_is_refused_in_anthropic_terms():
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": PNG}}]
    err = refused(system="s", messages=[{"role": "user", "content": content}])
    assert err.param == "messages.0.content.1"
    assert "messages.0.content.1" in err.message and "[" not in err.param


@pytest.mark.parametrize("block,param", [
    ({"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}},
     "messages.0.content.0"),
    ({"type": "image", "source": {"type": "file", "file_id": "f"}},
     "messages.0.content.0.source"),
    ({"type": "text", "text": "x", "extra": 1}, "messages.0.content.0.extra"),
    ({"type": "tool_use", "id": "t", "name": "n", "input": {}}, "messages.0.content.0.type"),
    ({"type": "server_tool_use", "id": "t", "name": "web_search", "input": {}},
     "messages.0.content.0"),
])
def test_blocks_refused(block, param):
    err = refused(model="vision", messages=[{"role": "user", "content": [block]}])
    assert err.param == param


def test_tool_loop_shapes():
    """tool_use -> assistant tool_calls (input as JSON text); tool_result -> tool messages
    (string or block content, is_error told), then the user's other blocks; thinking blocks
    sent back are dropped."""
    messages = [
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Two calls.", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather",
             "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "timeout"}]},
            {"type": "text", "text": "Summarise."}]},
    ]
    chat = parse(messages=messages, tools=[TOOL])
    assert chat.messages[1] == {"role": "assistant",
                                "content": [{"type": "text", "text": "Checking."}],
                                "tool_calls": [
        {"id": "toolu_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "toolu_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    assert chat.messages[2:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "toolu_2",
         "content": blocks.TOOL_ERROR_PREFIX + "timeout"},
        {"role": "user", "content": [{"type": "text", "text": "Summarise."}]}]


def test_tool_result_images_follow_as_a_user_message():
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG}}
    messages = [{"role": "user", "content": "Screenshot?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1",
                                                   "name": "shot", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": [{"type": "text", "text": "ok"},
                                                          image]}]}]
    chat = parse(model="vision", messages=messages)
    assert chat.messages[1]["content"] is None
    assert chat.messages[2:] == [
        {"role": "tool", "tool_call_id": "t1", "content": "ok"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": f"data:image/png;base64,{PNG}"}}]}]


def test_system_blocks_and_system_role_messages():
    chat = parse(system=[{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}},
                         {"type": "text", "text": "B"}],
                 messages=[{"role": "system", "content": "C"}, *USER])
    assert chat.messages[:2] == [
        {"role": "system", "content": [{"type": "text", "text": "A"},
                                       {"type": "text", "text": "B"}]},
        {"role": "system", "content": "C"}]


# -- tools ----------------------------------------------------------------------------------

SERVER_TOOLS = [{"type": "web_search_20250305", "name": "web_search"},
                {"type": "bash_20250124", "name": "bash"},
                {"type": "computer_toolset_20260801"}]


def test_server_tools_offered_are_left_out():
    chat = parse(model="vision", tools=[*SERVER_TOOLS, TOOL], tool_choice={"type": "auto"})
    assert [t["function"]["name"] for t in chat.params["tools"]] == ["get_weather"]
    only_server = parse(model="vision", tools=SERVER_TOOLS, tool_choice={"type": "auto"})
    assert "tools" not in only_server.params and "tool_choice" not in only_server.params


@pytest.mark.parametrize("choice,param", [({"type": "tool", "name": "web_search"},
                                           "tool_choice.name"),
                                          ({"type": "any"}, "tool_choice")])
def test_server_tool_forced_is_refused(choice, param):
    err = refused(model="vision", tools=SERVER_TOOLS, tool_choice=choice)
    assert (err.status, err.param) == (400, param)


def test_tool_choice_mapping():
    def choice(model, **tc):
        b = body(model=model, tools=[TOOL], tool_choice=tc)
        return CODEC.parse(b, CATALOG, 500)
    assert choice("m", type="auto").params["tool_choice"] == "auto"
    assert choice("m", type="none").params["tool_choice"] == "none"
    assert choice("vision", type="any").params["tool_choice"] == "required"
    assert choice("vision", type="tool", name="get_weather").params["tool_choice"] == {
        "type": "function", "function": {"name": "get_weather"}}
    # forced choice on a model that cannot honour it: the chat contract's refusal, renamed
    with pytest.raises(GatewayError) as info:
        choice("m", type="any")
    assert info.value.param == "tool_choice"
    # disable_parallel_tool_use: forwarded where honoured, else enforced by Kiln
    honoured = choice("gpt-oss", type="auto", disable_parallel_tool_use=True)
    assert honoured.params["parallel_tool_calls"] is False and not honoured.single_tool_call
    enforced = choice("m", type="auto", disable_parallel_tool_use=True)
    assert enforced.single_tool_call


def test_tool_without_description_gets_its_name():
    chat = parse(tools=[{"name": "ls", "input_schema": {"type": "object"}, "type": "custom",
                         "cache_control": {"type": "ephemeral"}, "input_examples": [{}],
                         "eager_input_streaming": True, "defer_loading": False}])
    assert chat.params["tools"] == [{"type": "function", "function": {
        "name": "ls", "description": "ls", "parameters": {"type": "object"}}}]


# -- count_tokens ---------------------------------------------------------------------------

def test_count_tokens_uses_the_tokenizer_and_errs_upward_without_it():
    b = {"model": "m", "messages": USER, "system": "Be brief."}
    with_tokenizer = CODEC.count_tokens(b, CATALOG, 80, lambda text: 5)
    without = CODEC.count_tokens(b, CATALOG, 80, lambda text: None)
    # two messages: the template allowance is 8 per message and 32 per request
    assert with_tokenizer == {"input_tokens": 5 + 2 * 8 + 32}
    assert without == {"input_tokens": len("Be brief.\nHello") + 2 * 8 + 32}
    with pytest.raises(GatewayError) as info:
        CODEC.count_tokens({**b, "max_tokens": 10}, CATALOG, 80, lambda text: 5)
    assert info.value.param == "max_tokens"


# -- answers through the SDK ----------------------------------------------------------------

def sdk_client(status, content, content_type="application/json", headers=None):
    def answer(request):
        return httpx2.Response(status, content=content,
                              headers={"content-type": content_type, **(headers or {})})
    return anthropic.Anthropic(api_key="kiln-test", base_url="http://kiln.test",
                               http_client=httpx2.Client(transport=httpx2.MockTransport(answer)),
                               max_retries=0)


def create(client, stream=False):
    kwargs = dict(model="m", max_tokens=100, messages=USER)
    if stream:
        with client.messages.stream(**kwargs) as s:
            return s.get_final_message()
    return client.messages.create(**kwargs)


def completion(message, finish="stop", **choice):
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, **choice}]}


COST = Decimal("0.000012345")


def test_render_json_is_a_message_the_sdk_reads():
    request = parse()
    raw = CODEC.render_json(completion({"role": "assistant", "content": "Hi!",
                                        "reasoning_content": "Greet."}),
                            Usage(prompt=30, cached=10, completion=5), COST, request)
    assert b'"cost":0.000012345' in raw  # an exact decimal literal, never a float's digits
    assert json.loads(raw, parse_float=Decimal)["usage"]["cost"] == COST
    message = create(sdk_client(200, raw))
    assert isinstance(message, anthropic.types.Message)
    assert message.id.startswith("msg_") and message.model == "m"
    assert [(b.type, getattr(b, "text", None) or getattr(b, "thinking", None))
            for b in message.content] == [("thinking", "Greet."), ("text", "Hi!")]
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens,
            message.usage.output_tokens, message.usage.cache_creation_input_tokens) == (
        20, 10, 5, 0)


def test_render_json_tool_use_and_stop_reasons():
    request = parse(stop_sequences=["END"])
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_2", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": '}}]
    raw = CODEC.render_json(completion({"role": "assistant", "content": None,
                                        "tool_calls": calls}, "tool_calls"),
                            Usage(prompt=3, completion=4), COST, request)
    message = anthropic.types.Message.model_validate_json(raw)
    assert message.stop_reason == "tool_use"
    assert [(b.id, b.name, b.input) for b in message.content] == [
        ("call_1", "get_weather", {"city": "Paris"}),
        ("call_2", "get_weather", {"INVALID_JSON": '{"city": '})]

    def reason(finish, **choice):
        raw = CODEC.render_json(completion({"role": "assistant", "content": "x"}, finish,
                                           **choice), Usage(), Decimal(0), request)
        m = anthropic.types.Message.model_validate_json(raw)
        return m.stop_reason, m.stop_sequence
    assert reason("length") == ("max_tokens", None)
    assert reason("stop", stop_reason="END") == ("stop_sequence", "END")  # vLLM's report
    assert reason("stop", matched_stop="END") == ("stop_sequence", "END")  # SGLang's
    assert reason("stop", stop_reason="OTHER") == ("end_turn", None)


def sse(events):
    return [(m.group(1), json.loads(m.group(2), parse_float=Decimal))
            for m in re.finditer(rb"event: (\w+)\ndata: (.*)\n\n", events)]


def chunk(delta=None, finish=None, usage=None):
    obj = {"id": "c1", "object": "chat.completion.chunk", "model": "m",
           "choices": [] if delta is None and finish is None else
           [{"index": 0, "delta": delta or {}, "finish_reason": finish}]}
    if usage is not None:
        obj["usage"] = usage
    return json.dumps(obj).encode(), obj


def run_stream(chunks, usage, cut=False, request=None, charged=COST):
    stream = CODEC.stream_renderer(request or parse(stream=True))
    out = b"".join(stream.chunk(*c) for c in chunks)
    return out + stream.end(usage, charged, relayed(cut))


def test_stream_of_text_and_reasoning_through_the_sdk():
    raw = run_stream([chunk({"role": "assistant", "content": ""}),
                      chunk({"reasoning_content": "Think"}), chunk({"reasoning": "ing."}),
                      chunk({"content": "Hel"}), chunk({"content": "lo"}),
                      chunk(finish="stop"),
                      chunk(usage={"prompt_tokens": 9, "completion_tokens": 4})],
                     Usage(prompt=9, completion=4, estimated=True))
    names = [name for name, _ in sse(raw)]
    assert names[:2] == [b"message_start", b"ping"]
    assert names[-2:] == [b"message_delta", b"message_stop"]
    delta = sse(raw)[-2][1]
    assert delta["usage"]["cost"] == COST and b'"cost":0.000012345' in raw
    message = create(sdk_client(200, raw, "text/event-stream"), stream=True)
    assert [(b.type, getattr(b, "text", None) or getattr(b, "thinking", None))
            for b in message.content] == [("thinking", "Thinking."), ("text", "Hello")]
    assert (message.stop_reason, message.usage.input_tokens,
            message.usage.output_tokens) == ("end_turn", 9, 4)


@pytest.mark.parametrize("same_index", [False, True])
def test_stream_of_tool_call_fragments(same_index):
    """Each new tool call (a new index, or a new id at the same index as some servers send)
    starts a tool_use block; its argument fragments are input_json_delta."""
    def call(i, **fields):
        return {"tool_calls": [{"index": 0 if same_index else i, **fields}]}
    raw = run_stream([
        chunk({"content": "Let me check."}),
        chunk(call(0, id="call_a", type="function",
                   function={"name": "get_weather", "arguments": ""})),
        chunk(call(0, function={"arguments": '{"city": '})),
        chunk(call(0, function={"arguments": '"Paris"}'})),
        chunk(call(1, id="call_b", type="function",
                   function={"name": "get_weather", "arguments": '{"city": "Oslo"}'})),
        chunk(finish="tool_calls")], Usage(prompt=9, completion=20))
    starts = [e["content_block"] for n, e in sse(raw) if n == b"content_block_start"]
    assert [(b["type"], b.get("id")) for b in starts] == [
        ("text", None), ("tool_use", "call_a"), ("tool_use", "call_b")]
    message = create(sdk_client(200, raw, "text/event-stream"), stream=True)
    assert message.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in message.content] == [
        ("text", None), ("tool_use", {"city": "Paris"}), ("tool_use", {"city": "Oslo"})]


def test_stream_usage_only_chunk_and_usage_missing_end():
    stream = CODEC.stream_renderer(parse(stream=True))
    assert stream.chunk(*chunk(usage={"prompt_tokens": 1})) == b""
    # no chunk with choices ever came: the end still starts the message
    raw = stream.end(Usage(prompt=40, completion=0, estimated=True), Decimal("0.000004"),
                     relayed(False))
    events = sse(raw)
    assert [n for n, _ in events] == [b"message_start", b"ping", b"message_delta",
                                      b"message_stop"]
    usage = events[2][1]["usage"]
    assert usage["input_tokens"] == 40 and usage["estimated"] is True
    assert usage["cost"] == Decimal("0.000004")
    message = create(sdk_client(200, raw, "text/event-stream"), stream=True)
    assert message.content == [] and message.usage.input_tokens == 40


def test_cut_stream_ends_with_max_tokens():
    raw = run_stream([chunk({"content": "a b c"})], Usage(prompt=5, completion=3), cut=True)
    message = create(sdk_client(200, raw, "text/event-stream"), stream=True)
    assert message.stop_reason == "max_tokens" and message.content[0].text == "a b c"


def test_stream_error_event_ends_the_stream():
    stream = CODEC.stream_renderer(parse(stream=True))
    raw = stream.chunk(*chunk({"content": "partial"}))
    raw += stream.error(UpstreamError("The model backend failed mid-stream."))
    events = sse(raw)
    assert events[-1] == (b"error", {"type": "error", "error": {
        "type": "api_error", "message": "The model backend failed mid-stream.",
        "code": "upstream_error"}})
    assert b"message_stop" not in raw
    with pytest.raises(anthropic.APIStatusError) as info:
        create(sdk_client(200, raw, "text/event-stream"), stream=True)
    assert "failed mid-stream" in str(info.value)


def test_keepalive_is_a_ping_event():
    assert sse(KEEPALIVE) == [(b"ping", {"type": "ping"})]
    assert CODEC.stream_renderer(parse(stream=True)).keepalive == KEEPALIVE


# -- errors ---------------------------------------------------------------------------------

ERRORS = [
    (InvalidRequest("bad", param="messages.0"), 400, "invalid_request_error",
     anthropic.BadRequestError),
    (Unauthorized("no key"), 401, "authentication_error", anthropic.AuthenticationError),
    (InsufficientCredits("no money"), 402, "billing_error", anthropic.APIStatusError),
    (Forbidden("revoked", code="key_revoked"), 403, "permission_error",
     anthropic.PermissionDeniedError),
    (ModelNotFound("no model", param="model"), 404, "not_found_error", anthropic.NotFoundError),
    (PayloadTooLarge("too big"), 413, "request_too_large", anthropic.APIStatusError),
    (RateLimited("slow down"), 429, "rate_limit_error", anthropic.RateLimitError),
    (InternalError(), 500, "api_error", anthropic.InternalServerError),
    (UpstreamError("backend down"), 502, "api_error", anthropic.InternalServerError),
    (UpstreamTimeout("backend slow"), 502, "api_error", anthropic.InternalServerError),
    (ServiceUnavailable("maintenance"), 503, "overloaded_error", anthropic.InternalServerError),
    (DatabaseBusy(), 503, "overloaded_error", anthropic.InternalServerError),
]


@pytest.mark.parametrize("err,status,kind,sdk_error", ERRORS,
                         ids=[type(e[0]).__name__ for e in ERRORS])
def test_error_envelope_per_status(err, status, kind, sdk_error):
    got_status, envelope = CODEC.error_body(err)
    assert (got_status, envelope["type"], envelope["error"]["type"]) == (status, "error", kind)
    assert envelope["error"]["message"] == err.message
    assert envelope["error"].get("code") == err.code  # Kiln's own code stays readable
    assert ERROR_TYPES[status] == kind
    with pytest.raises(sdk_error) as info:
        create(sdk_client(status, json.dumps(envelope).encode()))
    assert info.value.status_code == status
    assert info.value.body["error"]["type"] == kind


def test_error_envelope_names_the_generation():
    err = UpstreamError("backend down", headers={"X-Neocloud-Generation-Id": "gen-abc"})
    assert CODEC.error_body(err)[1]["request_id"] == "gen-abc"
