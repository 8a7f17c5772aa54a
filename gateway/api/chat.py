"""``POST /v1/chat/completions``, the view: read the body, parse it with the chat codec, hand it
to the flow.

README "API" and docs/PARAMETERS.md are the contract; README gives the order: auth, validation
(:mod:`gateway.dialects.chat`), maintenance, admission, backend, relay, settlement (the last
four in :mod:`gateway.flow.life`).
Reading and parsing the body are bounded in time and memory (:mod:`gateway.api.intake`).
"""
from flask import Blueprint

from ..dialects.chat import CODEC
from .auth import require_key
from .bodies import never_drained
from .generate import generate

bp = Blueprint("chat", __name__)
bp.after_request(never_drained)


@bp.post("/chat/completions")
@require_key
def chat_completions():
    """Create a chat completion, metered and billed; JSON or an SSE stream."""
    return generate(CODEC)
