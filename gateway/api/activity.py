"""Where the money goes: ``GET /v1/activity`` and the activity page at ``/activity``.

The API serves the daily rollup ``usage_daily`` (one row per org, UTC day, model and key, written
by settlement in the transaction that settles the events it sums), never the usage events
themselves: one index range scan of the org's days, however many events there are
(docs/ACTIVITY.md has the plan and a timing on 1,000,000 events).

As CSV (``?format=csv`` or ``Accept: text/csv``: :mod:`.export`), the same rows are streamed
in the rollup's key order (day, model, key by creation, endpoint), read in keyset batches; an
export is bounded by its days (30, or one).

The page is a static HTML file with its script and stylesheet (no build step, nothing fetched
from elsewhere): the user pastes a key, kept in the tab's session storage only, and the script
calls ``/v1/credits``, ``/v1/keys``, ``/v1/activity`` and ``/v1/generations`` with it as the
Bearer header (and downloads the generations' CSV the same way).
"""
import re
from datetime import date, timedelta
from pathlib import Path

import sqlalchemy as sa
from flask import Blueprint, current_app, g, jsonify, request, send_from_directory

from .auth import require_key
from .export import csv_response, keyset_batches, text_cell, wants_csv
from ..billing import from_nanos
from ..db import utcnow
from ..errors import InvalidRequest
from ..models import api_keys, usage_daily

STATIC = Path(__file__).with_name("pages")
DAYS = 30
# The page loads and calls nothing but this origin, and no other site may frame it.
PAGE_POLICY = "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
COLUMNS = ("date", "model", "endpoint", "key_prefix", "key_label", "requests", "errors",
           "prompt_tokens", "cached_tokens", "completion_tokens", "cost_usd")

bp = Blueprint("activity", __name__)
page = Blueprint("activity_page", __name__, static_folder=str(STATIC),
                 static_url_path="/activity/static")


def activity_query(org_id, first, last, key_id=None):
    """Return the SELECT of the org's rollup rows from day ``first`` to ``last`` (inclusive),
    with each key's prefix and label, ordered by day, model, key and endpoint; only key
    ``key_id``'s when given."""
    d = usage_daily.c
    query = (sa.select(d.day, d.model, d.endpoint, d.api_key_id, api_keys.c.prefix,
                       api_keys.c.name, d.requests, d.errors, d.prompt_tokens, d.cached_tokens,
                       d.completion_tokens, d.cost_nanos)
             .join(api_keys, api_keys.c.id == d.api_key_id)
             .where(d.org_id == org_id, d.day >= first, d.day <= last)
             .order_by(d.day, d.model, api_keys.c.prefix, d.endpoint))
    return query if key_id is None else query.where(d.api_key_id == key_id)


def org_activity(engine, org_id, first, last, key_id=None):
    """Return the rows of :func:`activity_query` as the API shows them (cost as an exact
    decimal string of USD)."""
    with engine.connect() as conn:
        rows = conn.execute(activity_query(org_id, first, last, key_id)).all()
    return [activity_row(r) for r in rows]


def activity_row(row):
    """Return a row of :func:`activity_query` as the API shows it."""
    return {"date": row.day.isoformat(), "model": row.model, "endpoint": row.endpoint,
            "key_prefix": row.prefix, "key_label": row.name, "requests": row.requests,
            "errors": row.errors, "prompt_tokens": row.prompt_tokens,
            "cached_tokens": row.cached_tokens, "completion_tokens": row.completion_tokens,
            "cost_usd": format(from_nanos(row.cost_nanos), "f")}


def activity_csv(engine, org_id, first, last, key_id=None):
    """Return the rows of :func:`activity_query` as a streamed CSV of :data:`COLUMNS`, in the
    rollup's primary-key order, read in keyset batches of that key."""
    d = usage_daily.c
    order = (d.day, d.model, d.api_key_id, d.endpoint)
    query = activity_query(org_id, first, last, key_id).order_by(None).order_by(*order)

    def page(position, size):
        if position is None:
            return query.limit(size)
        start = sa.tuple_(*(sa.literal(value, column.type)
                            for value, column in zip(position, order, strict=True)))
        return query.where(sa.tuple_(*order) > start).limit(size)

    def cells(row):
        item = activity_row(row)
        item["model"], item["key_label"] = text_cell(item["model"]), text_cell(item["key_label"])
        return [item[column] for column in COLUMNS]
    batches = keyset_batches(engine, page, lambda r: (r.day, r.model, r.api_key_id, r.endpoint))
    return csv_response(COLUMNS, ([cells(row) for row in batch] for batch in batches),
                        f"activity-{first.isoformat()}-{last.isoformat()}.csv")


def requested_days(args, today):
    """Return ``(first, last)``: the day ``?date=YYYY-MM-DD`` names, or the last 30 UTC days.

    :raises InvalidRequest: ``date`` is not a calendar date written ``YYYY-MM-DD`` (400).
    """
    text = args.get("date")
    if text is None:
        return today - timedelta(days=DAYS - 1), today
    try:
        if not _DATE.fullmatch(text):
            raise ValueError(text)
        day = date.fromisoformat(text)
    except ValueError:
        raise InvalidRequest(f"Invalid 'date': expected a UTC calendar day as YYYY-MM-DD, got "
                             f"{text[:40]!r}.", param="date", code="invalid_value") from None
    return day, day


@bp.get("/activity")
@require_key
def activity():
    """Show the caller's org's usage by UTC day, model and key: requests, errors, prompt /
    cached / completion tokens and cost, for the last 30 days or ``?date=YYYY-MM-DD``; a key
    without ``org_read`` sees its own rows only (``scope: "key"``); as CSV with
    ``?format=csv`` or ``Accept: text/csv``."""
    first, last = requested_days(request.args, utcnow().date())
    principal, engine = g.principal, current_app.extensions["kiln.engine"]
    key_id = None if principal.org_read else principal.key_id
    if wants_csv(request):
        return activity_csv(engine, principal.org_id, first, last, key_id)
    rows = org_activity(engine, principal.org_id, first, last, key_id)
    return jsonify({"object": "activity", "start_date": first.isoformat(),
                    "end_date": last.isoformat(), "scope": "org" if principal.org_read else "key",
                    "data": rows})


@page.get("/activity")
def activity_page():
    """Serve the activity page (static; it asks for a key and calls the API with it)."""
    return send_from_directory(STATIC, "activity.html")


@page.after_request
def _page_headers(response):
    """Every path the page is served from (the page, its script and stylesheet) gets the same
    policy: nothing from elsewhere, no framing, no type sniffing, nothing kept in a cache
    (the page shows a key's data)."""
    response.headers["Content-Security-Policy"] = PAGE_POLICY
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Cache-Control"] = "no-store"
    return response
