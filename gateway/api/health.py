"""Liveness and readiness probes (``GET /healthz``, ``GET /readyz``), without a key."""
import logging

import sqlalchemy as sa
from flask import Blueprint, current_app, jsonify

log = logging.getLogger(__name__)
bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz():
    """Answer 200 while the process is alive."""
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz():
    """Answer 200 when the database answers and the catalog is loaded, else 503."""
    services = current_app.extensions["kiln"]
    try:
        with services.engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except sa.exc.SQLAlchemyError as err:
        log.warning("readiness: database unreachable: %s", err)
        return jsonify({"status": "unavailable", "database": "unreachable"}), 503
    if not services.catalog:
        return jsonify({"status": "unavailable", "catalog": "empty"}), 503
    return jsonify({"status": "ok", "models": len(services.catalog)})
