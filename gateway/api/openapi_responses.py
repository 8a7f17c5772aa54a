"""The Responses API's part of the OpenAPI document (:mod:`gateway.api.openapi`): ``POST
/v1/responses`` (JSON or the typed event stream) and the stored responses (``GET`` and ``DELETE
/v1/responses/{response_id}``, ``GET /v1/responses/{response_id}/input_items``), in the shapes of
OpenAI's API reference ("Create a model response", "The response object", "Streaming events",
"List input items"); the field table is docs/RESPONSES.md, built from
:data:`gateway.dialects.responses_request.FIELDS`."""
from ..dialects.responses_request import (FIELDS, INCLUDABLES, REFUSE, SERVICE_TIERS,
                                          TRUNCATIONS)
from .openapi_common import error_responses, json_response
from .openapi_request import nullable, ref

STRING = {"type": "string"}
COUNT = {"type": "integer", "minimum": 0}
RESPONSE_ID = {"name": "response_id", "in": "path", "required": True,
               "description": "A stored response's id (`resp_...`); another organization's, an "
                              "expired or a deleted one is 404 `not_found`.",
               "schema": STRING}


def responses_paths(max_body_bytes):
    create_errors = error_responses(400, 401, 402, 403, 404, 413, 429, 500, 502, 503)
    create_errors["413"]["description"] += f" The limit is {max_body_bytes} bytes."
    create_errors["404"]["description"] += (" For responses, also a `previous_response_id` "
                                            "that is not one of the organization's stored "
                                            "responses (`not_found`).")
    stored = error_responses(401, 403, 404)
    return {
        "/v1/responses": {"post": {
            "operationId": "createResponse",
            "summary": "Create a model response (OpenAI's Responses API), metered and billed "
                       "as chat; JSON or the typed event stream.",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": ref("ResponseCreateRequest")}}},
            "responses": {"200": _create_ok(), **create_errors}}},
        "/v1/responses/{response_id}": {
            "parameters": [RESPONSE_ID],
            "get": {"operationId": "getResponse",
                    "summary": "Return one of the organization's stored responses.",
                    "responses": {"200": json_response("The stored response.", "Response"),
                                  **stored}},
            "delete": {"operationId": "deleteResponse",
                       "summary": "Delete one of the organization's stored responses.",
                       "responses": {"200": json_response("Deleted.", "ResponseDeleted"),
                                     **stored}}},
        "/v1/responses/{response_id}/input_items": {
            "parameters": [RESPONSE_ID],
            "get": {"operationId": "listResponseInputItems",
                    "summary": "List a stored response's own input items.",
                    "parameters": [
                        {"name": "limit", "in": "query", "schema": {
                            "type": "integer", "minimum": 1, "maximum": 100, "default": 20}},
                        {"name": "order", "in": "query", "schema": {
                            "enum": ["asc", "desc"], "default": "desc"}},
                        {"name": "after", "in": "query", "schema": STRING,
                         "description": "An item id: list the items after it."}],
                    "responses": {"200": json_response("A page of input items.",
                                                       "ResponseInputItemList"),
                                  **error_responses(400, 401, 403, 404)}}},
    }


def _create_ok():
    return {
        "description": "The Response object; or, with `stream` true, an SSE stream of typed "
                       "events (`event: <type>`, its `data:` a ResponseStreamEvent), ending "
                       "with `response.completed`, `response.incomplete` or, after an `error` "
                       "event, `response.failed`. Comment lines (`: keepalive`) keep an idle "
                       "stream open.",
        "headers": {"X-Neocloud-Generation-Id": {
            "description": "The id of this request's usage event (GET /v1/generation).",
            "schema": STRING}},
        "content": {
            "application/json": {"schema": ref("Response")},
            "text/event-stream": {"schema": {
                "type": "object", "required": ["event", "data"], "properties": {
                    "event": STRING, "data": {
                        "type": "string", "contentMediaType": "application/json",
                        "contentSchema": ref("ResponseStreamEvent")}}},
                "x-sse-data": ref("ResponseStreamEvent")},
        },
    }


