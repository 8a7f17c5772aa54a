"""The OpenAPI paths and schemas of keys and activity (``GET /v1/key``, ``GET /v1/keys``,
``GET /v1/activity``), merged into the document by :func:`gateway.api.openapi.build_document`."""
from .openapi_common import DECIMAL_USD, error_responses, get_operation
from .openapi_generations import csv_content, csv_parameter
from .activity import COLUMNS as ACTIVITY_COLUMNS
from .openapi_request import ref


def key_paths():
    """Return the ``paths`` entries of the key and activity endpoints."""
    paths = {
        "/v1/key": {"get": get_operation("getKey", "Show the calling key: limits, usage this "
                                "period, remaining, rate limit, created and last-used times.",
                                "Key",
                                error_responses(401, 403))},
        "/v1/keys": {"get": get_operation("listKeys", "List the organization's keys (no secrets).",
                                 "KeyList", error_responses(401, 403))},
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


def key_schemas():
    """Return the component schemas of :func:`key_paths`."""
    count = {"type": "integer", "minimum": 0}
    maybe_usd = {"anyOf": [DECIMAL_USD, {"type": "null"}]}
    when = {"type": ["string", "null"], "format": "date-time"}
    key_fields = {
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
                                                       "org-wide activity."}}
    day = {"type": "object", "required": ["date", "model", "key_prefix", "requests", "errors",
                                          "prompt_tokens", "cached_tokens",
                                          "completion_tokens", "cost_usd"],
           "properties": {"date": {"type": "string", "format": "date"},
                          "model": {"type": "string"}, "key_prefix": {"type": "string"},
                          "endpoint": {"type": "string", "description": "The API: chat, "
                                       "messages, responses, completions, embeddings."},
                          "key_label": {"type": ["string", "null"]}, "requests": count,
                          "errors": count, "prompt_tokens": count, "cached_tokens": count,
                          "completion_tokens": count, "cost_usd": DECIMAL_USD}}
    return {
        "Key": {"type": "object", "required": list(key_fields), "properties": key_fields},
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
