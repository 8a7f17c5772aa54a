"""The Anthropic Messages part of the OpenAPI document (:mod:`gateway.api.openapi`):
``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, their requests, the message,
the event stream and Anthropic's error envelope.

Shapes are Anthropic's Messages API reference (https://docs.claude.com/en/api/messages) as Kiln
takes and answers them; the fields, and what each becomes, are docs/MESSAGES.md and
:mod:`gateway.dialects.messages_request`, whose tables the request schemas are built from.
"""
from ..dialects.messages_request import (COUNT_FIELDS, DROPPED, EFFORTS, FIELDS,
                                         MAX_STOP_SEQUENCES, MAX_TOKENS_LOWERED_HEADER,
                                         SERVICE_TIERS, SPEEDS, THINKING_TYPES, UNSUPPORTED)
from ..dialects.messages_stream import ERROR_TYPES, STOP_REASONS
from .openapi_common import ERROR_CODES
from .openapi_request import nullable, ref

STRING = {"type": "string"}
OBJECT = {"type": "object"}
COUNT = {"type": "integer", "minimum": 0}
STATUSES = (400, 401, 402, 403, 404, 413, 429, 500, 502, 503)
STOP_REASON_VALUES = sorted(set(STOP_REASONS.values()) | {"end_turn", "stop_sequence"})
EVENTS = ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
          "message_delta", "message_stop", "ping", "error")
SECURITY = [{"apiKey": []}, {"anthropicApiKey": []}]


def messages_paths(max_body_bytes):
    errors = _error_responses(max_body_bytes)
    return {
        "/v1/messages": {"post": {
            "operationId": "createMessage", "security": SECURITY,
            "summary": "Create a message (Anthropic's Messages API), metered and billed as a "
                       "chat completion; JSON or Anthropic's event stream (docs/MESSAGES.md).",
            "parameters": _anthropic_headers(),
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": ref("MessagesRequest")}}},
            "responses": {"200": _message_ok(), **errors}}},
        "/v1/messages/count_tokens": {"post": {
            "operationId": "countMessageTokens", "security": SECURITY,
            "summary": "Count a Messages request's input tokens: the backend's tokenizer where "
                       "the catalog names one, else Kiln's estimate, which errs upward. Never "
                       "billed.",
            "parameters": _anthropic_headers(),
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": ref("MessageCountTokensRequest")}}},
            "responses": {"200": {"description": "The input tokens.", "content": {
                "application/json": {"schema": ref("MessageTokensCount")}}},
                **{s: r for s, r in errors.items() if s not in ("402", "429", "502", "503")},
                "503": errors["503"]}}},
    }


def messages_security_schemes():
    return {"anthropicApiKey": {"type": "apiKey", "in": "header", "name": "x-api-key",
                                "description": "A Kiln key in Anthropic's header; "
                                               "`Authorization: Bearer` works as well."}}


def _anthropic_headers():
    return [{"name": name, "in": "header", "required": False, "schema": STRING,
             "description": why} for name, why in (
        ("anthropic-version", "Any date is accepted (clients send newer ones than any list "
                              "Kiln could keep)."),
        ("anthropic-beta", "Any list is accepted; the beta API's body fields are in the "
                           "request schema."))]


def _message_ok():
    return {
        "description": "The message, as JSON; or, with `stream` true, Anthropic's event "
                       "stream: `event: <name>` and a `data:` payload per event. A failure "
                       "after the stream began is one `error` event and no `message_stop`.",
        "headers": {
            "X-Neocloud-Generation-Id": {"description": "The id of this request's usage event "
                                                        "(GET /v1/generation).",
                                         "schema": STRING},
            MAX_TOKENS_LOWERED_HEADER: {
                "description": "Present when `max_tokens` was above the model's maximum "
                               "output: `<asked>-><held>`, the value held for and sent.",
                "schema": {"type": "string", "pattern": r"^[0-9]+->[0-9]+$"}}},
        "content": {
            "application/json": {"schema": ref("Message")},
            "text/event-stream": {"schema": _sse_event(), "x-sse-data": ref(
                "MessageStreamEvent")}},
    }


