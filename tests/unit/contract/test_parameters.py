"""The body Kiln builds for each backend, as plain functions (no HTTP): every field of the OpenAI
chat request is forwarded, rewritten, dropped or refused, and this file lists which."""
import re
import typing

import pytest
from openai.types.chat.completion_create_params import (CompletionCreateParamsBase,
                                                        CompletionCreateParamsStreaming)

from factories import model_entry
from gateway.errors import InvalidRequest, UnsupportedParameter
from gateway.contract.parameters import PARAMETERS, upstream_body
from gateway.contract.validation import validate_chat
from gateway_proc import ROOT

pytestmark = pytest.mark.unit

MESSAGES = [{"role": "user", "content": "hi"}]

# What Kiln does with each field of the OpenAI chat completions request (the installed openai
# SDK's CompletionCreateParams, checked below) and with the length and sampling fields of the
# model servers it fronts (NOT_OPENAI). A new field in PARAMETERS or in the SDK must be added
# here, on purpose.
REWRITTEN = ("model", "messages", "stream", "stream_options", "max_tokens",
             "max_completion_tokens", "n_predict", "max_new_tokens", "parallel_tool_calls",
             "functions", "function_call")
FORWARDED = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "n",
             "stop", "logit_bias", "logprobs", "top_logprobs", "tools", "tool_choice",
             "response_format", "reasoning_effort", "ignore_eos", "min_tokens")
DROPPED = ("user", "metadata", "store", "service_tier", "prompt_cache_key",
           "prompt_cache_retention", "prompt_cache_options", "safety_identifier", "verbosity",
           "modalities", "prediction")
REFUSED = ("audio", "web_search_options", "moderation")
EXPECTED = {**dict.fromkeys(REWRITTEN, "rewritten"), **dict.fromkeys(FORWARDED, "forwarded"),
            **dict.fromkeys(DROPPED, "dropped"), **dict.fromkeys(REFUSED, "refused")}
NOT_OPENAI = {"n_predict", "max_new_tokens", "ignore_eos", "min_tokens"}
# A valid value for each field that a request may carry on its own.
SAMPLE = {
    "temperature": 0.5, "top_p": 0.9, "presence_penalty": 1, "frequency_penalty": -1,
    "seed": 7, "n": 2, "stop": ["END"], "logit_bias": {"42": 5}, "logprobs": True,
    "top_logprobs": 2, "reasoning_effort": "low", "ignore_eos": True, "min_tokens": 3,
    "response_format": {"type": "text"}, "user": "u-1", "metadata": {"a": "b"}, "store": False,
    "service_tier": "auto", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "safety_identifier": "s", "verbosity": "low", "modalities": ["text"],
    "prediction": {"type": "content", "content": "x"},
    "tools": [{"type": "function", "function": {"name": "f", "description": "d"}}],
    "tool_choice": "auto",
}


def entry(server="generic", **kw):
    return model_entry(server, max_output_tokens=512, **kw)


def build(server="generic", model=None, **fields):
    model = model or entry(server)
    chat = validate_chat({"model": "m", "messages": MESSAGES, **fields}, {"m": model}, 100)
    return chat, upstream_body(chat, model.backends[0])


def sdk_fields():
    """The top-level fields of the installed openai SDK's chat request, with their types."""
    return typing.get_type_hints(CompletionCreateParamsStreaming)


def literal_values(hint):
    """The enumerated values a type allows (``Optional[Literal[...]]``, ``List[Literal]``)."""
    if typing.get_origin(hint) is typing.Literal:
        return list(typing.get_args(hint))
    return [v for arg in typing.get_args(hint) if arg is not type(None)
            for v in literal_values(arg)]


def test_every_field_has_the_treatment_this_table_lists():
    assert PARAMETERS == EXPECTED


def test_every_field_of_the_openai_sdk_has_a_row():
    sdk = set(CompletionCreateParamsBase.__annotations__) | {"stream"}
    assert sdk == set(sdk_fields())
    assert sorted(sdk - set(PARAMETERS)) == []
    assert set(PARAMETERS) - sdk == NOT_OPENAI


ENUMERATED = sorted((name, value) for name, hint in sdk_fields().items()
                    if PARAMETERS[name] in ("forwarded", "dropped")
                    for value in literal_values(hint))


def test_the_sdk_enumerates_the_values_kiln_checks():
    assert {n for n, _ in ENUMERATED} == {"modalities", "prompt_cache_retention",
                                          "reasoning_effort", "service_tier", "tool_choice",
                                          "verbosity"}


@pytest.mark.parametrize("name,value", ENUMERATED)
def test_every_enumerated_value_of_the_sdk_is_accepted(name, value):
    sent = [value] if name == "modalities" else value
    if (name, value) == ("modalities", "audio"):  # no audio output: refused by name
        with pytest.raises(UnsupportedParameter) as err:
            build(**{name: sent})
        assert err.value.param == name
        return
    # On a model whose catalog entry allows what a value needs (forced tool choice).
    chat, _ = build(model=entry(forced_tool_choice=True), **{name: sent})
    assert chat.params[name] == sent


