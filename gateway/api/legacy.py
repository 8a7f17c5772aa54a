"""``POST /v1/completions`` and ``POST /v1/embeddings``, the views: read the body, parse it
with the endpoint's codec, hand it to the flow, as chat completions' view does
(:mod:`gateway.api.chat`).

README "API" and docs/PARAMETERS.md ("Completions", "Embeddings") are the contract; a model
serves an endpoint only when its catalog ``endpoints`` say so (else 400
``unsupported_endpoint``, before any charge).
"""
from flask import Blueprint, current_app, g, request

from ..dialects import CODECS
from ..errors import Forbidden
from ..flow.life import respond
from ..ops import lifecycle
from .auth import require_key
from .bodies import never_drained, read_body

bp = Blueprint("legacy", __name__)
bp.after_request(never_drained)


def _generate(codec):
    services = current_app.extensions["kiln"]
    body, body_bytes = read_body(services, current_app.extensions["kiln.parse_budget"],
                                 codec.name)
    parsed = codec.parse(body, services.catalog, body_bytes)
    if not g.principal.may_use(parsed.entry.id):
        raise Forbidden(f"This API key may not use model '{parsed.entry.id}'.", param="model",
                        code="model_not_allowed")
    lifecycle.check_maintenance()
    return respond(services, g.principal, parsed, codec, request.environ)


@bp.post("/completions")
@require_key
def completions():
    """Create a text completion from raw prompts, metered and billed; JSON or an SSE
    stream."""
    return _generate(CODECS["completions"])


@bp.post("/embeddings")
@require_key
def embeddings():
    """Create embeddings of the inputs, billed on their tokens; JSON only."""
    return _generate(CODECS["embeddings"])
