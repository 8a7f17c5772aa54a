"""The keys a message, a content part, a tool and the objects inside them may carry: those of the
current OpenAI chat API (the installed openai SDK's types), no other, and what a backend is sent
of them (docs/PARAMETERS.md, "Messages"). Plain functions, no HTTP."""
import base64

import pytest
from openai.types.chat import (ChatCompletionAssistantMessageParam,
                               ChatCompletionContentPartImageParam,
                               ChatCompletionContentPartInputAudioParam,
                               ChatCompletionContentPartRefusalParam,
                               ChatCompletionContentPartTextParam,
                               ChatCompletionDeveloperMessageParam,
                               ChatCompletionFunctionMessageParam,
                               ChatCompletionMessageFunctionToolCallParam,
                               ChatCompletionSystemMessageParam, ChatCompletionToolMessageParam,
                               ChatCompletionUserMessageParam)
from openai.types.chat import chat_completion_assistant_message_param as assistant_param
from openai.types.chat import chat_completion_content_part_image_param as image_param
from openai.types.chat import chat_completion_content_part_input_audio_param as audio_param
from openai.types.chat import chat_completion_content_part_param as part_param
from openai.types.chat import chat_completion_content_part_text_param as text_param
from openai.types.chat import chat_completion_message_function_tool_call_param as call_param
from openai.types.chat import chat_completion_named_tool_choice_param as choice_param
from openai.types.chat import (ChatCompletionFunctionToolParam,
                               ChatCompletionNamedToolChoiceParam)
from openai.types.chat.completion_create_params import Function
from openai.types.shared_params import FunctionDefinition

from factories import model_entry
from gateway.contract import tools
from gateway.errors import InvalidRequest
from gateway.contract.families import FAMILIES, SENT_KEYS, SENT_PART_KEYS
from gateway.contract.parameters import upstream_body
from gateway.contract.tools import CALL_KEYS, FUNCTION_CALL_KEYS
from gateway.contract.validation import MESSAGE_KEYS, PART_KEYS, PART_VALUE_KEYS, validate_chat

pytestmark = pytest.mark.unit

PNG = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 32).decode()
BREAKPOINT = {"mode": "explicit", "ttl": "12h"}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "f", "arguments": "{}"}}


def keys(typed_dict):
    return set(typed_dict.__annotations__)


def test_the_keys_accepted_are_exactly_the_openai_sdk_types():
    assert MESSAGE_KEYS == {
        "developer": keys(ChatCompletionDeveloperMessageParam),
        "system": keys(ChatCompletionSystemMessageParam),
        "user": keys(ChatCompletionUserMessageParam),
        "assistant": keys(ChatCompletionAssistantMessageParam),
        "tool": keys(ChatCompletionToolMessageParam),
        "function": keys(ChatCompletionFunctionMessageParam)}
    assert PART_KEYS == {
        "text": keys(ChatCompletionContentPartTextParam),
        "image_url": keys(ChatCompletionContentPartImageParam),
        "input_audio": keys(ChatCompletionContentPartInputAudioParam),
        "file": keys(part_param.File), "refusal": keys(ChatCompletionContentPartRefusalParam)}
    assert PART_VALUE_KEYS == {
        "image_url": keys(image_param.ImageURL), "input_audio": keys(audio_param.InputAudio),
        "file": keys(part_param.FileFile),
        "prompt_cache_breakpoint": keys(text_param.PromptCacheBreakpoint)}
    assert set(CALL_KEYS) == keys(ChatCompletionMessageFunctionToolCallParam)
    assert set(FUNCTION_CALL_KEYS) == keys(call_param.Function)
    assert set(FUNCTION_CALL_KEYS) == keys(assistant_param.FunctionCall)


def test_a_backend_is_sent_only_keys_that_are_accepted():
    for role, sent in SENT_KEYS.items():
        assert set(sent) <= MESSAGE_KEYS[role]
    for kind, sent in SENT_PART_KEYS.items():
        assert set(sent) <= PART_VALUE_KEYS[kind]


def build(messages, server="vllm"):
    model = model_entry(server, input=("text", "image", "audio", "file"))
    chat = validate_chat({"model": "m", "messages": messages}, {"m": model}, 100)
    return upstream_body(chat, model.backends[0])["messages"]


