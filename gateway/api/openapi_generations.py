"""The OpenAPI path and schemas of ``GET /v1/generations`` (:mod:`gateway.api.generations`),
and the CSV form both it and ``GET /v1/activity`` answer with (:mod:`gateway.api.export`),
merged into the document by :func:`gateway.api.openapi.build_document`."""
from .export import BATCH_ROWS
from .generations import COLUMNS, PAGE_DEFAULT, PAGE_MAX, STATUSES
from .openapi_common import DECIMAL_USD, error_responses
from .openapi_request import ref
from ..dialects import CODECS


def csv_parameter():
    """The ``format`` query parameter of the endpoints that export CSV."""
    return {"name": "format", "in": "query", "required": False,
            "description": "`csv` for a CSV export (as `Accept: text/csv` asks), `json` (the "
                           "default, also when Accept prefers neither); anything else is a "
                           "400 with param `format`.",
            "schema": {"enum": ["json", "csv"]}}


def csv_content(columns):
    """The ``text/csv`` content of a CSV export with these ``columns``."""
    return {"text/csv": {
        "schema": {"type": "string", "description": f"RFC 4180 CSV in UTF-8, a header row "
                                                    f"then one row per item: "
                                                    f"{', '.join(columns)}. Amounts are exact "
                                                    f"decimal USD; an unknown value is an "
                                                    f"empty cell; booleans are true/false."},
        "example": ",".join(columns) + "\r\n"}}


def generations_paths(max_rows):
    """Return the ``paths`` entry of ``GET /v1/generations``.

    :param max_rows: ``KILN_EXPORT_MAX_ROWS``, stated in the CSV's description.
    """
    ok = {"description": f"A page of the organization's usage events, newest first by "
                         f"(created_at, id); or, as CSV, every one the filters match (at "
                         f"most {max_rows} rows, else a 400 export_too_large: narrow "
                         f"from/to), streamed in batches of {BATCH_ROWS}.",
          "headers": {"Content-Disposition": {
              "description": "CSV only: attachment; filename=\"generations.csv\".",
              "schema": {"type": "string"}}},
          "content": {"application/json": {"schema": ref("GenerationList")},
                      **csv_content(COLUMNS)}}
    return {"/v1/generations": {"get": {
        "operationId": "listGenerations",
        "summary": "List the organization's usage events (one per admitted request), "
                   "filtered, in cursor pages or as one CSV export. A key without org_read "
                   "lists its own only.",
        "parameters": [*_filters(), *_paging(), csv_parameter()],
        "responses": {"200": ok, **error_responses(400, 401, 403), "414": _too_long()}}}}


def _too_long():
    """Filters whose request line is longer than the HTTP server reads: gunicorn's
    ``limit_request_line`` (4094 bytes, its default) answers in the error envelope
    (deploy/gunicorn.conf.py)."""
    return {"description": "The request line (path and query) is longer than the server "
                           "reads, 4094 bytes: code `uri_too_long`.",
            "content": {"application/json": {"schema": ref("ErrorResponse")}}}


def _filters():
    when = {"type": "string", "format": "date-time"}
    return [
        _query("from", "Start times from this one on (inclusive): ISO 8601 with its offset, "
                       "e.g. 2026-12-01T00:00:00Z.", when),
        _query("to", "Start times before this one (exclusive), as `from`; later than it.",
               when),
        _query("model", "One model id.", {"type": "string", "maxLength": 200}),
        _query("key", "One key, by the prefix GET /v1/keys shows (a key without org_read: "
                      "only its own).", {"type": "string", "maxLength": 16}),
        _query("status", "One status.", {"enum": list(STATUSES)}),
        _query("endpoint", "One API.", {"enum": list(CODECS)}),
    ]


def _paging():
    return [
        _query("limit", "Items per JSON page (not with CSV).",
               {"type": "integer", "minimum": 1, "maximum": PAGE_MAX,
                "default": PAGE_DEFAULT}),
        _query("cursor", "A next_cursor as it came: the page after it.",
               {"type": "string", "maxLength": 200}),
    ]


def _query(name, description, schema):
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": schema}


def generations_schemas():
    """Return the component schemas of :func:`generations_paths`."""
    count = {"type": "integer", "minimum": 0}
    when = {"type": ["string", "null"], "format": "date-time"}
    item = {
        "id": {"type": "string"}, "object": {"const": "generation"},
        "created_at": {"type": "string", "format": "date-time"},
        "first_token_at": when, "ended_at": when, "model": {"type": "string"},
        "endpoint": {"enum": list(CODECS)}, "stream": {"type": "boolean"},
        "status": {"enum": list(STATUSES)}, "http_status": {"type": ["integer", "null"]},
        "error_code": {"type": ["string", "null"]}, "prompt_tokens": count,
        "cached_tokens": count, "completion_tokens": count, "total_tokens": count,
        "cost_usd": {"anyOf": [DECIMAL_USD, {"type": "null"}],
                     "description": "null while the event is pending"},
        "estimated": {"type": "boolean", "description": "Token counts Kiln counted itself."},
        "key_prefix": {"type": "string"}, "key_label": {"type": ["string", "null"]}}
    return {
        "ListedGeneration": {"type": "object", "required": list(item), "properties": item},
        "GenerationList": {"type": "object",
                           "required": ["object", "scope", "data", "has_more", "next_cursor"],
                           "properties": {
                               "object": {"const": "list"},
                               "scope": {"enum": ["org", "key"], "description": "key: the "
                                         "calling key's generations only (no org_read)."},
                               "data": {"type": "array", "items": ref("ListedGeneration")},
                               "has_more": {"type": "boolean"},
                               "next_cursor": {"type": ["string", "null"],
                                               "description": "null on the last page."}}},
    }
