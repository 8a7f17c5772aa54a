"""The OpenAPI paths and schemas of keys and activity (``GET /v1/key``, the keys API under
``/v1/keys`` (docs/KEYS.md), ``GET /v1/activity``), merged into the document by
:func:`gateway.api.openapi.build_document`."""
from .activity import COLUMNS as ACTIVITY_COLUMNS
from .key_fields import LABEL_CHARS, MAX_INTEGER
from .keys import MAX_BODY_BYTES, MAX_GRACE_PERIOD_S
from .openapi_common import DECIMAL_USD, error_responses, get_operation, json_response
from .openapi_generations import csv_content, csv_parameter
from .openapi_request import ref

KEY_ID = {"name": "key_id", "in": "path", "required": True,
          "description": "The key's `id` (from its view; stable across rotations).",
          "schema": {"type": "integer", "minimum": 1}}


def key_paths():
    """Return the ``paths`` entries of the key and activity endpoints."""
    paths = {
        "/v1/key": {"get": get_operation("getKey", "Show the calling key: limits, usage this "
                                "period, remaining, rate limit, created and last-used times.",
                                "Key",
                                error_responses(401, 403))},
        "/v1/keys": {"get": get_operation("listKeys", "List the organization's keys (no secrets; "
                                          "a key without org_read sees only itself).",
                                          "KeyList", error_responses(401, 403)),
                     "post": _change("createKey", "Create a key in the caller's organization "
                                     "(management keys); its secret is in `key`, shown once.",
                                     "KeyFields", "201", "KeyWithSecret")},
        "/v1/keys/{key_id}": {
            "parameters": [KEY_ID],
            "get": get_operation("getKeyById", "Show one of the organization's keys.", "Key",
                                 error_responses(401, 403, 404)),
            "patch": _change("updateKey", "Change a key's fields (null clears one; management "
                             "keys).", "KeyFields", "200", "Key"),
            "delete": {"operationId": "revokeKey", "summary": "Revoke a key (management keys); "
                       "revoking it again changes nothing.",
                       "responses": {"200": json_response("The revoked key.", "Key"),
                                     **error_responses(401, 403, 404)}}},
        "/v1/keys/{key_id}/rotate": {
            "parameters": [KEY_ID],
            "post": _change("rotateKey", "Give a key a new secret (in `key`); the old one keeps "
                            "working for `grace_period_s` (management keys).", "KeyRotation",
                            "200", "KeyWithSecret", required=False)},
        "/v1/activity": {"get": {
            **get_operation("getActivity", "The organization's usage by UTC day, model and key, "
                   "for the last 30 days or one date.", "Activity", error_responses(400, 401, 403)),
            "parameters": [{"name": "date", "in": "query", "required": False,
                            "description": "One UTC day, YYYY-MM-DD (default: the last 30 "
                                           "days, today included). Anything else is a 400 "
                                           "`invalid_value` with param `date`.",
                            "schema": {"type": "string", "format": "date"}},
                           csv_parameter()]}},
    }
    ok = paths["/v1/activity"]["get"]["responses"]["200"]
    ok["content"].update(csv_content(ACTIVITY_COLUMNS))
    ok["description"] = ("The rows as JSON; or, as CSV (`?format=csv` or `Accept: text/csv`), "
                         "in the rollup's key order (day, model, key, endpoint).")
    return paths


def _change(operation_id, summary, body, status, answer, required=True):
    errors = error_responses(400, 401, 403, 404, 413)
    errors["413"]["description"] += f" The limit is {MAX_BODY_BYTES} bytes."
    return {"operationId": operation_id, "summary": summary,
            "requestBody": {"required": required,
                            "content": {"application/json": {"schema": ref(body)}}},
            "responses": {status: json_response("The key.", answer), **errors}}


def _key_fields():
    """The writable fields of a key: its view's names (docs/KEYS.md)."""
    count = {"type": ["integer", "null"], "minimum": 1, "maximum": MAX_INTEGER}
    return {
        "label": {"type": ["string", "null"], "maxLength": LABEL_CHARS},
        "limit_usd": {"anyOf": [DECIMAL_USD, {"type": "null"}],
                      "description": "Spend limit, an exact decimal string; null: none."},
        "limit_reset": {"enum": ["daily", "weekly", "monthly", "never", None]},
        "rate_limit": {"anyOf": [{"type": "null"}, {
            "type": "object", "required": ["requests_per_minute"],
            "additionalProperties": False,
            "properties": {"requests_per_minute": {"type": "integer", "minimum": 1,
                                                   "maximum": MAX_INTEGER}}}]},
        "requests_per_minute": {**count, "description": "The same as `rate_limit`."},
        "in_flight_limit": {**count, "description": "The key's own limit of requests in "
                                                    "flight (the org's applies too)."},
        "expires_at": {"type": ["string", "null"], "format": "date-time",
                       "description": "ISO 8601 with a UTC offset, in the future; refused "
                                      "with 401 `key_expired` from then on."},
        "models": {"anyOf": [{"type": "array", "minItems": 1, "items": {"type": "string"}},
                             {"type": "null"}],
                   "description": "Allow-list of catalog ids (GET /v1/models); an unknown id "
                                  "is a 400. null: every model."},
        "org_read": {"type": "boolean"},
        "manage": {"const": False, "description": "Management keys are the operator's to "
                                                  "create (403 `operator_only`)."},
    }