# Every key each role and part allows, and what a vLLM backend receives of it.
EVERY_KEY = [
    ({"role": "developer", "content": "d", "name": "n"},
     {"role": "system", "content": "d", "name": "n"}),
    ({"role": "system", "content": [{"type": "text", "text": "s",
                                     "prompt_cache_breakpoint": BREAKPOINT}], "name": "n"},
     {"role": "system", "content": [{"type": "text", "text": "s"}], "name": "n"}),
    ({"role": "user", "name": "ann", "content": [
        {"type": "image_url", "image_url": {"url": PNG, "detail": "original"},
         "prompt_cache_breakpoint": {"mode": "explicit"}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "mp3"},
         "prompt_cache_breakpoint": BREAKPOINT},
        {"type": "file", "file": {"file_data": "eA==", "file_id": "file-1", "filename": "a.txt"},
         "prompt_cache_breakpoint": BREAKPOINT}]},
     {"role": "user", "name": "ann", "content": [
         {"type": "image_url", "image_url": {"url": PNG, "detail": "original"}},
         {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "mp3"}},
         {"type": "file", "file": {"file_data": "eA==", "file_id": "file-1",
                                   "filename": "a.txt"}}]}),
    ({"role": "assistant", "name": "bot", "content": [{"type": "refusal", "refusal": "no"}],
      "refusal": "no", "audio": {"id": "a1"}, "tool_calls": [CALL],
      "function_call": {"name": "g", "arguments": "{}"}},
     {"role": "assistant", "name": "bot", "content": [{"type": "text", "text": "no"}],
      "tool_calls": [CALL, {"id": "g", "type": "function",
                            "function": {"name": "g", "arguments": "{}"}}]}),
    ({"role": "tool", "tool_call_id": "call_1", "content": "42"},
     {"role": "tool", "tool_call_id": "call_1", "content": "42"}),
    ({"role": "function", "name": "g", "content": "42"},
     {"role": "tool", "tool_call_id": "g", "content": "42"}),
]


@pytest.mark.parametrize("message,sent", EVERY_KEY, ids=[m["role"] for m, _ in EVERY_KEY])
def test_every_key_openai_allows_is_accepted_and_sent_as_the_backend_reads_it(message, sent):
    assert build([message]) == [sent]


BAD = [  # (message, param of the 400, code)
    ({"role": "user", "content": "hi", "max_tokens": 99999, "sneaky": 1},
     "messages[0].max_tokens", "unknown_parameter"),
    ({"role": "user", "content": "hi", "sneaky": 1}, "messages[0].sneaky", "unknown_parameter"),
    ({"role": "assistant", "content": "Once", "prefix": True}, "messages[0].prefix",
     "unknown_parameter"),
    ({"role": "system", "content": "s", "cache_control": {"type": "ephemeral"}},
     "messages[0].cache_control", "unknown_parameter"),
    ({"role": "developer", "content": "d", "tool_call_id": "c"}, "messages[0].tool_call_id",
     "unknown_parameter"),
    ({"role": "tool", "tool_call_id": "c", "content": "x", "name": "f"}, "messages[0].name",
     "unknown_parameter"),
    ({"role": "function", "name": "f", "content": "x", "tool_call_id": "c"},
     "messages[0].tool_call_id", "unknown_parameter"),
    ({"role": "assistant", "content": "x", "reasoning_content": "secret"},
     "messages[0].reasoning_content", "unknown_parameter"),
    ({"role": "user", "content": [{"type": "text", "text": "a",
                                   "cache_control": {"type": "ephemeral"}}]},
     "messages[0].content[0].cache_control", "unknown_parameter"),
    ({"role": "assistant", "content": [{"type": "refusal", "refusal": "no", "x": 1}]},
     "messages[0].content[0].x", "unknown_parameter"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG, "x": 1}}]},
     "messages[0].content[0].image_url.x", "unknown_parameter"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG,
                                                                      "detail": "medium"}}]},
     "messages[0].content[0].image_url.detail", "invalid_value"),
    ({"role": "user", "content": [{"type": "input_audio",
                                   "input_audio": {"data": "x", "format": "ogg"}}]},
     "messages[0].content[0].input_audio.format", "invalid_value"),
    ({"role": "user", "content": [{"type": "input_audio",
                                   "input_audio": {"data": "x", "format": "wav", "rate": 8}}]},
     "messages[0].content[0].input_audio.rate", "unknown_parameter"),
    ({"role": "user", "content": [{"type": "file", "file": {"file_id": "f", "url": "u"}}]},
     "messages[0].content[0].file.url", "unknown_parameter"),
    ({"role": "user", "content": [{"type": "text", "text": "a",
                                   "prompt_cache_breakpoint": {"mode": "explicit", "n": 1}}]},
     "messages[0].content[0].prompt_cache_breakpoint.n", "unknown_parameter"),
    ({"role": "user", "content": [{"type": "text", "text": "a",
                                   "prompt_cache_breakpoint": {"mode": "implicit"}}]},
     "messages[0].content[0].prompt_cache_breakpoint.mode", "invalid_value"),
    ({"role": "user", "content": [{"type": "text", "text": "a",
                                   "prompt_cache_breakpoint": "30m"}]},
     "messages[0].content[0].prompt_cache_breakpoint", "invalid_type"),
    ({"role": "assistant", "content": None, "tool_calls": [{**CALL, "index": 0}]},
     "messages[0].tool_calls[0].index", "unknown_parameter"),
    ({"role": "assistant", "content": None,
      "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{}", "strict": True}}]},
     "messages[0].tool_calls[0].function.strict", "unknown_parameter"),
    ({"role": "assistant", "content": None,
      "tool_calls": [{"id": "c", "type": "custom", "custom": {"name": "f", "input": "x"}}]},
     "messages[0].tool_calls[0].type", "invalid_value"),
    ({"role": "assistant", "content": None,
      "function_call": {"name": "f", "arguments": "{}", "id": "x"}},
     "messages[0].function_call.id", "unknown_parameter"),
    ({"role": "assistant", "content": None, "audio": {"id": "a1", "data": "UklGRg=="}},
     "messages[0].audio.data", "unknown_parameter"),
]


