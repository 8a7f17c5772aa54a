"""Every request, listable and exportable: ``GET /v1/generations``.

The org's usage events (one per admitted request: docs/METERING.md), newest first by
``(started_at, id)``, filtered by start time (``from`` inclusive, ``to`` exclusive: ISO 8601
with an offset), ``model``, ``key`` (the prefix ``GET /v1/keys`` shows), ``status`` and
``endpoint``; as JSON pages of ``limit`` (default 50, at most 500) with an opaque
``next_cursor``, or as one streamed CSV (:mod:`.export`) of at most ``KILN_EXPORT_MAX_ROWS``
rows. Each page, and each batch of an export, is one range scan of the index
``(org_id, started_at, id)`` from the cursor's position (migration 0017).

A key without ``org_read`` sees its own key's generations only (``scope: "key"``), as
``GET /v1/activity`` shows it its own rows; naming another key is a 400 for it.

The order is a keyset: a cursor is the position of the last item of its page, and the next page
starts strictly after it. A request admitted while a client pages starts later than every item
already listed, so it is never listed on a later page (no duplicates), and no item is skipped.
"""
import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime, timezone

import sqlalchemy as sa
from flask import Blueprint, current_app, g, jsonify, request

from .auth import require_key
from .export import csv_response, keyset_batches, refuse_large_export, text_cell, wants_csv
from ..billing import from_nanos
from ..db import storable_text
from ..dialects import CODECS
from ..endings import Status
from ..errors import InvalidRequest, UnknownParameter
from ..ledger.keys import PREFIX_LEN
from ..models import api_keys, usage_events

bp = Blueprint("generations", __name__)

PAGE_DEFAULT, PAGE_MAX = 50, 500
PARAMS = ("from", "to", "model", "key", "status", "endpoint", "limit", "cursor", "format")
STATUSES = tuple(status.value for status in Status)
COLUMNS = ("id", "created_at", "first_token_at", "ended_at", "model", "endpoint", "stream",
           "status", "http_status", "error_code", "prompt_tokens", "cached_tokens",
           "completion_tokens", "total_tokens", "cost_usd", "estimated", "key_prefix",
           "key_label")
_TIME_CHARS = 64  # longer than any ISO 8601 timestamp: refused before parsing


@dataclass(frozen=True)
class Filters:
    """What ``GET /v1/generations`` lists: start times in ``[since, until)`` (aware UTC
    datetimes, None: unbounded), and equality on the rest (None: any)."""

    since: datetime = None
    until: datetime = None
    model: str = None
    key_prefix: str = None
    status: str = None
    endpoint: str = None


def parse_filters(args):
    """Return the :class:`Filters` of the query string ``args`` (a werkzeug MultiDict), after
    refusing parameters the endpoint does not have.

    :raises UnknownParameter: a parameter not in :data:`PARAMS` (400 ``unknown_parameter``).
    :raises InvalidRequest: a parameter given twice; ``from``/``to`` not ISO 8601 with an
        offset, or ``to`` not after ``from``; ``status`` or ``endpoint`` not one of theirs;
        ``model`` or ``key`` not text a model id or key prefix can be (400 ``invalid_value``,
        ``param`` naming it).
    """
    for name in args:
        if name not in PARAMS:
            raise UnknownParameter(name[:100])
        if len(args.getlist(name)) > 1:
            raise _invalid(name, "give it once")
    since, until = _when(args, "from"), _when(args, "to")
    if since is not None and until is not None and until <= since:
        raise _invalid("to", "it must be later than 'from'")
    return Filters(since=since, until=until,
                   model=_text(args, "model", usage_events.c.model.type.length),
                   key_prefix=_text(args, "key", api_keys.c.prefix.type.length),
                   status=_choice(args, "status", STATUSES),
                   endpoint=_choice(args, "endpoint", tuple(CODECS)))


def page_size(args):
    """Return ``limit`` as a whole number from 1 to :data:`PAGE_MAX` (default 50).

    :raises InvalidRequest: anything else (400 ``invalid_value``, ``param: "limit"``).
    """
    text = args.get("limit")
    if text is None:
        return PAGE_DEFAULT
    if not (text.isascii() and text.isdigit() and 1 <= int(text) <= PAGE_MAX):
        raise _invalid("limit", f"expected a whole number from 1 to {PAGE_MAX}, got "
                                f"{text[:40]!r}")
    return int(text)


