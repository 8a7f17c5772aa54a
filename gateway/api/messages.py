"""The Anthropic Messages API: ``POST /v1/messages`` (a generation, on the same flow and meter
as chat) and ``POST /v1/messages/count_tokens`` (the input tokens: authenticated and bounded,
never admitted or billed). Errors in Anthropic's envelope (docs/MESSAGES.md).

Clients authenticate with ``x-api-key`` (Anthropic's header) or ``Authorization: Bearer``; any
``anthropic-version`` and ``anthropic-beta`` are accepted, as newer clients send newer ones.
"""
from flask import Blueprint, current_app, jsonify

from ..backends import upstream
from ..dialects.messages import MessagesCodec
from ..errors import register_error_handlers
from .auth import require_key
from .bodies import never_drained, read_body
from .generate import check_model, generate

CODEC = MessagesCodec()
bp = Blueprint("messages", __name__)
bp.after_request(never_drained)
register_error_handlers(bp, CODEC.error_body)


@bp.post("/messages")
@require_key
def create_message():
    """Create a message, metered and billed; JSON or Anthropic's event stream."""
    return generate(CODEC)


@bp.post("/messages/count_tokens")
@require_key
def count_tokens():
    """Count a Messages request's input tokens: the backend's tokenizer where the catalog
    names one (``tokenize_url``), else Kiln's estimate, which errs upward."""
    services = current_app.extensions["kiln"]
    body, body_bytes, _ = read_body(services, current_app.extensions["kiln.parse_budget"],
                                    CODEC.name)
    model = body.get("model") if isinstance(body, dict) else None
    entry = services.catalog.get(model) if isinstance(model, str) else None
    backend = next((b for b in entry.backends if b.tokenize_url), None) if entry else None
    if entry is not None:
        check_model(entry.id)

    def count(text):
        local = services.tokenizers.count(entry.id, text) if entry is not None else None
        if local is not None or backend is None:
            return local
        try:
            return upstream.count_tokens(services.session, backend, text)
        except upstream.TokenizeFailed:
            return None  # Kiln's estimate, which errs upward; nothing is billed here
    return jsonify(CODEC.count_tokens(body, services.catalog, body_bytes, count))
