"""``POST /v1/chat/completions``, the view: read the body, check the contract, hand it to the flow.

The endpoint reference is the contract; README "API" gives the order: auth, validation,
maintenance, admission, backend, relay, settlement (the last four in :mod:`gateway.completions`).
"""
from flask import Blueprint, current_app, g, request

from . import completions, ops
from .auth import require_key
from .errors import Forbidden, InvalidRequest, PayloadTooLarge
from .validation import parse_json_body, validate_chat

bp = Blueprint("chat", __name__)


@bp.post("/chat/completions")
@require_key
def chat_completions():
    """Create a chat completion, metered and billed; JSON or an SSE stream."""
    services = current_app.extensions["kiln"]
    body, body_bytes = _read_body(services.config)
    chat = validate_chat(body, services.catalog, body_bytes)
    if not g.principal.may_use(chat.entry.id):
        raise Forbidden(f"This API key may not use model '{chat.entry.id}'.", param="model",
                        code="model_not_allowed")
    ops.check_maintenance()
    return completions.respond(services, g.principal, chat, request.environ)


def _read_body(config):
    length = request.content_length
    if length is not None and length > config.max_body_bytes:
        raise PayloadTooLarge(f"Request body is larger than {config.max_body_bytes} bytes.")
    raw = request.stream.read(config.max_body_bytes + 1) if length is None else request.get_data()
    if length is not None and len(raw) < length:
        # The client went away mid-body: whatever parses from the part received was not sent.
        raise InvalidRequest(f"Request body ended after {len(raw)} of the {length} bytes "
                             f"announced by Content-Length.", code="incomplete_body")
    return parse_json_body(raw, request.content_type, config.max_body_bytes), len(raw)
