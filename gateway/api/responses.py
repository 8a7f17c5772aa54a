"""The OpenAI Responses API: ``POST /v1/responses`` (a generation, on the same flow and meter as
chat), and the org's stored responses: ``GET`` and ``DELETE /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items`` (docs/RESPONSES.md).

A request with ``previous_response_id`` carries that chain's items (the org's own only: another
org's id is a 404), which are metered and held for like any input. A response is stored, when
``store`` asks for it, once it is complete; its row is written after its last bytes leave, and
a request naming it before then waits for it (:func:`gateway.ledger.responses.written`).
"""
import json
import logging
from datetime import timedelta
from decimal import Decimal

from flask import Blueprint, Response, current_app, g, request

from ..endings import Status
from ..errors import InvalidRequest, register_error_handlers
from ..ledger import responses as stored
from .auth import require_key
from .bodies import never_drained
from .generate import generate

log = logging.getLogger(__name__)
bp = Blueprint("responses", __name__)
bp.after_request(never_drained)
register_error_handlers(bp)  # OpenAI's envelope, as for chat
KEPT = (Status.COMPLETED,)   # a failed or cancelled response is not stored


def codec():
    """The app's Responses codec (its ``store`` default is a setting)."""
    return current_app.extensions["kiln.responses_codec"]


@bp.post("/responses")
@require_key
def create_response():
    """Create a response, metered and billed; JSON or the typed event stream."""
    services, dialect, org_id = current_app.extensions["kiln"], codec(), g.principal.org_id

    def parse(body, body_bytes):
        # The codec counts the carried items in the hold's prompt bound (and the context
        # window's check), like any input.
        return dialect.parse(body, services.catalog, body_bytes, _history(services, body))
    return generate(dialect, parse,
                    lambda chat: _store(services, org_id, chat) if chat.store else None)


def _history(services, body):
    previous = body.get("previous_response_id") if isinstance(body, dict) else None
    if previous is None:
        return None
    if not isinstance(previous, str) or not previous:
        raise InvalidRequest("Invalid 'previous_response_id': expected a response id.",
                             param="previous_response_id", code="invalid_value")
    org_id = g.principal.org_id
    return stored.written(
        lambda: stored.load_chain(services.engine, org_id, previous, cache=_history_cache()),
        services.engine, previous, _writer())


def _store(services, org_id, chat):
    """Return the flow's ``on_answer`` callback that keeps a completed response."""
    retention = timedelta(days=services.config.responses_retention_days)
    writer, cache = _writer(), _history_cache()

    def keep(gid, outcome, tail, renderer):
        if outcome.status not in KEPT:
            return
        response = renderer.response() if renderer is not None else \
            json.loads(tail, parse_float=Decimal)
        try:
            stored.save(services.engine, org_id, response, chat.input_items, retention,
                        generation_id=gid, writer=writer, cache=cache)
        except Exception as exc:  # noqa: BLE001 - the answer is paid for: it leaves unstored
            # The class only: a database error's text quotes the statement's parameters, which
            # hold the customer's content (never logged; docs/RESPONSES.md).
            log.error("stored response %s not saved: %s", chat.response_id,
                      type(exc).__name__)
    return keep


@bp.get("/responses/<response_id>")
@require_key
def get_response(response_id):
    """Return one of the org's stored responses."""
    org_id = g.principal.org_id
    return _json(stored.written(lambda: stored.get(_engine(), org_id, response_id),
                                _engine(), response_id, _writer()))


@bp.delete("/responses/<response_id>")
@require_key
def delete_response(response_id):
    """Delete one of the org's stored responses."""
    org_id = g.principal.org_id
    return _json(stored.written(lambda: stored.delete(_engine(), org_id, response_id),
                                _engine(), response_id, _writer()))


@bp.get("/responses/<response_id>/input_items")
@require_key
def list_input_items(response_id):
    """List a stored response's input items (``after``, ``limit``, ``order``)."""
    args = request.args
    limit = args.get("limit", "20")
    if not limit.isdigit():
        raise InvalidRequest("Invalid 'limit': expected an integer from 1 to 100.",
                             param="limit", code="invalid_value")
    org_id = g.principal.org_id
    return _json(stored.written(
        lambda: stored.input_items(_engine(), org_id, response_id, after=args.get("after"),
                                   limit=int(limit), order=args.get("order", "desc")),
        _engine(), response_id, _writer()))


def _json(obj):
    """A JSON answer whose decimals (``usage.cost``) are the exact numbers the answer told, as
    when it was created (Flask's own JSON would write a Decimal as a string)."""
    return Response(stored.dumps(obj), content_type="application/json")


def _engine():
    return current_app.extensions["kiln.engine"]


def _writer():
    return current_app.extensions["kiln.responses_writer"]


def _history_cache():
    return current_app.extensions["kiln.responses_history"]
