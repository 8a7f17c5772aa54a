"""``GET /v1/models``: the public part of the model catalog (:mod:`gateway.contract.catalog`)
that the calling key may use."""
from flask import Blueprint, current_app, g, jsonify

from .auth import require_key

bp = Blueprint("models", __name__)


@bp.get("/models")
@require_key
def list_models():
    """List the catalog's models the calling key may use (OpenAI list shape): all of them, or
    those of the key's allow-list (``kiln key create --models``); a model it may not use is
    refused at generation (403), so it is not offered here."""
    catalog = current_app.extensions["kiln.catalog"]
    return jsonify({"object": "list", "data": [m.public() for m in catalog.values()
                                               if g.principal.may_use(m.id)]})
