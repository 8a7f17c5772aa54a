"""The OpenAPI 3.1 description of Kiln's HTTP API, served without a key at ``GET /openapi.json``.

Ranges, enums and limits come from the constants :mod:`gateway.contract.validation` enforces, so
the document states the rules that run; ``tests/functional/api/test_openapi.py`` keeps it true
by validating real requests and responses against it. Schemas use JSON Schema 2020-12, the
dialect of OpenAPI 3.1. Rules that depend on the model (``max_tokens`` at most its max output,
image parts, forced ``tool_choice``, ``parallel_tool_calls``, ``response_format``,
``ignore_eos`` on gpt-oss) follow ``GET /v1/models`` and are stated in descriptions.
"""
from flask import Blueprint, current_app, jsonify

from ..billing import COUNTED_BY as COUNTS
from ..config import Config
from ..contract.catalog import ENDPOINTS
from ..endings import Status
from .openapi_common import DECIMAL_USD, error_responses, get_operation, json_response
from .openapi_generations import generations_paths, generations_schemas
from .openapi_keys import key_paths, key_schemas
from .openapi_legacy import legacy_paths, legacy_schemas
from .openapi_messages import messages_paths, messages_schemas, messages_security_schemes
from .openapi_request import nullable, ref, request_schemas
from .openapi_responses import responses_paths, responses_schemas

# Which count a usage event bills, per kind of token (docs/METERING.md, "Which count applies").
COUNTED_BY = {"enum": [*COUNTS, None], "description": "backend: the backend's usage; tokenizer: "
              "Kiln's exact count; bound: Kiln's upward bound; progress: the sweeper billed the "
              "last progress recorded; null: pending, or nothing counted"}

bp = Blueprint("openapi", __name__)

@bp.get("/openapi.json")
def openapi_json():
    """Serve the OpenAPI 3.1 document (no API key needed)."""
    config = current_app.config["KILN"]
    return jsonify(build_document(config.max_body_bytes, config.export_max_rows))


def build_document(max_body_bytes, export_max_rows=Config.export_max_rows):
    """Return the OpenAPI 3.1 document as a dict.

    :param max_body_bytes: the request body limit in force (stated in the 413 description).
    :param export_max_rows: the rows a CSV export may hold (stated in its description).
    """
    return {
        "openapi": "3.1.0",
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "info": {"title": "Kiln gateway API", "version": "1",
                 "description": "OpenAI-compatible chat completions with prepaid credits. "
                                "Every error is the OpenAI envelope, except 502 (plain text), "
                                "and Anthropic's envelope on /v1/messages."},
        "paths": {**_paths(max_body_bytes), **messages_paths(max_body_bytes),
                  **responses_paths(max_body_bytes), **key_paths(), **legacy_paths(),
                  **generations_paths(export_max_rows)},
        "components": {"schemas": {**request_schemas(), **_response_schemas(),
                                   **_account_schemas(), **key_schemas(),
                                   **messages_schemas(), **responses_schemas(),
                                   **legacy_schemas(), **generations_schemas()},
                       "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"},
                                           **messages_security_schemes()}},
        "security": [{"apiKey": []}],
    }


# -- paths ---------------------------------------------------------------------------------------

def _paths(max_body_bytes):
    chat_errors = error_responses(400, 401, 402, 403, 404, 413, 429, 500, 502, 503)
    chat_errors["413"]["description"] += f" The limit is {max_body_bytes} bytes."
    return {
        "/v1/chat/completions": {"post": {
            "operationId": "createChatCompletion",
            "summary": "Create a chat completion, metered and billed; JSON or an SSE stream.",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": ref("ChatCompletionRequest")}}},
            "responses": {"200": _chat_ok(), **chat_errors}}},
        "/v1/models": {"get": get_operation("listModels", "List the catalog's public models.",
                                   "ModelList", error_responses(401, 403))},
        "/v1/credits": {"get": get_operation("getCredits", "Show the organization's credits.",
                                    "Credits", error_responses(401, 403))},
        "/v1/generation": {"get": {
            **get_operation("getGeneration", "Show one of the organization's usage events.",
                   "Generation", error_responses(400, 401, 403, 404)),
            "parameters": [{"name": "id", "in": "query", "required": True,
                            "description": "The X-Neocloud-Generation-Id of a response.",
                            "schema": {"type": "string"}}]}},
        "/healthz": {"get": {**get_operation("healthz", "Liveness: 200 while the process runs.",
                                    "Health", {}), "security": []}},
        "/readyz": {"get": {**get_operation("readyz",
                                            "Readiness: database reachable, catalog loaded.",
                                            "Ready", {"503": json_response("Not ready.", "Ready")}),
                            "security": []}},
        "/openapi.json": {"get": {"operationId": "openapi", "security": [],
                                  "summary": "This document.",
                                  "responses": {"200": {"description": "OpenAPI 3.1 document.",
                                                        "content": {"application/json": {
                                                            "schema": {"type": "object"}}}}}}},
    }


def _chat_ok():
    event_data = {"oneOf": [ref("ChatCompletionChunk"), ref("ErrorResponse"),
                            {"const": "[DONE]"}]}
    return {
        "description": "The completion, as JSON; or, with `stream` true, an SSE stream whose "
                       "`data:` payloads are ChatCompletionChunk objects, then `[DONE]`. "
                       "Comment lines (`: keepalive`) keep an idle stream open. A failure after "
                       "the stream began is one `data:` event holding an ErrorResponse.",
        "headers": {"X-Neocloud-Generation-Id": _generation_header()},
        "content": {
            "application/json": {"schema": ref("ChatCompletion")},
            "text/event-stream": {"schema": _sse_event(), "x-sse-data": event_data},
        },
    }


