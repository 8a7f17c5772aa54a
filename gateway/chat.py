"""``POST /v1/chat/completions``, the view: read the body, check the contract, hand it to the flow.

The endpoint reference is the contract; README "API" gives the order: auth, validation,
maintenance, admission, backend, relay, settlement (the last four in :mod:`gateway.completions`).
Reading and parsing the body are bounded in time and memory (:mod:`gateway.intake`).
"""
from flask import Blueprint, after_this_request, current_app, g, request

from . import completions, intake, ops
from .auth import require_key
from .errors import Forbidden, InvalidRequest, PayloadTooLarge, ServiceUnavailable
from .validation import parse_json_body, validate_chat

bp = Blueprint("chat", __name__)


@bp.post("/chat/completions")
@require_key
def chat_completions():
    """Create a chat completion, metered and billed; JSON or an SSE stream."""
    services = current_app.extensions["kiln"]
    body, body_bytes = _read_body(services, current_app.extensions["kiln.parse_budget"])
    chat = validate_chat(body, services.catalog, body_bytes)
    if not g.principal.may_use(chat.entry.id):
        raise Forbidden(f"This API key may not use model '{chat.entry.id}'.", param="model",
                        code="model_not_allowed")
    ops.check_maintenance()
    return completions.respond(services, g.principal, chat, request.environ)


def _read_body(services, budget):
    """Read and parse the body, within the bounds of :mod:`gateway.intake`; return
    ``(body, size in bytes)``."""
    config, length = services.config, request.content_length
    if length is not None and length > config.max_body_bytes:
        raise PayloadTooLarge(f"Request body is larger than {config.max_body_bytes} bytes.")
    if length is not None and length >= intake.INLINE_BYTES:
        held = _take_share(budget, length)  # before the first byte is read
        try:
            raw = _receive(config, length)
            return _parse(services, budget, raw), len(raw)
        finally:
            budget.release(held)
    raw = _receive(config, length)
    if len(raw) < intake.INLINE_BYTES:
        return _parse(services, budget, raw), len(raw)
    held = budget.acquire(len(raw))  # a large body of unknown length: held by its real size
    try:
        return _parse(services, budget, raw), len(raw)
    finally:
        budget.release(held)


def _take_share(budget, length):
    try:
        return budget.acquire(length)
    except ServiceUnavailable:
        sock = request.environ.get("gunicorn.socket")
        if sock is not None:  # refused unread: no reading it all just to keep the connection
            after_this_request(lambda response: _hang_up_after(response, sock))
        raise


def _hang_up_after(response, sock):
    response.call_on_close(lambda: intake.hang_up(sock))
    return response


def _receive(config, length):
    raw = intake.read_body(request.stream, length, config.max_body_bytes, config.body_timeout_s)
    if length is not None and len(raw) < length:
        # The client went away mid-body: whatever parses from the part received was not sent.
        raise InvalidRequest(f"Request body ended after {len(raw)} of the {length} bytes "
                             f"announced by Content-Length.", code="incomplete_body")
    return raw


def _parse(services, budget, raw):
    """Parse a small body inline; a large one in the worker's child process, which checks it
    against the whole contract first (:mod:`gateway.body_process`)."""
    if len(raw) < intake.INLINE_BYTES or len(raw) > services.config.max_body_bytes:
        return parse_json_body(raw, request.content_type, services.config.max_body_bytes)
    checker = current_app.extensions["kiln.body_process"]
    checker.start()
    return budget.run(checker.check, raw, request.content_type or "")
