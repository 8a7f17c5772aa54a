"""The ledger statements an operator's commands run: credit grants, and the reads of
``kiln credits reconcile`` (one consistent snapshot: one statement each).
"""
import sqlalchemy as sa

from ..billing import from_nanos
from ..models import (api_keys, credit_balances, credit_grants, in_flight, orgs, usage_daily,
                      usage_events)
from ..endings import Status

GRANT = sa.text("INSERT INTO credit_grants (org_id, amount_usd, note) "
                "VALUES (:org, CAST(:amount AS NUMERIC(20, 9)), :note)")


def grant(engine, org_id, amount_usd, note=None):
    """Add ``amount_usd`` (Decimal, may be negative) to the org's credits: the same plain
    INSERT an operator runs in psql; the table's trigger moves the balance.

    :raises sqlalchemy.exc.IntegrityError: the trigger refused it (the balance would fall below
        the holds of requests in flight).
    """
    with engine.begin() as conn:
        conn.execute(GRANT, {"org": org_id, "amount": str(amount_usd), "note": note})


def org_records(engine, now):
    """Return, per org, its balance row and what the other tables sum to: grants, event costs,
    leases (count, holds, expired), pending events without a lease and settled ones with one,
    and the daily rollup's requests and cost."""
    grants = _per_org(credit_grants, nanos=sa.func.sum(sa.cast(
        sa.func.round(credit_grants.c.amount_usd * 10 ** 9), sa.BigInteger)))
    settled = usage_events.c.status != Status.PENDING.value
    costs = _per_org(usage_events, nanos=sa.func.sum(usage_events.c.cost_nanos),
                     n=_count_if(settled))
    leases = _per_org(in_flight, n=sa.func.count(), held=sa.func.sum(in_flight.c.hold_nanos),
                      expired=_count_if(in_flight.c.expires_at < now))
    lease_exists = sa.exists().where(in_flight.c.generation_id == usage_events.c.id)
    stuck = _per_org(usage_events, unleased=_count_if(~settled & ~lease_exists),
                     settled_leased=_count_if(settled & lease_exists),
                     where=~settled | lease_exists)
    daily = _per_org(usage_daily, requests=sa.func.sum(usage_daily.c.requests),
                     nanos=sa.func.sum(usage_daily.c.cost_nanos))
    bal = credit_balances.c
    query = (sa.select(orgs.c.name, bal.balance_nanos, bal.held_nanos, bal.in_flight,
                       grants.c.nanos.label("grants"), costs.c.nanos.label("costs"),
                       costs.c.n.label("settled"), leases.c.n, leases.c.held, leases.c.expired,
                       stuck.c.unleased, stuck.c.settled_leased,
                       daily.c.requests.label("daily_requests"),
                       daily.c.nanos.label("daily_costs"))
             .select_from(orgs)
             .outerjoin(credit_balances, bal.org_id == orgs.c.id)
             .outerjoin(grants, grants.c.org_id == orgs.c.id)
             .outerjoin(costs, costs.c.org_id == orgs.c.id)
             .outerjoin(leases, leases.c.org_id == orgs.c.id)
             .outerjoin(stuck, stuck.c.org_id == orgs.c.id)
             .outerjoin(daily, daily.c.org_id == orgs.c.id)
             .order_by(orgs.c.id))
    with engine.connect() as conn:
        return conn.execute(query).all()


def key_records(engine):
    """Return, per key, its held amount, the key holds of its leases, its period spend and
    what its settled events in that period cost (or in all time when it never resets)."""
    ev, k = usage_events.c, api_keys.c
    key_holds = (sa.select(ev.api_key_id, sa.func.sum(in_flight.c.key_hold_nanos).label("held"))
                 .join(in_flight, in_flight.c.generation_id == ev.id)
                 .group_by(ev.api_key_id).subquery())
    in_period = sa.or_(k.period_start.is_(None), ev.ended_at >= k.period_start)
    spent = (sa.select(sa.func.coalesce(sa.func.sum(ev.cost_nanos), 0))
             .where(ev.api_key_id == k.id, ev.status != Status.PENDING.value, in_period)
             .scalar_subquery())
    query = (sa.select(k.prefix, orgs.c.name.label("org"), k.held_nanos, k.period_spent_nanos,
                       k.period_start, k.limit_reset, key_holds.c.held.label("lease_holds"),
                       spent.label("events_spent"))
             .join(orgs, orgs.c.id == k.org_id)
             .outerjoin(key_holds, key_holds.c.api_key_id == k.id)
             .order_by(k.id))
    with engine.connect() as conn:
        return conn.execute(query).all()


def _per_org(table, where=None, **columns):
    query = sa.select(table.c.org_id, *(c.label(k) for k, c in columns.items()))
    if where is not None:
        query = query.where(where)
    return query.group_by(table.c.org_id).subquery()


def _count_if(condition):
    return sa.func.sum(sa.case((condition, 1), else_=0))


def org_credits(engine, org_id):
    """Return ``{"balance_usd", "held_usd", "available_usd", "in_flight"}`` (Decimal USD)."""
    with engine.connect() as conn:
        row = conn.execute(sa.select(credit_balances)
                           .where(credit_balances.c.org_id == org_id)).first()
    balance, held = (row.balance_nanos, row.held_nanos) if row else (0, 0)
    return {"balance_usd": from_nanos(balance), "held_usd": from_nanos(held),
            "available_usd": from_nanos(balance - held), "in_flight": row.in_flight if row else 0}
