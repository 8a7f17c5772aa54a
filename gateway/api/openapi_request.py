"""The request side of the OpenAPI document (:mod:`gateway.api.openapi`): the chat completion
request, its messages and tools, with the ranges and enums
:mod:`gateway.contract.parameters` enforces, and the schema helpers both halves use."""
from ..contract.parameters import (INT64, MAX_N, MAX_STOP_STRINGS, PARAMETERS, RANGES,
                                   REASONING_EFFORTS, REFUSE)

REF = "#/components/schemas/"
STRING = {"type": "string"}
TRUE_STREAM, FALSE_STREAM = [True, "true", 1], [False, "false", 0, None]


def ref(name):
    return {"$ref": REF + name}


def nullable(schema):
    """Kiln treats ``null`` as absent for every optional parameter."""
    return {"anyOf": [schema, {"type": "null"}]}


def request_schemas():
    return {
        "ChatCompletionRequest": _chat_request(),
        "SystemMessage": _message("system", {"content": _text_or_parts("TextPart"),
                                             "name": STRING}, ["content"]),
        "DeveloperMessage": _message("developer", {"content": _text_or_parts("TextPart"),
                                                   "name": STRING}, ["content"]),
        "UserMessage": _message("user", {"content": _text_or_parts(), "name": STRING},
                                ["content"]),
        "FunctionMessage": _message("function", {"content": {"type": ["string", "null"]},
                                                 "name": STRING}, ["name"]),
        "AssistantMessage": _assistant_message(),
        "ToolMessage": _message("tool", {"tool_call_id": {"type": "string"},
                                         "content": _text_or_parts("TextPart")},
                                ["tool_call_id", "content"]),
        "ContentPart": {
            "type": "object", "required": ["type"], "properties": {"type": {"type": "string"}},
            "description": "The keys of its type in the OpenAI chat API, no other (400 "
                           "`unknown_parameter`; docs/PARAMETERS.md, \"Messages\"). A part of "
                           "type `image_url` is accepted only by models whose "
                           "`input_modalities` include `image`; elsewhere 400 "
                           "`unsupported_parameter` naming `messages[i].content[j]`."},
        "TextPart": {"type": "object", "required": ["type", "text"], "properties": {
            "type": {"const": "text"}, "text": STRING,
            "prompt_cache_breakpoint": {"type": "object"}}, "additionalProperties": False},
        "FunctionTool": _function_tool(),
        "ToolChoice": _tool_choice(),
        "ResponseFormat": {
            "type": "object", "required": ["type"],
            "properties": {"type": {"enum": ["text", "json_object", "json_schema"]},
                           "json_schema": {"type": "object"}},
            "description": "`text` always; `json_object` and `json_schema` only on models "
                           "whose `capabilities.response_format` is true, else 400 "
                           "`unsupported_parameter`."},
        "StreamOptions": {
            "type": "object", "properties": {"include_usage": {"type": "boolean"}},
            "description": "Only with `stream` true. `include_usage` true adds a final chunk "
                           "with `usage` (and `usage.cost`). Other keys are forwarded."},
    }