@pytest.mark.parametrize("name,value", [
    ("reasoning_effort", "extreme"), ("service_tier", "turbo"), ("verbosity", "max"),
    ("prompt_cache_retention", "1h"), ("prompt_cache_options", {"ttl": "1h"}),
    ("prompt_cache_options", {"mode": "sometimes"}), ("prompt_cache_options", "30m")])
def test_values_outside_the_enumeration_are_refused(name, value):
    with pytest.raises(InvalidRequest) as err:
        build(**{name: value})
    assert err.value.param.split(".")[0] == name and err.value.status == 400


def test_an_unknown_prompt_cache_option_names_itself():
    with pytest.raises(InvalidRequest) as err:
        build(prompt_cache_options={"mode": "explicit", "breakpoints": 4})
    assert (err.value.param, err.value.code) == ("prompt_cache_options.breakpoints",
                                                 "unknown_parameter")


def test_the_docs_table_says_the_same():
    text = (ROOT / "docs" / "PARAMETERS.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| (rewritten|forwarded|dropped|refused) \|",
                           text, flags=re.M))
    assert rows == EXPECTED


@pytest.mark.parametrize("name", sorted(n for n, t in EXPECTED.items() if t == "dropped"))
def test_dropped_fields_are_accepted_and_never_sent(name):
    _, body = build(**{name: SAMPLE[name]})
    assert name not in body


@pytest.mark.parametrize("name", sorted(n for n, t in EXPECTED.items() if t == "forwarded"))
def test_forwarded_fields_reach_the_families_that_read_them(name):
    fields = {name: SAMPLE[name]}
    if name == "top_logprobs":
        fields["logprobs"] = True
    _, vllm = build("vllm", **fields)
    assert vllm[name] == SAMPLE[name]
    if name == "n":  # refused for a model whose server answers one choice (below)
        return
    _, llama = build("llama-cpp-python", **fields)
    assert (name in llama) == (name not in ("reasoning_effort", "ignore_eos", "min_tokens"))


@pytest.mark.parametrize("server", ["llama-cpp-python", "llama.cpp"])
def test_several_choices_are_refused_where_the_server_returns_one(server):
    with pytest.raises(InvalidRequest) as err:
        build(server, n=2)
    assert (err.value.status, err.value.param, err.value.code) == (400, "n", "unsupported_value")
    _, body = build(server, n=1)  # one choice is what it gives: accepted, not sent
    assert "n" not in body


@pytest.mark.parametrize("name", REFUSED)
def test_refused_fields_name_themselves(name):
    with pytest.raises(UnsupportedParameter) as err:
        build(**{name: {"x": 1}})
    assert err.value.param == name


@pytest.mark.parametrize("name", ["top_k", "repetition_penalty", "grammar", "guided_json",
                                  "vendor_knob"])
def test_unknown_fields_are_refused_as_openai_does(name):
    with pytest.raises(InvalidRequest) as err:
        build(**{name: 1})
    assert err.value.param == name and err.value.code == "unknown_parameter"


def test_fields_the_catalog_allows_are_forwarded_as_sent():
    model = entry("vllm", extra_params=("top_k", "repetition_penalty"))
    _, body = build(model=model, top_k=40, repetition_penalty=1.1)
    assert body["top_k"] == 40 and body["repetition_penalty"] == 1.1


@pytest.mark.parametrize("server,fields", [
    ("generic", {"max_tokens": 1, "max_completion_tokens": 1}),
    ("vllm", {"max_tokens": 1, "max_completion_tokens": 1}),
    ("sglang", {"max_tokens": 1, "max_completion_tokens": 1}),
    ("openai", {"max_tokens": 1, "max_completion_tokens": 1}),
    ("llama-cpp-python", {"max_tokens": 1}),
    ("llama.cpp", {"max_tokens": 1, "n_predict": 1}),
])
@pytest.mark.parametrize("sent", [{"max_completion_tokens": 1, "max_tokens": 500},
                                  {"max_tokens": 1, "max_completion_tokens": 500},
                                  {"max_tokens": 1, "n_predict": 400},
                                  {"max_new_tokens": 1}])
def test_the_backend_is_sent_the_cap_kiln_held_for_in_every_length_field_it_reads(
        server, fields, sent):
    chat, body = build(server, **sent)
    assert chat.max_tokens == 1
    lengths = {k: v for k, v in body.items()
               if k in ("max_tokens", "max_completion_tokens", "n_predict", "max_new_tokens")}
    assert lengths == fields