def responses_schemas():
    return {
        "ResponseCreateRequest": _create_request(),
        "Response": _response(),
        "ResponseUsage": _usage(),
        "ResponseOutputItem": _output_item(),
        "ResponseStreamEvent": {
            "type": "object", "required": ["type", "sequence_number"], "properties": {
                "type": STRING, "sequence_number": COUNT,
                "response": ref("Response"), "item": ref("ResponseOutputItem"),
                "output_index": COUNT, "content_index": COUNT, "item_id": STRING,
                "delta": STRING, "text": STRING, "arguments": STRING,
                "code": {"type": ["string", "null"]}, "message": STRING}},
        "ResponseDeleted": {"type": "object", "required": ["id", "object", "deleted"],
                            "properties": {"id": STRING, "object": {"const": "response"},
                                           "deleted": {"const": True}}},
        "ResponseInputItemList": {
            "type": "object", "required": ["object", "data", "first_id", "last_id",
                                           "has_more"],
            "properties": {"object": {"const": "list"},
                           "data": {"type": "array", "items": {
                               "type": "object", "required": ["id"],
                               "properties": {"id": STRING, "type": STRING}}},
                           "first_id": {"type": ["string", "null"]},
                           "last_id": {"type": ["string", "null"]},
                           "has_more": {"type": "boolean"}}},
    }


def _create_request():
    props = {name: {"description": f"{treatment} (docs/RESPONSES.md)."}
             for name, treatment in FIELDS.items() if treatment != REFUSE}
    props.update({
        "model": {**STRING, "description": "A catalog id (GET /v1/models)."},
        "input": {"anyOf": [STRING, {"type": "array", "minItems": 1, "items": {
            "type": "object"}}], "description": "A string (one user message) or input "
                                                 "items: messages, function_call, "
                                                 "function_call_output, reasoning, "
                                                 "item_reference."},
        "instructions": nullable(STRING),
        "tools": nullable({"type": "array", "items": {
            "type": "object", "required": ["type"], "properties": {"type": STRING}},
            "description": "Function tools (a missing or empty `description` is sent as the "
                           "tool's name); hosted tools are left out and listed in the "
                           "response's `dropped_tools`."}),
        "max_output_tokens": nullable({"type": "integer", "minimum": 1}),
        "temperature": nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "stream": nullable({"type": "boolean"}), "store": nullable({"type": "boolean"}),
        "previous_response_id": nullable(STRING),
        "include": nullable({"type": "array", "items": {"enum": list(INCLUDABLES)}}),
        "truncation": nullable({"enum": list(TRUNCATIONS)}),
        "service_tier": nullable({"enum": list(SERVICE_TIERS)}),
        "background": nullable({"const": False}),
        "metadata": nullable({"type": "object"}),
    })
    refused = ", ".join(f"`{n}`" for n, t in FIELDS.items() if t == REFUSE)
    return {"type": "object", "required": ["model", "input"], "properties": props,
            "description": f"OpenAI's Responses request. {refused} are 400 "
                           f"`unsupported_parameter`; any other field not listed is 400 "
                           f"`unknown_parameter` unless the model's catalog entry allows it "
                           f"by name."}


def _usage():
    return {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"],
            "properties": {
                "input_tokens": COUNT, "output_tokens": COUNT, "total_tokens": COUNT,
                "input_tokens_details": {"type": "object", "properties": {
                    "cached_tokens": COUNT}},
                "output_tokens_details": {"type": "object", "properties": {
                    "reasoning_tokens": COUNT}},
                "cost": {"type": "number", "minimum": 0,
                         "description": "USD debited from credits for this response."},
                "estimated": {"type": "boolean",
                              "description": "Counted by Kiln: the backend sent no usage."}}}


def _output_item():
    return {"type": "object", "required": ["id", "type"], "properties": {
        "id": STRING, "type": {"enum": ["message", "function_call", "reasoning"]},
        "status": {"enum": ["in_progress", "completed", "incomplete"]},
        "role": {"const": "assistant"}, "content": {"type": "array"},
        "call_id": STRING, "name": STRING, "arguments": STRING}}


def _response():
    return {"type": "object", "required": ["id", "object", "created_at", "status", "model",
                                           "output"],
            "properties": {
                "id": {"type": "string", "pattern": "^resp_"},
                "object": {"const": "response"}, "created_at": COUNT,
                "status": {"enum": ["completed", "incomplete", "failed", "in_progress"]},
                "error": {"type": ["object", "null"]},
                "incomplete_details": {"anyOf": [{"type": "null"}, {
                    "type": "object", "properties": {
                        "reason": {"enum": ["max_output_tokens", "content_filter"]}}}]},
                "model": STRING, "output": {"type": "array",
                                            "items": ref("ResponseOutputItem")},
                "usage": nullable(ref("ResponseUsage")),
                "store": {"type": "boolean"}, "previous_response_id": nullable(STRING),
                "dropped_tools": {"type": "array", "items": {
                    "type": "object", "properties": {"index": COUNT, "type": STRING}},
                    "description": "Hosted tools left out of what the model was offered."}}}
