"""``POST /v1/completions`` and ``POST /v1/embeddings``, the views: read the body, parse it
with the endpoint's codec, hand it to the flow, as chat completions' view does
(:mod:`gateway.api.chat`).

README "API" and docs/PARAMETERS.md ("Completions", "Embeddings") are the contract; a model
serves an endpoint only when its catalog ``endpoints`` say so (else 400
``unsupported_endpoint``, before any charge).
"""
from flask import Blueprint

from ..dialects import CODECS
from .auth import require_key
from .bodies import never_drained
from .generate import generate

bp = Blueprint("legacy", __name__)
bp.after_request(never_drained)


@bp.post("/completions")
@require_key
def completions():
    """Create a text completion from raw prompts, metered and billed; JSON or an SSE
    stream."""
    return generate(CODECS["completions"])


@bp.post("/embeddings")
@require_key
def embeddings():
    """Create embeddings of the inputs, billed on their tokens; JSON only."""
    return generate(CODECS["embeddings"])