def _sse_event():
    return {"type": "object", "required": ["event", "data"], "properties": {
        "event": {"enum": list(EVENTS)},
        "data": {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": ref("MessageStreamEvent")}}}


def _error_responses(max_body_bytes):
    out = {}
    for status in STATUSES:
        error = {"type": "object", "required": ["type", "message"], "properties": {
            "type": {"const": ERROR_TYPES[status]}, "message": STRING,
            "code": ({"enum": ERROR_CODES[status]} if status in ERROR_CODES
                     else {"type": ["string", "null"]}),
            "param": {"type": ["string", "null"]}}}
        response = {"description": f"`{ERROR_TYPES[status]}`" + (
                        f"; the limit is {max_body_bytes} bytes" if status == 413 else "")
                    + " (docs/MESSAGES.md, \"Errors\").",
                    "content": {"application/json": {"schema": {"allOf": [
                        ref("AnthropicError"), {"properties": {"error": error}}]}}}}
        if status == 503:
            response["headers"] = {"Retry-After": {"description": "Seconds to wait.",
                                                   "schema": STRING}}
        out[str(status)] = response
    return out


# -- schemas -------------------------------------------------------------------------------------

def messages_schemas():
    return {
        "MessagesRequest": _request(FIELDS, ["model", "max_tokens", "messages"]),
        "MessageCountTokensRequest": _request(
            {name: FIELDS[name] for name in COUNT_FIELDS}, ["model", "messages"]),
        "MessageParam": {
            "type": "object", "required": ["role", "content"], "additionalProperties": False,
            "properties": {"role": {"enum": ["user", "assistant", "system"]},
                           "content": {"oneOf": [STRING, {"type": "array", "items": ref(
                               "MessageContentBlockParam")}]}}},
        "MessageContentBlockParam": {
            "type": "object", "required": ["type"], "properties": {"type": STRING},
            "description": "`text`, `image` (base64 or url source), `tool_use`, "
                           "`tool_result`, `thinking`, `redacted_thinking`; `document` and "
                           "Anthropic's platform blocks are 400 (docs/MESSAGES.md)."},
        "Message": _message(),
        "MessageContentBlock": {"oneOf": [
            {"type": "object", "required": ["type", "text"], "properties": {
                "type": {"const": "text"}, "text": STRING}},
            {"type": "object", "required": ["type", "thinking", "signature"], "properties": {
                "type": {"const": "thinking"}, "thinking": STRING, "signature": STRING}},
            {"type": "object", "required": ["type", "id", "name", "input"], "properties": {
                "type": {"const": "tool_use"}, "id": STRING, "name": STRING,
                "input": OBJECT}}]},
        "MessagesUsage": {
            "type": "object", "required": ["input_tokens", "output_tokens"], "properties": {
                "input_tokens": COUNT, "output_tokens": COUNT,
                "cache_read_input_tokens": COUNT, "cache_creation_input_tokens": COUNT,
                "cost": {"type": "number", "minimum": 0,
                         "description": "USD debited from credits for this request."},
                "estimated": {"type": "boolean",
                              "description": "Counted by Kiln: the backend sent no usage."}}},
        "MessageStreamEvent": _stream_event(),
        "MessageTokensCount": {"type": "object", "required": ["input_tokens"],
                               "properties": {"input_tokens": COUNT}},
        "AnthropicError": {
            "type": "object", "required": ["type", "error"], "properties": {
                "type": {"const": "error"}, "request_id": STRING,
                "error": {"type": "object", "required": ["type", "message"], "properties": {
                    "type": {"enum": sorted(set(ERROR_TYPES.values()))}, "message": STRING,
                    "code": {"type": ["string", "null"],
                             "description": "Kiln's own code (README, \"API\")."},
                    "param": {"type": ["string", "null"]}}}}},
    }


def _request(fields, required):
    specific = {
        "model": {"type": "string", "description": "A model id from GET /v1/models."},
        "max_tokens": {"type": "integer", "minimum": 1, "description":
                       "Above the model's `max_output_tokens` it is lowered to it, held for "
                       f"at that value and said in `{MAX_TOKENS_LOWERED_HEADER}`."},
        "messages": {"type": "array", "minItems": 1, "items": ref("MessageParam")},
        "system": {"oneOf": [STRING, {"type": "array", "items": {
            "type": "object", "required": ["type", "text"], "properties": {
                "type": {"const": "text"}, "text": STRING}}}]},
        "stop_sequences": {"type": "array", "maxItems": MAX_STOP_SEQUENCES,
                           "items": {"type": "string", "minLength": 1}},
        "stream": {"type": "boolean"},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "minimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0},
        "tools": {"type": "array", "items": {"type": "object", "description":
                                             "A custom tool (`name`, `input_schema`, ...) or "
                                             "one of Anthropic's typed tools, left out."}},
        "tool_choice": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["auto", "any", "tool", "none"]}, "name": STRING,
            "disable_parallel_tool_use": {"type": "boolean"}}},
        "thinking": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": list(THINKING_TYPES)}, "budget_tokens": {
                "type": "integer", "minimum": 1024}}},
        "output_config": {"type": "object", "properties": {"effort": {"enum": list(EFFORTS)},
                                                           "format": OBJECT}},
        "metadata": {"type": "object", "properties": {"user_id": {"type": ["string", "null"]}},
                     "additionalProperties": False},
        "service_tier": {"enum": list(SERVICE_TIERS)},
        "speed": {"enum": list(SPEEDS)},
    }
    properties = {}
    for name, treatment in fields.items():
        schema = dict(specific.get(name, {}))
        if treatment == DROPPED:
            schema["description"] = "Accepted and dropped (docs/MESSAGES.md)."
        elif treatment == UNSUPPORTED:
            schema["description"] = "400 `unsupported_parameter` when set (docs/MESSAGES.md)."
        properties[name] = schema if name in required else nullable(schema)
    return {"type": "object", "required": required, "properties": properties,
            "additionalProperties": False,
            "description": "Anthropic's fields (a `null` is treated as absent); any other is "
                           "400 `invalid_request_error`, \"Extra inputs are not permitted\"."}