def test_without_a_length_the_backend_is_sent_the_model_max_output():
    chat, body = build("vllm")
    assert chat.max_tokens == 512 and body["max_tokens"] == body["max_completion_tokens"] == 512


def test_min_tokens_above_the_cap_is_refused():
    with pytest.raises(InvalidRequest) as err:
        build("vllm", max_completion_tokens=1, min_tokens=600)
    assert err.value.param == "min_tokens"


@pytest.mark.parametrize("server,role", [("openai", "developer"), ("generic", "system"),
                                         ("vllm", "system"), ("llama-cpp-python", "system")])
def test_the_developer_role_is_sent_as_the_family_reads_it(server, role):
    messages = [{"role": "developer", "content": "Be brief."}, *MESSAGES]
    _, body = build(server, messages=messages)
    assert body["messages"][0] == {"role": role, "content": "Be brief."}
    assert messages[0]["role"] == "developer"  # the client's objects are left alone


def test_text_parts_are_joined_for_families_that_want_strings():
    messages = [{"role": "system", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "b"}]},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    _, llama = build("llama-cpp-python", messages=messages)
    assert [m["content"] for m in llama["messages"]] == ["ab", "hi"]
    _, vllm = build("vllm", messages=messages)
    assert vllm["messages"][0]["content"] == messages[0]["content"]


def test_assistant_history_is_sent_without_openai_platform_fields():
    messages = [*MESSAGES,
                {"role": "assistant", "content": None, "refusal": "no", "audio": {"id": "a1"},
                 "function_call": {"name": "f", "arguments": "{}"}},
                {"role": "function", "name": "f", "content": "42"}]
    _, body = build(messages=messages)
    assistant, answer = body["messages"][1:]
    assert "refusal" not in assistant and "audio" not in assistant
    assert assistant["tool_calls"] == [{"id": "f", "type": "function",
                                        "function": {"name": "f", "arguments": "{}"}}]
    assert answer == {"role": "tool", "tool_call_id": "f", "content": "42"}


def test_deprecated_functions_become_tools():
    functions = [{"name": "f", "description": "does f", "parameters": {"type": "object"}}]
    _, body = build(model=entry(forced_tool_choice=True), functions=functions,
                    function_call={"name": "f"})
    assert body["tools"] == [{"type": "function", "function": functions[0]}]
    assert "functions" not in body and "function_call" not in body
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    _, auto = build(functions=functions, function_call="auto")
    assert auto["tool_choice"] == "auto"
    with pytest.raises(UnsupportedParameter):  # forced, on a model that cannot honour it
        build(functions=functions, function_call={"name": "f"})


def test_streams_always_ask_for_usage_and_vllm_for_running_usage():
    chat, body = build("generic", stream=True, stream_options={"include_usage": False})
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert chat.include_usage is False
    _, vllm = build("vllm", stream="true")
    assert vllm["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    _, plain = build()
    assert plain["stream"] is False and "stream_options" not in plain


def test_parallel_tool_calls_forwarded_only_where_honoured():
    chat, body = build(parallel_tool_calls=False)
    assert "parallel_tool_calls" not in body and chat.single_tool_call
    capable = entry(parallel_tool_calls=True)
    chat, body = build(model=capable, parallel_tool_calls=False)
    assert body["parallel_tool_calls"] is False and not chat.single_tool_call


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather."}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Time."}}
NAMED = {"type": "function", "function": {"name": "get_time"}}


def test_a_named_tool_choice_reaches_llama_server_as_required_with_that_tool_only():
    """llama-server reads ``tool_choice`` as a string only (a named one falls back to "auto"):
    it is sent "required" with the named function the only tool, which forces the same call;
    the client's ``tools`` are left as sent, and other families get the named choice as is."""
    tools = [WEATHER, TIME]
    chat, body = build(model=entry("llama.cpp", forced_tool_choice=True), tools=tools,
                       tool_choice=NAMED)
    assert body["tool_choice"] == "required" and body["tools"] == [TIME]
    assert chat.params["tools"] == [WEATHER, TIME] and chat.params["tool_choice"] == NAMED
    _, required = build(model=entry("llama.cpp", forced_tool_choice=True), tools=tools,
                        tool_choice="required")
    assert required["tool_choice"] == "required" and required["tools"] == tools
    for server in ("generic", "vllm", "llama-cpp-python"):
        _, other = build(model=entry(server, forced_tool_choice=True), tools=tools,
                         tool_choice=NAMED)
        assert other["tool_choice"] == NAMED and other["tools"] == tools


@pytest.mark.parametrize("tools", [None, [WEATHER]])
def test_a_named_tool_choice_must_name_one_of_the_tools(tools):
    with pytest.raises(InvalidRequest) as err:
        build(model=entry(forced_tool_choice=True), tools=tools, tool_choice=NAMED)
    assert err.value.param == "tool_choice.function.name"
    assert err.value.code == "invalid_value"