@pytest.mark.parametrize("message,param,code", BAD, ids=[p for _, p, _ in BAD])
def test_keys_openai_does_not_allow_are_refused_naming_themselves(message, param, code):
    with pytest.raises(InvalidRequest) as err:
        build([message])
    assert (err.value.status, err.value.param, err.value.code) == (400, param, code)


def test_a_long_unknown_key_is_named_cut_to_100_characters():
    with pytest.raises(InvalidRequest) as err:
        build([{"role": "user", "content": "hi", "k" * 500: 1}])
    assert err.value.param == "messages[0]." + "k" * 100


@pytest.mark.parametrize("server", sorted(FAMILIES))
def test_no_family_is_sent_a_key_outside_the_sent_table(server):
    for message, _ in EVERY_KEY:
        for sent in build([message], server):
            assert set(sent) <= set(SENT_KEYS[sent["role"]])
            for part in sent["content"] if isinstance(sent["content"], list) else ():
                assert set(part) == {"type", part["type"]}


# -- tools: the same rule for the tool definitions and tool choice sent with the request ------

TOOL = {"type": "function", "function": {"name": "f", "description": "d",
                                         "parameters": {"type": "object"}, "strict": True}}


def test_the_tool_keys_accepted_are_exactly_the_openai_sdk_types():
    assert set(tools.TOOL_KEYS) == keys(ChatCompletionFunctionToolParam)
    assert set(tools.FUNCTION_KEYS) == keys(FunctionDefinition)
    assert set(tools.DEPRECATED_FUNCTION_KEYS) == keys(Function)
    assert set(tools.TOOL_CHOICE_KEYS) == keys(ChatCompletionNamedToolChoiceParam)
    assert keys(choice_param.Function) == {"name"}


def build_body(**fields):
    model = model_entry("vllm", forced_tool_choice=True)
    chat = validate_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                          **fields}, {"m": model}, 100)
    return upstream_body(chat, model.backends[0])


def test_every_tool_key_openai_allows_is_accepted_and_sent():
    choice = {"type": "function", "function": {"name": "f"}}
    body = build_body(tools=[TOOL], tool_choice=choice)
    assert body["tools"] == [TOOL] and body["tool_choice"] == choice


@pytest.mark.parametrize("fields,param", [
    ({"tools": [{**TOOL, "cache_control": {"type": "ephemeral"}}]}, "tools[0].cache_control"),
    ({"tools": [{"type": "function", "function": {**TOOL["function"], "max_tokens": 9}}]},
     "tools[0].function.max_tokens"),
    ({"functions": [{"name": "f", "description": "d", "strict": True}]}, "functions[0].strict"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"},
                                       "x": 1}}, "tool_choice.x"),
    ({"tools": [TOOL], "tool_choice": {"type": "function",
                                       "function": {"name": "f", "arguments": "{}"}}},
     "tool_choice.function.arguments"),
])
def test_tool_keys_openai_does_not_allow_are_refused_naming_themselves(fields, param):
    with pytest.raises(InvalidRequest) as err:
        build_body(**fields)
    assert (err.value.param, err.value.code) == (param, "unknown_parameter")


def test_a_strict_flag_that_is_not_a_boolean_is_refused():
    with pytest.raises(InvalidRequest) as err:
        build_body(tools=[{"type": "function", "function": {**TOOL["function"], "strict": 1}}])
    assert (err.value.param, err.value.code) == ("tools[0].function.strict", "invalid_type")
