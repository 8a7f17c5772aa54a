"""Endpoints for the key holder: the org's credits, and its own usage events.

A generation's settlement commits a few milliseconds after its answer leaves (docs/METERING.md,
"When the usage event is final"): these views first wait for this worker's outstanding
settlements of what they show, and a pending event is read again for up to
:data:`PENDING_WAIT_S` (another worker's settlement), so that a read right after an answer
shows it settled.
"""
import gevent
import sqlalchemy as sa
from flask import Blueprint, current_app, g, jsonify, request

from .auth import require_key
from ..billing import from_nanos
from ..db import iso_utc, storable_text
from ..errors import InvalidRequest, NotFound
from ..ledger.operator import org_credits
from ..models import usage_events
from ..endings import Status

bp = Blueprint("account", __name__)

PENDING_WAIT_S = 0.05   # how long a pending event is read again before it is shown pending
PENDING_POLL_S = 0.01


@bp.get("/credits")
@require_key
def credits():
    """Show the caller's org credits: balance, open holds, available (USD as exact decimal
    strings), requests in flight and the org's in-flight limit."""
    services = current_app.extensions["kiln"]
    services.ledger.wait_settled(services.config.settle_wait_s, org_id=g.principal.org_id)
    data = org_credits(current_app.extensions["kiln.engine"], g.principal.org_id)
    return jsonify({"object": "credits", **{k: format(v, "f") if k != "in_flight" else v
                                            for k, v in data.items()},
                    "in_flight_limit": g.principal.in_flight_limit})


@bp.get("/generation")
@require_key
def generation():
    """Show one of the caller's usage events by generation id; another org's id is 404.

    An id that no generation can have (longer than the column, control characters such as
    NUL, invalid Unicode) is a 400 before any query: Postgres refuses NUL in text.
    """
    gid = request.args.get("id")
    if not gid:
        raise InvalidRequest("Missing required query parameter: 'id'.", param="id",
                             code="missing_required_parameter")
    if not storable_text(gid, usage_events.c.id.type.length):
        raise InvalidRequest(f"Invalid 'id': a generation id is at most "
                             f"{usage_events.c.id.type.length} characters without control "
                             f"characters, as sent in the X-Neocloud-Generation-Id header.",
                             param="id", code="invalid_value")
    services = current_app.extensions["kiln"]
    services.ledger.wait_settled(services.config.settle_wait_s, gid=gid)
    row = _usage_event(gid, g.principal.org_id)
    if row is None:
        raise NotFound(f"No generation '{gid}' for this organization.", param="id")
    for _ in range(int(PENDING_WAIT_S / PENDING_POLL_S)):
        if row.status != Status.PENDING:
            break
        gevent.sleep(PENDING_POLL_S)
        row = _usage_event(gid, g.principal.org_id)
    return jsonify(generation_view(row))


def _usage_event(gid, org_id):
    with current_app.extensions["kiln.engine"].connect() as conn:
        return conn.execute(sa.select(usage_events).where(
            usage_events.c.id == gid, usage_events.c.org_id == org_id)).first()


def generation_view(row):
    """Return the public description of a usage-event row.

    ``cost_usd`` and ``hold_usd`` are exact decimal strings; ``cost_usd`` is None while the
    event is ``pending`` (a cost, once shown, never changes: docs/METERING.md); ``estimated``
    marks token counts that Kiln counted itself (the backend sent no usage, or the client left);
    ``prompt_counted_by`` and ``completion_counted_by`` say which count each is (``backend``,
    ``tokenizer``, ``bound``, ``progress``; None while pending or when nothing was counted:
    docs/METERING.md, "Which count applies"); times are ISO 8601 with their offset (UTC), with
    ``ttft_ms`` and ``duration_ms`` derived from them (None while unknown).
    """
    return {
        "id": row.id, "object": "generation", "model": row.model, "stream": row.stream,
        "status": row.status, "http_status": row.http_status,
        "prompt_tokens": row.prompt_tokens, "cached_tokens": row.cached_tokens,
        "completion_tokens": row.completion_tokens, "estimated": row.estimated,
        "prompt_counted_by": row.prompt_counted_by,
        "completion_counted_by": row.completion_counted_by,
        "total_tokens": row.prompt_tokens + row.completion_tokens,
        "cost_usd": (None if row.status == Status.PENDING
                     else format(from_nanos(row.cost_nanos), "f")),
        "hold_usd": format(from_nanos(row.hold_nanos), "f"), "error": row.error,
        "error_code": row.error_code, "anomaly": row.anomaly,
        "created_at": iso_utc(row.started_at), "first_token_at": iso_utc(row.first_token_at),
        "ended_at": iso_utc(row.ended_at),
        "ttft_ms": _ms_between(row.started_at, row.first_token_at),
        "duration_ms": _ms_between(row.started_at, row.ended_at),
    }


def _ms_between(start, end):
    if start is None or end is None:
        return None
    return round((end - start).total_seconds() * 1000, 1)
