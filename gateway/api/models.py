"""``GET /v1/models``: the public part of the model catalog (:mod:`gateway.contract.catalog`)."""
from flask import Blueprint, current_app, jsonify

from .auth import require_key

bp = Blueprint("models", __name__)


@bp.get("/models")
@require_key
def list_models():
    """List the public models of the catalog (OpenAI list shape)."""
    catalog = current_app.extensions["kiln.catalog"]
    return jsonify({"object": "list", "data": [m.public() for m in catalog.values()]})
