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
    """Answer 200 when the database answers, the catalog is loaded and no background greenlet
    (ledger writers, sweeper, prober, webhooks) is down, else 503 naming what is not."""
    services = current_app.extensions["kiln"]
    try:
        with services.engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except sa.exc.SQLAlchemyError as err:
        log.warning("readiness: database unreachable: %s", err)
        return jsonify({"status": "unavailable", "database": "unreachable"}), 503
    if not services.catalog:
        return jsonify({"status": "unavailable", "catalog": "empty"}), 503
    if services.background.down:  # a background greenlet failed and waits to run again
        return jsonify({"status": "unavailable",
                        "background": dict(services.background.down)}), 503
    return jsonify({"status": "ok", "models": len(services.catalog)})
