"""Reconciliation: every cent accounted for.

Per org: ``balance = Σ grants − Σ usage costs``; the held amount and in-flight count equal the
holds and number of lease rows; no lease has expired unswept; no settled event keeps a lease.
"""
from dataclasses import dataclass

import sqlalchemy as sa

from .billing import from_nanos
from .db import utcnow
from .models import credit_balances, credit_grants, in_flight, orgs, usage_events


@dataclass
class OrgReconciliation:
    name: str
    grants_usd: object
    costs_usd: object
    balance_usd: object
    held_usd: object
    leases: int
    expired: int
    verdict: str


def reconcile(engine):
    """Return ``(rows, names of orgs that are off)``; see the module docstring for the checks."""
    grants = (sa.select(credit_grants.c.org_id,
                        sa.func.sum(sa.cast(sa.func.round(credit_grants.c.amount_usd * 10 ** 9),
                                            sa.BigInteger)).label("nanos"))
              .group_by(credit_grants.c.org_id).subquery())
    costs = (sa.select(usage_events.c.org_id, sa.func.sum(usage_events.c.cost_nanos).label("nanos"))
             .group_by(usage_events.c.org_id).subquery())
    now = utcnow()
    leases = (sa.select(in_flight.c.org_id, sa.func.count().label("n"),
                        sa.func.sum(in_flight.c.hold_nanos).label("held"),
                        sa.func.sum(sa.case((in_flight.c.expires_at < now, 1), else_=0))
                        .label("expired"))
              .group_by(in_flight.c.org_id).subquery())
    query = (sa.select(orgs.c.name, credit_balances, grants.c.nanos.label("grants"),
                       costs.c.nanos.label("costs"), leases.c.n, leases.c.held, leases.c.expired)
             .join(credit_balances, credit_balances.c.org_id == orgs.c.id)
             .outerjoin(grants, grants.c.org_id == orgs.c.id)
             .outerjoin(costs, costs.c.org_id == orgs.c.id)
             .outerjoin(leases, leases.c.org_id == orgs.c.id).order_by(orgs.c.id))
    with engine.connect() as conn:
        records = conn.execute(query).all()
        stray = conn.execute(sa.select(sa.func.count()).select_from(in_flight).join(
            usage_events, usage_events.c.id == in_flight.c.generation_id)
            .where(usage_events.c.status != "pending")).scalar_one()
    rows = [_row(r) for r in records]
    off = [r.name for r in rows if r.verdict != "ok"]
    if stray:
        off.append(f"{stray} lease(s) of settled generations")
    return rows, off


def _row(r):
    grants, costs = int(r.grants or 0), int(r.costs or 0)
    leases, held, expired = int(r.n or 0), int(r.held or 0), int(r.expired or 0)
    problems = []
    if r.balance_nanos != grants - costs:
        problems.append("balance != grants - costs")
    if r.held_nanos != held or r.in_flight != leases:
        problems.append("holds/leases mismatch")
    if expired:
        problems.append("expired leases")
    return OrgReconciliation(
        name=r.name, grants_usd=from_nanos(grants), costs_usd=from_nanos(costs),
        balance_usd=from_nanos(r.balance_nanos), held_usd=from_nanos(r.held_nanos),
        leases=leases, expired=expired, verdict="; ".join(problems) or "ok")
