"""Schema pieces every part of the OpenAPI document (:mod:`gateway.api.openapi`) uses: exact
USD amounts, the error responses of each status with the codes Kiln gives them (README, "API"),
and operation helpers."""
from .openapi_request import ref

DECIMAL_USD = {"type": "string", "pattern": r"^-?[0-9]+(\.[0-9]+)?$",
               "description": "Exact USD amount as a decimal string."}

# Error ``type`` and the ``code`` values each status can carry (errors.py and README, "API").
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
               402: "insufficient_quota", 403: "permission_error", 404: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "service_unavailable"}
ERROR_CODES = {
    400: ["invalid_json", "invalid_content_type", "missing_required_parameter", "invalid_type",
          "invalid_value", "empty_array", "unsupported_parameter", "upstream_rejected",
          "incomplete_body", "context_length_exceeded", "unknown_parameter",
          "invalid_image_url", "unsupported_endpoint", "export_too_large"],
    401: ["invalid_api_key", "key_expired"],
    402: ["insufficient_credits", "key_limit_exceeded"],
    403: ["key_revoked", "org_suspended", "model_not_allowed", "management_key",
          "management_key_required", "operator_only", "permission_denied"],
    404: ["model_not_found", "not_found"],
    413: ["request_too_large"],
    429: ["rate_limit_exceeded", "key_in_flight_limit"],
    500: ["internal_error"],
    503: ["maintenance", "no_backend_available", "backends_at_capacity", "service_unavailable",
          "database_unavailable", "database_busy"],
}
ERROR_WHY = {
    400: "Invalid request: malformed JSON, a wrong type or range, an empty `messages` "
         "(`empty_array`), a parameter the model cannot honour (`unsupported_parameter`), or "
         "the model server rejected it (`upstream_rejected`). Fix the payload; do not retry.",
    401: "Missing or unknown API key; or a key past its `expires_at`, or a rotated secret past "
         "its grace period (`key_expired`).",
    402: "The organization's available credits, or the key's spend limit "
         "(`key_limit_exceeded`), do not cover the request's hold.",
    403: "Revoked key, suspended organization, or a model outside the key's allow-list; a "
         "management key calling a model (`management_key`); a key managing keys without the "
         "permission (`management_key_required`), or changing what only the operator may "
         "(`operator_only`).",
    404: "Not found; for chat completions the model is not in the catalog.",
    413: "Request body over the size limit; refused from Content-Length before it is read.",
    429: "The organization has its limit of requests in flight, the key its requests per "
         "minute, or the key its own limit of requests in flight (`key_in_flight_limit`). No "
         "rate-limit headers.",
    500: "Unexpected error inside Kiln.",
    502: "The model backend returned an error or was unreachable (plain-text body); or its "
         "whole reply was larger than Kiln relays for the request (`upstream_too_large`, in "
         "the error envelope; billed what was generated: docs/RELIABILITY.md, \"Big "
         "answers\").",
    503: "Maintenance mode (with Retry-After), or no model backend available.",
}


def get_operation(operation_id, summary, schema, errors):
    return {"operationId": operation_id, "summary": summary,
            "responses": {"200": json_response("OK.", schema), **errors}}


def json_response(description, schema):
    return {"description": description,
            "content": {"application/json": {"schema": ref(schema)}}}


def error_responses(*statuses):
    out = {}
    for status in statuses:
        if status == 502:
            out["502"] = {"description": ERROR_WHY[502], "content": {
                "text/plain": {"schema": {"type": "string"}},
                # upstream_too_large (chat, completions); every code where the dialect's
                # blueprint writes all of its errors in the envelope
                "application/json": {"schema": ref("ErrorResponse")}}}
            continue
        response = {"description": ERROR_WHY[status], "content": {"application/json": {
            "schema": {"allOf": [ref("ErrorResponse"), _error_codes(status)]}}}}
        if status == 503:
            response["headers"] = {"Retry-After": {
                "description": "Seconds to wait (maintenance mode; a backend at capacity).",
                "schema": {"type": "string"}}}
        out[str(status)] = response
    return out


def _error_codes(status):
    return {"properties": {"error": {"properties": {
        "type": {"const": ERROR_TYPES[status]}, "code": {"enum": ERROR_CODES[status]}}}}}
