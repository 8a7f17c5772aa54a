"""Reconciliation: every cent accounted for (``kiln credits reconcile``).

Per org, from one consistent snapshot (one statement):

- ``balance = Σ grants − Σ usage costs`` (grants converted exactly as their trigger does);
- the balance covers the open holds;
- the held amount and the in-flight count equal the sum of the lease holds and the number of
  lease rows;
- no lease has expired unswept (its worker died and nothing closed it yet);
- every pending usage event has a lease (else nothing would ever settle it), and no settled
  one keeps a lease.

Holds and leases of requests running right now are fine; at a quiet moment there are none.
"""
from dataclasses import dataclass

import sqlalchemy as sa

from .billing import from_nanos
from .db import utcnow
from .models import credit_balances, credit_grants, in_flight, orgs, usage_events


@dataclass
class OrgReconciliation:
    """One org's line: amounts in Decimal USD, counts, and ``verdict`` ("ok" or problems)."""

    name: str
    grants_usd: object
    costs_usd: object
    balance_usd: object
    held_usd: object
    leases: int
    expired: int
    verdict: str


def reconcile(engine):
    """Check every org; return ``(rows, names of the orgs that are off)``.

    :returns: a list of :class:`OrgReconciliation` in org id order, and the names of the orgs
        whose verdict is not "ok".
    """
    with engine.connect() as conn:
        records = conn.execute(_query(utcnow())).all()
    rows = [_row(r) for r in records]
    return rows, [r.name for r in rows if r.verdict != "ok"]


def format_table(rows):
    """Return the text table of ``rows`` (:class:`OrgReconciliation`): a header line, then one
    line per org, USD amounts in plain decimal notation."""
    lines = [f"{'org':<24} {'grants_usd':>18} {'costs_usd':>18} {'balance_usd':>18} "
             f"{'held_usd':>14} {'leases':>6} {'expired':>7}  status"]
    for r in rows:
        amounts = (format(v, "f") for v in (r.grants_usd, r.costs_usd, r.balance_usd,
                                             r.held_usd))
        lines.append("{:<24} {:>18} {:>18} {:>18} {:>14} ".format(r.name, *amounts)
                     + f"{r.leases:>6} {r.expired:>7}  {r.verdict}")
    return "\n".join(lines)


def _query(now):
    grants = _per_org(credit_grants, nanos=sa.func.sum(sa.cast(
        sa.func.round(credit_grants.c.amount_usd * 10 ** 9), sa.BigInteger)))
    costs = _per_org(usage_events, nanos=sa.func.sum(usage_events.c.cost_nanos))
    leases = _per_org(in_flight, n=sa.func.count(), held=sa.func.sum(in_flight.c.hold_nanos),
                      expired=_count_if(in_flight.c.expires_at < now))
    lease_exists = sa.exists().where(in_flight.c.generation_id == usage_events.c.id)
    pending = usage_events.c.status == "pending"
    stuck = _per_org(usage_events, unleased=_count_if(pending & ~lease_exists),
                     settled_leased=_count_if(~pending & lease_exists),
                     where=pending | lease_exists)
    bal = credit_balances.c
    return (sa.select(orgs.c.name, bal.balance_nanos, bal.held_nanos, bal.in_flight,
                      grants.c.nanos.label("grants"), costs.c.nanos.label("costs"),
                      leases.c.n, leases.c.held, leases.c.expired, stuck.c.unleased,
                      stuck.c.settled_leased)
            .select_from(orgs)
            .outerjoin(credit_balances, bal.org_id == orgs.c.id)
            .outerjoin(grants, grants.c.org_id == orgs.c.id)
            .outerjoin(costs, costs.c.org_id == orgs.c.id)
            .outerjoin(leases, leases.c.org_id == orgs.c.id)
            .outerjoin(stuck, stuck.c.org_id == orgs.c.id)
            .order_by(orgs.c.id))


def _per_org(table, where=None, **columns):
    query = sa.select(table.c.org_id, *(c.label(k) for k, c in columns.items()))
    if where is not None:
        query = query.where(where)
    return query.group_by(table.c.org_id).subquery()


def _count_if(condition):
    return sa.func.sum(sa.case((condition, 1), else_=0))


def _row(r):
    grants, costs = int(r.grants or 0), int(r.costs or 0)
    leases, held, expired = int(r.n or 0), int(r.held or 0), int(r.expired or 0)
    balance = r.balance_nanos
    return OrgReconciliation(
        name=r.name, grants_usd=from_nanos(grants), costs_usd=from_nanos(costs),
        balance_usd=from_nanos(balance or 0), held_usd=from_nanos(r.held_nanos or 0),
        leases=leases, expired=expired, verdict="; ".join(_problems(r, grants - costs, leases,
                                                                    held, expired)) or "ok")


def _problems(r, expected_balance, leases, held, expired):
    if r.balance_nanos is None:
        return ["no credit balance row"]
    problems = []
    if r.balance_nanos != expected_balance:
        off_usd = format(from_nanos(r.balance_nanos - expected_balance), "f")
        problems.append(f"balance off by {off_usd} USD")
    if r.balance_nanos < r.held_nanos:
        problems.append("balance below open holds")
    if r.held_nanos != held or r.in_flight != leases:
        problems.append("holds/leases mismatch")
    if expired:
        problems.append(f"{expired} expired lease(s)")
    if r.unleased:
        problems.append(f"{r.unleased} pending event(s) without lease")
    if r.settled_leased:
        problems.append(f"{r.settled_leased} settled event(s) with a lease")
    return problems
