"""In-flight leases: admission with reclaim, renewal by live requests, and the sweeper.

A lease is taken at admission (:func:`gateway.billing.try_admit`) and released at settlement.
While a request runs, its generation renews the lease every third of ``KILN_LEASE_TTL_S`` (a
greenlet from admission to settlement, :class:`gateway.relay.Generation`), recording the
tokens relayed so far (:func:`renew`). A worker killed with SIGKILL (or OOM, or power loss)
cannot settle: its leases stop being renewed, and once expired they stop counting. Admission
reclaims an org's expired leases before it rejects, and the sweeper (every
``KILN_SWEEP_INTERVAL_S`` in each worker, or ``kiln sweep``) settles their usage events as
``abandoned``, billing the recorded progress.

Expiry is judged on each gateway host's clock (``expires_at`` is written from it too); hosts
are assumed NTP-synchronised to well under a TTL.
"""
import logging
from datetime import timedelta

import sqlalchemy as sa

from . import billing
from .billing import Outcome, Usage, autocommit, cost_usd, settle, to_nanos
from .db import is_postgres, utcnow
from .errors import RateLimited
from .models import in_flight, usage_events

log = logging.getLogger(__name__)

ADMIT_ATTEMPTS = 3
ABANDONED_ERROR = "lease expired: the worker serving this request was lost"


def admit(engine, catalog, principal, model_id, stream, hold_nanos, lease_ttl_s):
    """Admit one request; return its generation id.

    A rejected attempt that saw expired leases of the org (a dead worker's) reclaims them and
    tries again, so their slots and holds come back at expiry without waiting for a sweep.

    :param hold_nanos: the request's hold, integer nano-dollars.
    :raises RateLimited: 429, the org is at its in-flight limit.
    :raises InsufficientCredits: 402, the org's available credits do not cover the hold.
    """
    reclaimed = False
    for _ in range(ADMIT_ATTEMPTS):
        seen = billing.try_admit(engine, principal, model_id, stream, hold_nanos, lease_ttl_s)
        if seen.gid is not None:
            return seen.gid
        if seen.expired_leases and not reclaimed:
            reclaimed = True
            sweep_expired(engine, catalog, org_id=principal.org_id)
            continue
        error = billing.rejection(seen, principal, hold_nanos)
        if error is not None:
            raise error
    # Every attempt saw room in a snapshot taken before the row lock was granted: decide on the
    # row as it is now, so an org out of credits is told 402, not 429.
    error = billing.rejection(billing.current_state(engine, principal.org_id), principal,
                             hold_nanos)
    raise error or RateLimited("Too many concurrent admissions for this organization. Retry "
                               "with backoff.")


# Event first, then lease: the lock order of settlement (see gateway.billing).
_PG_RENEW = sa.text("""
WITH event AS (
  UPDATE usage_events
     SET prompt_tokens = :prompt, cached_tokens = :cached, completion_tokens = :completion,
         estimated = TRUE
   WHERE id = :gid AND status = 'pending' AND :progress
  RETURNING id
)
UPDATE in_flight SET expires_at = :expires
 WHERE generation_id = :gid AND (SELECT count(*) FROM event) >= 0
RETURNING generation_id
""")


def renew(engine, gid, lease_ttl_s, usage=None):
    """Push the lease of ``gid`` ``lease_ttl_s`` seconds ahead; record progress so far.

    :param usage: :class:`gateway.billing.Usage` produced so far, kept on the pending event so
        that the sweeper can bill it if this worker dies; None keeps what was recorded.
    :returns: whether the lease still existed.
    """
    u = usage or Usage()
    params = {"gid": gid, "expires": utcnow() + timedelta(seconds=lease_ttl_s),
              "progress": usage is not None, "prompt": u.prompt, "cached": u.cached,
              "completion": u.completion}
    if is_postgres(engine):
        with autocommit(engine) as conn:
            return conn.execute(_PG_RENEW, params).first() is not None
    with engine.begin() as conn:
        if usage is not None:
            conn.execute(usage_events.update()
                         .where(usage_events.c.id == gid, usage_events.c.status == "pending")
                         .values(prompt_tokens=u.prompt, cached_tokens=u.cached,
                                 completion_tokens=u.completion, estimated=True))
        return conn.execute(in_flight.update().where(in_flight.c.generation_id == gid)
                            .values(expires_at=params["expires"])).rowcount == 1


def sweep_expired(engine, catalog, org_id=None, batch=200):
    """Settle the usage events whose lease expired as ``abandoned``; return how many.

    The recorded progress is billed (flagged estimated). A lease renewed between the look-up
    and its settlement is left alone (:func:`gateway.billing.settle`, ``expired_before``).

    :param catalog: ``{model id: ModelEntry}`` to price the recorded progress.
    :param org_id: only this org's leases (admission's reclaim), or every org.
    """
    cutoff = utcnow()
    query = (sa.select(in_flight.c.generation_id, usage_events.c.model,
                       usage_events.c.prompt_tokens, usage_events.c.cached_tokens,
                       usage_events.c.completion_tokens)
             .join(usage_events, usage_events.c.id == in_flight.c.generation_id)
             .where(in_flight.c.expires_at < cutoff).limit(batch))
    if org_id is not None:
        query = query.where(in_flight.c.org_id == org_id)
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    closed = sum(_abandon(engine, catalog, row, cutoff) for row in rows)
    if closed:
        log.warning("sweeper closed %d abandoned generation(s)", closed)
    return closed


def _abandon(engine, catalog, row, cutoff):
    usage = Usage(prompt=row.prompt_tokens, cached=row.cached_tokens,
                  completion=row.completion_tokens, estimated=True)
    entry = catalog.get(row.model)
    cost = to_nanos(cost_usd(usage, entry.pricing)) if entry else 0
    outcome = Outcome(status="abandoned", usage=usage, cost_nanos=cost, error=ABANDONED_ERROR)
    return settle(engine, row.generation_id, outcome, expired_before=cutoff) is not None