def _key_view():
    """The properties of a key's view (``Key``): every field ``GET /v1/keys/{id}`` answers."""
    maybe_usd = {"anyOf": [DECIMAL_USD, {"type": "null"}]}
    when = {"type": ["string", "null"], "format": "date-time"}
    return {
        "object": {"const": "key"}, "label": {"type": ["string", "null"]},
        "prefix": {"type": "string"},
        "limit_usd": {**maybe_usd, "description": "Spend limit; null: none."},
        "limit_reset": {"enum": ["daily", "weekly", "monthly", None],
                        "description": "When the limit starts again (UTC); null: never."},
        "usage_usd": {**DECIMAL_USD, "description": "Spent in the current period."},
        "held_usd": {**DECIMAL_USD, "description": "Holds of requests in flight."},
        "remaining_usd": {**maybe_usd, "description": "Limit less usage and holds."},
        "period_start": when, "resets_at": when,
        "rate_limit": {"anyOf": [{"type": "null"}, {
            "type": "object", "required": ["requests_per_minute"],
            "properties": {"requests_per_minute": {"type": "integer", "minimum": 1}}}]},
        "created_at": when, "last_used_at": when, "revoked": {"type": "boolean"},
        "org_read": {"type": "boolean", "description": "May read the org's other keys and "
                                                       "org-wide activity."},
        "id": {"type": "integer", "minimum": 1, "description": "Stable; never a secret."},
        "models": {"anyOf": [{"type": "array", "items": {"type": "string"}},
                             {"type": "null"}], "description": "Allow-list; null: every model."},
        "in_flight_limit": {"type": ["integer", "null"], "minimum": 1},
        "expires_at": when,
        "previous_key_expires_at": {**when, "description": "When the secret before the last "
                                    "rotation stops working; null once it has."},
        "manage": {"type": "boolean", "description": "A management key (manages the org's "
                                                     "keys, calls no model)."}}


def _activity_day():
    """One row of ``Activity``: an org's (or key's) usage of one model on one day."""
    count = {"type": "integer", "minimum": 0}
    return {"type": "object",
            "required": ["date", "model", "key_prefix", "requests", "errors", "prompt_tokens",
                         "cached_tokens", "completion_tokens", "cost_usd"],
            "properties": {"date": {"type": "string", "format": "date"},
                           "model": {"type": "string"}, "key_prefix": {"type": "string"},
                           "endpoint": {"type": "string", "description": "The API: chat, "
                                        "messages, responses, completions, embeddings."},
                           "key_label": {"type": ["string", "null"]}, "requests": count,
                           "errors": count, "prompt_tokens": count, "cached_tokens": count,
                           "completion_tokens": count, "cost_usd": DECIMAL_USD}}


def key_schemas():
    """Return the component schemas of :func:`key_paths`."""
    key_fields, day = _key_view(), _activity_day()
    return {
        "Key": {"type": "object", "required": list(key_fields), "properties": key_fields},
        "KeyWithSecret": {"allOf": [ref("Key"), {
            "type": "object", "required": ["key"], "properties": {"key": {
                "type": "string", "description": "The secret, shown this once."}}}]},
        "KeyFields": {"type": "object", "additionalProperties": False,
                      "properties": _key_fields()},
        "KeyRotation": {"type": "object", "additionalProperties": False, "properties": {
            "grace_period_s": {"type": "integer", "minimum": 0,
                               "maximum": MAX_GRACE_PERIOD_S, "default": 0,
                               "description": "How long the old secret keeps working."}}},
        "KeyList": {"type": "object", "required": ["object", "data"], "properties": {
            "object": {"const": "list"}, "data": {"type": "array", "items": ref("Key")}}},
        "Activity": {"type": "object", "required": ["object", "start_date", "end_date", "data"],
                     "properties": {"object": {"const": "activity"},
                                    "start_date": {"type": "string", "format": "date"},
                                    "end_date": {"type": "string", "format": "date"},
                                    "scope": {"enum": ["org", "key"],
                                              "description": "key: the calling key's rows "
                                                             "only (no org_read)."},
                                    "data": {"type": "array", "items": day}}},
    }
