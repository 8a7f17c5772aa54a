"""``POST /v1/chat/completions``, the view: read the body, parse it with the chat codec, hand it
to the flow.

README "API" and docs/PARAMETERS.md are the contract; README gives the order: auth, validation
(:mod:`gateway.dialects.chat`), maintenance, admission, backend, relay, settlement (the last
four in :mod:`gateway.flow.life`).
Reading and parsing the body are bounded in time and memory (:mod:`gateway.api.intake`).
"""
from flask import Blueprint, current_app, g, request

from ..dialects.chat import CODEC
from ..errors import Forbidden
from ..flow.life import respond
from ..ops import lifecycle
from .auth import require_key
from .bodies import never_drained, read_body

bp = Blueprint("chat", __name__)
bp.after_request(never_drained)


@bp.post("/chat/completions")
@require_key
def chat_completions():
    """Create a chat completion, metered and billed; JSON or an SSE stream."""
    services = current_app.extensions["kiln"]
    body, body_bytes = read_body(services, current_app.extensions["kiln.parse_budget"],
                                 CODEC.name)
    chat = CODEC.parse(body, services.catalog, body_bytes)
    if not g.principal.may_use(chat.entry.id):
        raise Forbidden(f"This API key may not use model '{chat.entry.id}'.", param="model",
                        code="model_not_allowed")
    lifecycle.check_maintenance()
    return respond(services, g.principal, chat, CODEC, request.environ)
