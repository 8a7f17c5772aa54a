"""In-flight leases: renewal by live streams, and the sweeper that closes leases left behind.

A lease is taken at admission (:func:`gateway.billing.admit`) and released at settlement. A
worker killed with SIGKILL (or OOM, or power loss) cannot settle: its leases stop being renewed,
and once expired the sweeper settles their usage events as ``abandoned``, billing the tokens
the stream had reported at its last renewal.
"""
import logging
from datetime import timedelta

import sqlalchemy as sa

from . import billing
from .billing import Outcome, Usage, cost_usd, settle, to_nanos
from .db import utcnow
from .errors import RateLimited
from .models import in_flight, usage_events

log = logging.getLogger(__name__)


def renew(engine, gid, lease_ttl_s, usage=None):
    """Push the lease of ``gid`` ``lease_ttl_s`` seconds ahead; record progress so far.

    :param usage: :class:`gateway.billing.Usage` produced so far, kept on the pending event so
        that the sweeper can bill it if this worker dies.
    :returns: whether the lease still existed.
    """
    with engine.begin() as conn:
        renewed = conn.execute(
            in_flight.update().where(in_flight.c.generation_id == gid)
            .values(expires_at=utcnow() + timedelta(seconds=lease_ttl_s))).rowcount == 1
        if renewed and usage is not None:
            conn.execute(usage_events.update()
                         .where(usage_events.c.id == gid, usage_events.c.status == "pending")
                         .values(prompt_tokens=usage.prompt, cached_tokens=usage.cached,
                                 completion_tokens=usage.completion, estimated=True))
    return renewed


def sweep_expired(engine, catalog, org_id=None, batch=200):
    """Settle the usage events whose lease expired; return how many were closed.

    :param catalog: ``{model id: ModelEntry}`` to price the progress recorded by renewals.
    :param org_id: only this org's leases (admission's inline reclaim), or every org.
    """
    query = (sa.select(in_flight.c.generation_id, usage_events.c.model,
                       usage_events.c.prompt_tokens, usage_events.c.cached_tokens,
                       usage_events.c.completion_tokens)
             .join(usage_events, usage_events.c.id == in_flight.c.generation_id)
             .where(in_flight.c.expires_at < utcnow()).limit(batch))
    if org_id is not None:
        query = query.where(in_flight.c.org_id == org_id)
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    closed = 0
    for row in rows:
        usage = Usage(prompt=row.prompt_tokens, cached=row.cached_tokens,
                      completion=row.completion_tokens, estimated=True)
        entry = catalog.get(row.model)
        cost = to_nanos(cost_usd(usage, entry.pricing)) if entry else 0
        outcome = Outcome(status="abandoned", usage=usage, cost_nanos=cost,
                          error="lease expired: the worker serving this request was lost")
        if settle(engine, row.generation_id, outcome) is not None:
            closed += 1
    if closed:
        log.warning("sweeper closed %d abandoned generation(s)", closed)
    return closed


def admit(engine, catalog, principal, model_id, stream, hold_nanos, lease_ttl_s):
    """Admit one request (:func:`gateway.billing.admit`), reclaiming expired leases first if the
    org looks full, so that slots held by a dead worker come back without waiting for a sweep.

    :returns: the generation id.
    :raises RateLimited: 429, the org is at its in-flight limit.
    :raises InsufficientCredits: 402, the hold is not covered.
    """
    try:
        return billing.admit(engine, principal, model_id, stream, hold_nanos, lease_ttl_s)
    except RateLimited:
        if not sweep_expired(engine, catalog, org_id=principal.org_id):
            raise
    return billing.admit(engine, principal, model_id, stream, hold_nanos, lease_ttl_s)
