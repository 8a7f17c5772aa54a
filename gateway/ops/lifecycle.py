"""Operations around the requests: maintenance mode, the background sweeper, draining and ending
a worker's generations at shutdown.

Maintenance mode is a row in the ``maintenance`` table (``kiln maintenance on|off``); every
worker re-reads it every ``KILN_MAINTENANCE_POLL_S`` seconds, so it takes effect within
seconds without a restart. While on, chat requests get 503 with ``Retry-After``.
"""
import logging
import time

import gevent
import sqlalchemy as sa
from flask import current_app

from ..db import utcnow
from ..errors import ServiceUnavailable, ShuttingDown
from ..ledger import responses as stored_responses
from ..models import maintenance

log = logging.getLogger(__name__)


def read_maintenance(engine):
    """Return ``(enabled, retry_after_s, message)`` from the database."""
    with engine.connect() as conn:
        row = conn.execute(sa.select(maintenance).where(maintenance.c.id == 1)).first()
    if row is None:
        return False, 0, None
    return row.enabled, row.retry_after_s, row.message


def set_maintenance(engine, enabled, retry_after_s=300, message=None):
    """Switch maintenance mode for every worker of every gateway host on this database."""
    values = {"enabled": enabled, "retry_after_s": retry_after_s, "message": message,
              "updated_at": utcnow()}
    with engine.begin() as conn:
        if conn.execute(maintenance.update().where(maintenance.c.id == 1)
                        .values(**values)).rowcount == 0:
            conn.execute(maintenance.insert().values(id=1, **values))


def check_maintenance():
    """Raise 503 with ``Retry-After`` while maintenance mode is on (cached per process).

    :raises ServiceUnavailable: maintenance mode is on.
    """
    services = current_app.extensions["kiln"]
    cache = current_app.extensions["kiln.maintenance"]
    now = time.monotonic()
    if "state" not in cache or now >= cache["until"]:
        # One refresh at a time: the requests arriving meanwhile keep the last state, instead
        # of each reading the row (a burst of reads every poll under load).
        cache["until"] = now + services.config.maintenance_poll_s
        cache["state"] = read_maintenance(services.engine)
    enabled, retry_after_s, message = cache["state"]
    if enabled:
        raise ServiceUnavailable(message or "Kiln is in maintenance; retry after the delay in "
                                 "the Retry-After header.", code="maintenance",
                                 headers={"Retry-After": str(retry_after_s)})


def start_sweeper(app):
    """Start this process's sweeper greenlet (once): it closes generations whose lease expired
    because the worker serving them died."""
    state = app.extensions["kiln.maintenance"]
    if state.get("sweeper") is not None or app.config["KILN"].sweep_interval_s <= 0:
        return
    services = app.extensions["kiln"]
    state["sweeper"] = services.background.spawn("sweeper", _sweep_forever, services)


def _sweep_forever(services):
    while True:
        gevent.sleep(services.config.sweep_interval_s)
        try:
            services.ledger.sweep()
            stored_responses.sweep_expired(services.engine)  # past their retention
        except sa.exc.SQLAlchemyError:
            log.exception("sweep failed; retrying next interval")


def drain(app):
    """Wait for this process's queued settlements, then its stored responses, to commit
    (graceful shutdown: gunicorn's ``worker_exit``); return whether the settlements all did
    within ``KILN_SETTLE_DRAIN_S`` (the responses get as long again). An app that is not
    Kiln's (served under the same gunicorn config), or a worker that failed to boot, has none
    to wait for."""
    services = getattr(app, "extensions", {}).get("kiln")
    if services is None:
        return True
    done = services.ledger.drain(services.config.settle_drain_s)
    if not done:
        log.error("settlements still queued at exit; their leases expire and the sweeper "
                  "bills the progress they recorded")
    writer = app.extensions.get("kiln.responses_writer")
    if writer is not None and not writer.drain(services.config.settle_drain_s):
        log.error("stored responses still queued at exit are not saved")
    return done


def shutdown_deadline_s(graceful_timeout_s):
    """Return how long after a graceful stop begins a worker ends its running generations:
    a few seconds before gunicorn's ``graceful_timeout``, when the master kills it, so that
    their settlements commit first (at least half the timeout)."""
    return max(graceful_timeout_s - 3.0, graceful_timeout_s / 2)


def end_generations(app):
    """End every generation still running in this worker with :class:`ShuttingDown`: each is
    told (an SSE error event, or a 503), billed what was generated and settled, instead of being
    killed unsettled at the graceful timeout. Return how many were ended."""
    services = getattr(app, "extensions", {}).get("kiln")
    live = list(services.live) if services is not None else []
    if live:
        log.warning("graceful timeout near: ending %d running generation(s)", len(live))
    for exchange in live:
        exchange.interrupt(ShuttingDown())
    return len(live)