def _chat_request():
    properties = {
        "model": {"type": "string", "description": "A model id from GET /v1/models."},
        "messages": {"type": "array", "minItems": 1, "items": {"oneOf": [
            ref("SystemMessage"), ref("DeveloperMessage"), ref("UserMessage"),
            ref("AssistantMessage"), ref("ToolMessage"), ref("FunctionMessage")]},
            "description": "Missing or empty: 400 `empty_array`."},
        "max_tokens": nullable({"type": "integer", "minimum": 1, "description":
                                 "At most the model's `max_output_tokens`; forwarded as "
                                 "given. A reply cut here ends with finish_reason `length` "
                                 "and may have empty content."}),
        "max_completion_tokens": nullable({"type": "integer", "minimum": 1}),
        "stream": {"enum": TRUE_STREAM + FALSE_STREAM, "default": False,
                   "description": "true, \"true\", 1 stream; false, \"false\", 0, null do not. "
                                  "Sent upstream as a boolean."},
        "stream_options": nullable(ref("StreamOptions")),
        "tools": nullable({"type": "array", "items": ref("FunctionTool")}),
        "tool_choice": nullable(ref("ToolChoice")),
        "parallel_tool_calls": nullable({"type": "boolean", "description":
                                          "Forwarded to models whose `capabilities."
                                          "parallel_tool_calls` is true; elsewhere false is "
                                          "enforced by Kiln, keeping only the first tool "
                                          "call."}),
        "reasoning_effort": nullable({"enum": list(REASONING_EFFORTS)}),
        **{name: nullable({"type": "number", "minimum": low, "maximum": high})
           for name, (low, high) in RANGES.items()},
        "n": nullable({"type": "integer", "minimum": 1, "maximum": MAX_N}),
        "seed": nullable({"type": "integer", "minimum": -INT64, "maximum": INT64 - 1}),
        "stop": nullable({"oneOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "maxItems": MAX_STOP_STRINGS,
             "items": {"type": "string", "minLength": 1}}],
            "description": "Forwarded, and enforced by Kiln: output is cut before the first "
                           "stop string and finish_reason becomes `stop`."}),
        "response_format": nullable(ref("ResponseFormat")),
        "ignore_eos": {"description": "true is rejected (400 `unsupported_parameter`) on "
                                      "gpt-oss models; forwarded elsewhere."},
    }
    properties.update({name: {"description": _treatment(what)}
                       for name, what in PARAMETERS.items() if name not in properties})
    return {
        "type": "object", "required": ["model", "messages"], "properties": properties,
        "additionalProperties": False,
        "description": "Integers are JSON integer literals (`1`, not `1.0`). Fields listed "
                       "without a schema are OpenAI chat parameters Kiln forwards, drops or "
                       "refuses (docs/PARAMETERS.md); any other field is 400 "
                       "`unknown_parameter` unless the model's catalog entry allows it by "
                       "name (`extra_params`).",
        # stream_options needs stream true (docs/PARAMETERS.md, ``stream_options``).
        "if": {"required": ["stream_options"],
               "properties": {"stream_options": {"type": "object"}}},
        "then": {"required": ["stream"], "properties": {"stream": {"enum": TRUE_STREAM}}},
    }


def _treatment(what):
    if what == REFUSE:
        return "Refused: 400 `unsupported_parameter` (docs/PARAMETERS.md)."
    return f"OpenAI chat parameter, {what} by Kiln (docs/PARAMETERS.md)."


def _message(role, properties, required):
    """A message of ``role``: the keys the OpenAI chat API allows it, no other."""
    return {"type": "object", "required": ["role", *required],
            "properties": {"role": {"const": role}, **properties},
            "additionalProperties": False}


def _text_or_parts(part="ContentPart"):
    return {"oneOf": [{"type": "string"}, {"type": "array", "items": ref(part)}]}


def _assistant_message():
    schema = _message("assistant", {
        "content": {"oneOf": [{"type": "string"}, {"type": "null"},
                              {"type": "array", "items": ref("ContentPart")}]},
        "name": STRING, "refusal": {"type": ["string", "null"]},
        "audio": {"type": ["object", "null"], "required": ["id"],
                  "properties": {"id": STRING}, "additionalProperties": False},
        "function_call": {"type": ["object", "null"]},
        "tool_calls": {"type": "array", "description": "Function tool calls: `id`, `type`, "
                                                       "`function` {`name`, `arguments`}."}},
        [])
    # Content may be null or absent only when the message carries tool calls, a function
    # call, a refusal or an audio reference.
    schema["anyOf"] = [
        {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}}},
        {"required": ["tool_calls"], "properties": {"tool_calls": {"minItems": 1}}},
        *({"required": [name], "properties": {name: {"type": kind}}}
          for name, kind in (("function_call", "object"), ("refusal", "string"),
                             ("audio", "object")))]
    return schema


def _function_tool():
    text = {"type": "string", "pattern": r"\S"}
    function = {"type": "object", "required": ["name", "description"],
                "additionalProperties": False, "properties": {
                    "name": text,
                    "description": {**text, "description": "Required, non-empty."},
                    "parameters": {"type": "object",
                                   "description": "JSON Schema of the arguments."},
                    "strict": {"type": ["boolean", "null"]}}}
    return {"type": "object", "required": ["type", "function"], "additionalProperties": False,
            "properties": {"type": {"const": "function"}, "function": function}}


def _tool_choice():
    named = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string"}}}}}
    return {"oneOf": [{"enum": ["auto", "none", "required"]}, named],
            "description": "`auto` and `none` always. `required` or a named function only on "
                           "models whose `capabilities.forced_tool_choice` is true; elsewhere "
                           "400 `unsupported_parameter` (send `auto`)."}