def _message():
    return {"type": "object", "required": ["id", "type", "role", "content", "model",
                                           "stop_reason", "stop_sequence", "usage"],
            "properties": {
                "id": STRING, "type": {"const": "message"}, "role": {"const": "assistant"},
                "content": {"type": "array", "items": ref("MessageContentBlock")},
                "model": STRING,
                "stop_reason": {"enum": [*STOP_REASON_VALUES, None]},
                "stop_sequence": {"type": ["string", "null"]},
                "usage": ref("MessagesUsage")}}


def _stream_event():
    def kind(name, required=(), **properties):
        return {"type": "object", "required": ["type", *required],
                "properties": {"type": {"const": name}, **properties}}
    delta = {"oneOf": [
        kind("text_delta", ["text"], text=STRING),
        kind("thinking_delta", ["thinking"], thinking=STRING),
        kind("input_json_delta", ["partial_json"], partial_json=STRING)]}
    index = {"type": "integer", "minimum": 0}
    return {"oneOf": [
        kind("message_start", ["message"], message=ref("Message")),
        kind("content_block_start", ["index", "content_block"], index=index,
             content_block=ref("MessageContentBlock")),
        kind("content_block_delta", ["index", "delta"], index=index, delta=delta),
        kind("content_block_stop", ["index"], index=index),
        kind("message_delta", ["delta", "usage"], usage=ref("MessagesUsage"), delta={
            "type": "object", "required": ["stop_reason", "stop_sequence"], "properties": {
                "stop_reason": {"enum": STOP_REASON_VALUES},
                "stop_sequence": {"type": ["string", "null"]}}}),
        kind("message_stop"), kind("ping"),
        ref("AnthropicError")]}