def encode_cursor(row):
    """Return the opaque cursor of a listed row: its position, ``(started_at, id)``."""
    raw = json.dumps([_utc(row.started_at).isoformat(), row.id], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(text):
    """Return the position ``(started_at, id)`` a cursor of :func:`encode_cursor` holds.

    :raises InvalidRequest: anything else (400 ``invalid_value``, ``param: "cursor"``).
    """
    try:
        if len(text) > 200:
            raise ValueError(text)
        started, gid = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
        when = datetime.fromisoformat(started)
        if when.tzinfo is None or not storable_text(gid, usage_events.c.id.type.length):
            raise ValueError(text)
        return when.astimezone(timezone.utc), gid
    except (ValueError, TypeError, binascii.Error):
        raise _invalid("cursor", "pass a next_cursor back as it came") from None


def generations_query(org_id, filters, key_id=None):
    """Return the SELECT of the org's usage events that ``filters`` match, with each key's
    prefix and label, newest first by ``(started_at, id)``; only key ``key_id``'s when given.

    :param filters: :class:`Filters`; its ``key_prefix`` is resolved by the caller into
        ``key_id`` (:func:`visible_key`).
    """
    e = usage_events.c
    query = (sa.select(e.id, e.started_at, e.first_token_at, e.ended_at, e.model, e.endpoint,
                       e.stream, e.status, e.http_status, e.error_code, e.prompt_tokens,
                       e.cached_tokens, e.completion_tokens, e.cost_nanos, e.estimated,
                       api_keys.c.prefix, api_keys.c.name)
             .join(api_keys, api_keys.c.id == e.api_key_id)
             .where(e.org_id == org_id)
             .order_by(e.started_at.desc(), e.id.desc()))
    for column, value in ((e.model, filters.model), (e.status, filters.status),
                          (e.endpoint, filters.endpoint), (e.api_key_id, key_id)):
        if value is not None:
            query = query.where(column == value)
    if filters.since is not None:
        query = query.where(e.started_at >= filters.since)
    if filters.until is not None:
        query = query.where(e.started_at < filters.until)
    return query


def after(query, position, inclusive=False):
    """Return ``query`` (of :func:`generations_query`) from just after ``position``, a
    ``(started_at, id)`` pair, in its order (None: from its first row); from ``position``
    itself on when ``inclusive``."""
    if position is None:
        return query
    e = usage_events.c
    key, start = sa.tuple_(e.started_at, e.id), sa.tuple_(
        sa.literal(position[0], e.started_at.type), sa.literal(position[1], e.id.type))
    return query.where(key <= start if inclusive else key < start)


def visible_key(engine, principal, prefix):
    """Return the id of the key with display ``prefix`` that ``principal`` may read the
    generations of: its org's keys with ``org_read``, else only itself.

    :raises InvalidRequest: no such key among them (400 ``invalid_value``, ``param: "key"``);
        another org's key is no different from none.
    """
    if not principal.org_read:
        if prefix == principal.key_prefix:
            return principal.key_id
        raise _invalid("key", f"this key may read only its own generations ({prefix!r} is "
                              f"not it): a key without org_read sees only itself")
    with engine.connect() as conn:
        key_id = conn.execute(sa.select(api_keys.c.id).where(
            api_keys.c.org_id == principal.org_id, api_keys.c.prefix == prefix)).scalar()
    if key_id is None:
        raise _invalid("key", f"no key of this organization has the prefix {prefix!r} (a "
                              f"key's prefix is its first {PREFIX_LEN} characters, as "
                              f"GET /v1/keys shows it)")
    return key_id


def generation_item(row):
    """Return one listed usage event as the API shows it.

    Times are ISO 8601 in UTC with their offset (``+00:00``); ``cost_usd`` is an exact decimal
    string of USD, None while the event is ``pending``; ``estimated`` marks token counts Kiln
    counted itself (docs/METERING.md); ``key_prefix`` and ``key_label`` name the key.
    """
    return {
        "id": row.id, "object": "generation", "created_at": _iso(row.started_at),
        "first_token_at": _iso(row.first_token_at), "ended_at": _iso(row.ended_at),
        "model": row.model, "endpoint": row.endpoint, "stream": row.stream,
        "status": row.status, "http_status": row.http_status, "error_code": row.error_code,
        "prompt_tokens": row.prompt_tokens, "cached_tokens": row.cached_tokens,
        "completion_tokens": row.completion_tokens,
        "total_tokens": row.prompt_tokens + row.completion_tokens,
        "cost_usd": (None if row.status == Status.PENDING
                     else format(from_nanos(row.cost_nanos), "f")),
        "estimated": row.estimated, "key_prefix": row.prefix, "key_label": row.name,
    }


def csv_row(row):
    """Return one usage event as a CSV row of :data:`COLUMNS`."""
    item = generation_item(row)
    item["model"], item["key_label"] = text_cell(item["model"]), text_cell(item["key_label"])
    return [item[column] for column in COLUMNS]


@bp.get("/generations")
@require_key
def generations():
    """List the caller's org's usage events, newest first: a JSON page with ``next_cursor``,
    or every matching one as CSV (``?format=csv`` or ``Accept: text/csv``)."""
    filters, as_csv = parse_filters(request.args), wants_csv(request)
    limit = page_size(request.args)
    cursor = request.args.get("cursor")
    position = None if cursor is None else decode_cursor(cursor)
    services, principal = current_app.extensions["kiln"], g.principal
    engine = current_app.extensions["kiln.engine"]
    key_id = None if principal.org_read else principal.key_id
    if filters.key_prefix is not None:
        key_id = visible_key(engine, principal, filters.key_prefix)
    services.ledger.wait_settled(services.config.settle_wait_s, org_id=principal.org_id)
    query = generations_query(principal.org_id, filters, key_id)
    if as_csv:
        return export_csv(engine, query, position, services.config.export_max_rows,
                          "limit" in request.args)
    with engine.connect() as conn:
        rows = conn.execute(after(query, position).limit(limit + 1)).all()
    more = len(rows) > limit
    return jsonify({"object": "list", "scope": "org" if principal.org_read else "key",
                    "data": [generation_item(row) for row in rows[:limit]], "has_more": more,
                    "next_cursor": encode_cursor(rows[limit - 1]) if more else None})


def export_csv(engine, query, position, max_rows, limited):
    """Return the CSV export of ``query`` from ``position`` on, streamed in keyset batches:
    the generations the filters match from its newest one at the start of the export down.

    :raises InvalidRequest: ``limited`` (``limit`` was given: it sizes JSON pages; an export
        holds every matching row), or more than ``max_rows`` rows (``export_too_large``).
    """
    if limited:
        raise _invalid("limit", "it sizes a JSON page; a CSV export holds every generation "
                                "the filters match (narrow it with from/to)")
    query = after(query, position)
    with engine.connect() as conn:
        newest = conn.execute(query.limit(1)).first()
    if newest is not None:  # the export ends where it began: later requests are not in it
        query = after(query, (newest.started_at, newest.id), inclusive=True)
    refuse_large_export(engine, query, max_rows, "from/to")
    batches = keyset_batches(engine, lambda start, size: after(query, start).limit(size),
                             lambda row: (row.started_at, row.id))
    return csv_response(COLUMNS, ([csv_row(row) for row in batch] for batch in batches),
                        "generations.csv")


def _when(args, name):
    text = args.get(name)
    if text is None:
        return None
    try:
        if len(text) > _TIME_CHARS or not text.isascii():
            raise ValueError(text)
        when = datetime.fromisoformat(text)
        if when.tzinfo is None:
            raise ValueError(text)
        return when.astimezone(timezone.utc)
    except (ValueError, OverflowError):
        raise _invalid(name, f"expected an ISO 8601 time with its offset, such as "
                             f"2026-12-01T00:00:00Z or 2026-12-01T09:30:00+09:00, got "
                             f"{text[:40]!r}") from None


def _text(args, name, max_chars):
    text = args.get(name)
    if text is not None and (not text or not storable_text(text, max_chars)):
        raise _invalid(name, f"expected at most {max_chars} characters without control "
                             f"characters, got {text[:40]!r}")
    return text


def _choice(args, name, choices):
    text = args.get(name)
    if text is not None and text not in choices:
        raise _invalid(name, f"expected one of {', '.join(choices)}; got {text[:40]!r}")
    return text


def _invalid(name, why):
    return InvalidRequest(f"Invalid '{name}': {why}.", param=name, code="invalid_value")


def _utc(ts):
    """An aware UTC time: SQLite gives back naive UTC times, Postgres aware ones."""
    return ts.replace(tzinfo=timezone.utc) if ts.tzinfo is None else ts.astimezone(timezone.utc)


def _iso(ts):
    return None if ts is None else _utc(ts).isoformat()