def _sse_event():
    """One event of the stream (OpenAPI 3.1 reads a ``text/event-stream`` schema per event)."""
    chunk_or_error = {"oneOf": [ref("ChatCompletionChunk"), ref("ErrorResponse")]}
    data = {"anyOf": [{"const": "[DONE]"}, {
        "type": "string", "contentMediaType": "application/json",
        "contentSchema": chunk_or_error}]}
    return {"type": "object", "required": ["data"], "properties": {
        "data": data, "event": {"const": "message"}, "id": {"type": "string"}}}


def _generation_header():
    return {"description": "The id of this request's usage event (GET /v1/generation).",
            "schema": {"type": "string"}}


# -- responses -----------------------------------------------------------------------------------

def _response_schemas():
    return {
        "ErrorResponse": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"], "properties": {
                "message": {"type": "string"}, "type": {"type": "string"},
                "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}},
        "Usage": _usage(),
        "ToolCall": {"type": "object", "properties": {
            "id": {"type": "string"}, "type": {"const": "function"}, "index": {"type": "integer"},
            "function": {"type": "object", "properties": {
                "name": {"type": "string"}, "arguments": {"type": "string"}}}}},
        "ChatCompletion": _completion("chat.completion", "message", ["role"]),
        "ChatCompletionChunk": _completion("chat.completion.chunk", "delta", []),
    }


def _usage():
    count = {"type": "integer", "minimum": 0}
    return {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
            "properties": {
                "prompt_tokens": count, "completion_tokens": count, "total_tokens": count,
                "prompt_tokens_details": {"type": ["object", "null"], "properties": {
                    "cached_tokens": {"type": ["integer", "null"], "minimum": 0}}},
                "cost": {"type": "number", "minimum": 0,
                         "description": "USD debited from credits for this request."},
                "estimated": {"type": "boolean",
                              "description": "Counted by Kiln: the backend sent no usage."}}}


def _completion(kind, message_key, message_required):
    message = {"type": "object", "required": message_required, "properties": {
        "role": {"const": "assistant"}, "content": {"type": ["string", "null"]},
        "tool_calls": {"type": "array", "items": ref("ToolCall")}}}
    choice = {"type": "object", "required": ["index", message_key, "finish_reason"],
              "properties": {"index": {"type": "integer"}, message_key: message,
                             "finish_reason": {"type": ["string", "null"], "description":
                                               "stop, length (max_tokens) or tool_calls."}}}
    required = ["id", "object", "created", "model", "choices"]
    usage = ref("Usage")
    if kind == "chat.completion":
        required.append("usage")
    else:
        usage = nullable(usage)
    return {"type": "object", "required": required, "properties": {
        "id": {"type": "string"}, "object": {"const": kind}, "created": {"type": "integer"},
        "model": {"type": "string"}, "choices": {"type": "array", "items": choice},
        "usage": usage}}


def _account_schemas():
    count = {"type": "integer", "minimum": 0}
    statuses = [status.value for status in Status]
    when = {"type": ["string", "null"], "format": "date-time"}
    return {
        "ModelList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": ref("Model")}}},
        "Model": _model(),
        "Credits": {"type": "object", "required": ["object", "balance_usd", "held_usd",
                                                   "available_usd", "in_flight"],
                    "properties": {"object": {"const": "credits"}, "balance_usd": DECIMAL_USD,
                                   "held_usd": DECIMAL_USD, "available_usd": DECIMAL_USD,
                                   "in_flight": count}},
        "Generation": {"type": "object", "required": ["id", "object", "status", "cost_usd"],
                       "properties": {
                           "id": {"type": "string"}, "object": {"const": "generation"},
                           "model": {"type": "string"}, "stream": {"type": "boolean"},
                           "status": {"enum": statuses},
                           "http_status": {"type": ["integer", "null"]},
                           "prompt_tokens": count, "cached_tokens": count,
                           "completion_tokens": count, "estimated": {"type": "boolean"},
                           "prompt_counted_by": COUNTED_BY, "completion_counted_by": COUNTED_BY,
                           "cost_usd": {"anyOf": [DECIMAL_USD, {"type": "null"}],
                                        "description": "null while the event is pending"},
                           "hold_usd": DECIMAL_USD, "error": {"type": ["string", "null"]},
                           "error_code": {"type": ["string", "null"]},
                           "anomaly": {"type": "boolean"},
                           "created_at": when, "first_token_at": when, "ended_at": when}},
        "Health": {"type": "object", "required": ["status"],
                   "properties": {"status": {"const": "ok"}}},
        "Ready": {"type": "object", "required": ["status"], "properties": {
            "status": {"enum": ["ok", "unavailable"]}, "models": count,
            "database": {"type": "string"}, "catalog": {"type": "string"}}},
    }


def _model():
    flag = {"type": "boolean"}
    return {"type": "object", "required": ["id", "object", "context_window", "max_output_tokens",
                                           "input_modalities", "capabilities", "pricing"],
            "properties": {
                "id": {"type": "string"}, "object": {"const": "model"},
                "created": {"type": "integer"}, "owned_by": {"type": "string"},
                "context_window": {"type": "integer", "minimum": 1},
                "max_output_tokens": {"type": "integer", "minimum": 0},
                "input_modalities": {"type": "array", "items": {"enum": ["text", "image"]}},
                "endpoints": {"type": "array", "items": {"enum": list(ENDPOINTS)}},
                "capabilities": {"type": "object", "properties": {
                    "parallel_tool_calls": flag, "forced_tool_choice": flag,
                    "response_format": flag, "stop": flag}},
                "pricing": {"type": "object", "properties": {
                    "input": DECIMAL_USD, "cached_input": DECIMAL_USD, "output": DECIMAL_USD,
                    "unit": {"const": "USD per 1M tokens"}}}}}

