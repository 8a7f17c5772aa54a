"""Reconciliation: every cent accounted for (``kiln credits reconcile``).

Per org, from one consistent snapshot (the ledger's reads, :mod:`gateway.ledger.operator`):

- ``balance = Σ grants − Σ usage costs`` (grants converted exactly as their trigger does);
- the balance covers the open holds;
- the held amount and the in-flight count equal the sum of the lease holds and the number of
  lease rows;
- no lease has expired unswept (its worker died and nothing closed it yet);
- every pending usage event has a lease (else nothing would ever settle it), and no settled
  one keeps a lease;
- the daily rollup (``GET /v1/activity``) counts every settled event and sums their costs.

Per key: its held amount equals its leases' key holds, and its spend in the current period
equals the cost of its events settled in that period.

Holds and leases of requests running right now are fine; at a quiet moment there are none.
"""
from dataclasses import dataclass

from ..billing import format_usd, from_nanos
from ..db import utcnow
from .operator import key_records, org_records


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
    """Check every org and key; return ``(rows, names of what is off)``.

    :returns: a list of :class:`OrgReconciliation` in org id order, and the names of the orgs
        (and ``key PREFIX`` entries) whose checks failed.
    """
    rows = [_row(r) for r in org_records(engine, utcnow())]
    off = [r.name for r in rows if r.verdict != "ok"]
    for key in key_records(engine):
        problems = _key_problems(key)
        if problems:
            off.append(f"key {key.prefix} of {key.org} ({'; '.join(problems)})")
    return rows, off


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


def _row(r):
    grants, costs = int(r.grants or 0), int(r.costs or 0)
    leases, held, expired = int(r.n or 0), int(r.held or 0), int(r.expired or 0)
    return OrgReconciliation(
        name=r.name, grants_usd=from_nanos(grants), costs_usd=from_nanos(costs),
        balance_usd=from_nanos(r.balance_nanos or 0), held_usd=from_nanos(r.held_nanos or 0),
        leases=leases, expired=expired,
        verdict="; ".join(_problems(r, grants - costs, leases, held, expired, costs)) or "ok")


def _problems(r, expected_balance, leases, held, expired, costs):
    if r.balance_nanos is None:
        return ["no credit balance row"]
    problems = []
    if r.balance_nanos != expected_balance:
        problems.append(f"balance off by {format_usd(r.balance_nanos - expected_balance)} USD")
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
    if int(r.daily_requests or 0) != int(r.settled or 0) or int(r.daily_costs or 0) != costs:
        problems.append("daily activity does not sum the usage events")
    return problems


def _key_problems(k):
    problems = []
    if k.held_nanos != int(k.lease_holds or 0):
        problems.append("held amount does not match its leases")
    off_nanos = k.period_spent_nanos - int(k.events_spent or 0)
    if off_nanos:
        problems.append(f"period spend off by {format_usd(off_nanos)} USD")
    return problems
