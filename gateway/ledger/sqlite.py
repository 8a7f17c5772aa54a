"""The ledger on SQLite (the embedded database of ``make run``): the same statements as the
Postgres functions, in short transactions. SQLite runs one writer at a time, so the order of
row locks is the order of statements.
"""
import json
from datetime import datetime, timedelta, timezone

import sqlalchemy as sa

from ..db import utcnow
from ..models import api_keys, credit_balances, in_flight, usage_daily, usage_events
from ..endings import Status

NANOS = 10 ** 9
# Settled statuses that are not errors in the activity rollup (docs/ACTIVITY.md, "What a row
# counts"): the generation completed, its client chose to stop it, or the operator stopped its
# worker (a shutdown or reload that outlasted the graceful timeout).
NOT_ERRORS = (Status.COMPLETED.value, Status.CLIENT_CANCELLED.value, Status.INTERRUPTED.value)


def period_start(reset, at):
    """Return the start of the UTC day, ISO week or month holding ``at`` (None: never resets)."""
    at = at.astimezone(timezone.utc)
    day = datetime(at.year, at.month, at.day, tzinfo=timezone.utc)
    if reset == "daily":
        return day
    if reset == "weekly":
        return day - timedelta(days=at.weekday())
    if reset == "monthly":
        return day.replace(day=1)
    return None


def _aware(ts):
    return ts if ts is None or ts.tzinfo else ts.replace(tzinfo=timezone.utc)


class SqliteStore:
    """The ledger's statements on SQLite."""

    def __init__(self, engine):
        self.engine = engine

    def admit_once(self, a):
        now = utcnow()
        bal = credit_balances.c
        with self.engine.begin() as conn:
            admitted = conn.execute(
                credit_balances.update()
                .where(bal.org_id == a.org_id, bal.in_flight < a.in_flight_limit,
                       bal.balance_nanos - bal.held_nanos >= a.hold_nanos)
                .values(in_flight=bal.in_flight + 1, held_nanos=bal.held_nanos + a.hold_nanos)
            ).rowcount == 1
            if not admitted:
                return self._rejection(conn, a, now)
            refused = self._key_checks(conn, a, now) if a.key_checks else None
            if refused is not None:
                conn.execute(credit_balances.update().where(bal.org_id == a.org_id).values(
                    in_flight=bal.in_flight - 1, held_nanos=bal.held_nanos - a.hold_nanos))
                return refused
            conn.execute(usage_events.insert().values(
                id=a.gid, org_id=a.org_id, api_key_id=a.key_id, model=a.model, stream=a.stream,
                status=Status.PENDING.value, hold_nanos=a.hold_nanos, started_at=now,
                endpoint=a.endpoint))
            conn.execute(in_flight.insert().values(
                generation_id=a.gid, org_id=a.org_id, hold_nanos=a.hold_nanos,
                key_hold_nanos=a.hold_nanos if a.key_checks else 0,
                expires_at=now + timedelta(seconds=a.lease_ttl_s), api_key_id=a.key_id))
        return _row(gid=a.gid, started_at=now)

    def admit_batch(self, requests):
        """Admit each of ``requests`` in turn (SQLite runs one writer at a time)."""
        return [self.admit_once(a) for a in requests]

    def _rejection(self, conn, a, now):
        bal = credit_balances.c
        row = conn.execute(sa.select(bal.balance_nanos - bal.held_nanos, bal.in_flight)
                           .where(bal.org_id == a.org_id)).first()
        if row is None:
            return None
        available, count = row
        expired = conn.execute(sa.select(sa.exists().where(
            in_flight.c.org_id == a.org_id, in_flight.c.expires_at < now))).scalar()
        reason = ("in_flight" if count >= a.in_flight_limit
                  else "credits" if available < a.hold_nanos else "retry")
        return _row(reason=reason, available=available, in_flight=count, expired=bool(expired))

    def _key_checks(self, conn, a, now):
        k = conn.execute(sa.select(api_keys).where(api_keys.c.id == a.key_id)).first()
        period = period_start(k.limit_reset, now)
        spent = 0 if _aware(k.period_start) != period else k.period_spent_nanos
        limit = None if k.limit_usd is None else int(round(k.limit_usd * NANOS))
        minute = now.replace(second=0, microsecond=0)
        rate = k.rate_count if _aware(k.rate_window) == minute else 0
        refused = self._key_in_flight(conn, k, now)
        if refused is not None:
            return refused
        if k.rpm_limit is not None and rate >= k.rpm_limit:
            return _row(reason="rate", key_remaining=None, period_start=period)
        if limit is not None and spent + k.held_nanos + a.hold_nanos > limit:
            return _row(reason="key_limit", key_remaining=limit - spent - k.held_nanos,
                        period_start=period)
        conn.execute(api_keys.update().where(api_keys.c.id == a.key_id).values(
            period_start=period, period_spent_nanos=spent,
            held_nanos=api_keys.c.held_nanos + a.hold_nanos, rate_window=minute,
            rate_count=rate + 1))
        return None

    def _key_in_flight(self, conn, k, now):
        """Refuse when the key's lease rows reach its in-flight cap (as ``kiln_admit``)."""
        if k.in_flight_limit is None:
            return None
        f = in_flight.c
        leases, expired = conn.execute(sa.select(
            sa.func.count(), sa.func.coalesce(sa.func.max(
                sa.case((f.expires_at < now, 1), else_=0)), 0))
            .where(f.api_key_id == k.id)).one()
        if leases < k.in_flight_limit:
            return None
        return _row(reason="key_in_flight", in_flight=leases, expired=bool(expired))

    def settle_batch(self, settlements):
        debited = {}
        with self.engine.begin() as conn:
            for s in sorted(settlements, key=lambda s: s.gid):
                cost = self._settle_one(conn, s)
                if cost is not None:
                    debited[s.gid] = cost
        return debited

    def _settle_one(self, conn, s):
        """Settle one generation (see ``kiln_settle``: pending ones, and abandoned ones whose
        worker's real settlement arrives late, which it corrects)."""
        ev, now = usage_events.c, utcnow()
        event = self._event(conn, s)
        if event is None or not self._settles(conn, s, event):
            return None
        fix = event.status == Status.ABANDONED
        was = {k: getattr(event, k) if fix else 0
               for k in ("cost_nanos", "prompt_tokens", "cached_tokens", "completion_tokens")}
        bal = credit_balances.c
        free = conn.execute(sa.select(bal.balance_nanos - bal.held_nanos)
                            .where(bal.org_id == s.org_id)).scalar()
        base = event.cost_nanos if fix else event.hold_nanos
        key_free = self._key_free(conn, s.key_id, now)
        debit = min(s.cost_nanos, base + max(0, free if key_free is None
                                               else min(free, key_free)))
        u = s.usage
        conn.execute(usage_events.update().where(ev.id == s.gid).values(
            status=s.status, prompt_tokens=u.prompt, cached_tokens=u.cached,
            completion_tokens=u.completion, cost_nanos=debit, estimated=u.estimated,
            prompt_counted_by=u.prompt_by, completion_counted_by=u.completion_by,
            http_status=s.http_status, error=s.error, error_code=s.error_code,
            backend=sa.func.coalesce(s.backend, ev.backend),
            attempts=sa.func.coalesce(json.dumps(s.attempts) if s.attempts else None,
                                      ev.attempts),
            anomaly=bool(s.anomaly or debit < s.cost_nanos),
            first_token_at=sa.func.coalesce(s.first_token_at, ev.first_token_at),
            ended_at=now))
        lease = conn.execute(sa.select(in_flight)
                             .where(in_flight.c.generation_id == s.gid)).first()
        held, leases, key_hold = 0, 0, 0
        if lease is not None:
            conn.execute(in_flight.delete().where(in_flight.c.generation_id == s.gid))
            held, leases, key_hold = lease.hold_nanos, 1, lease.key_hold_nanos
        conn.execute(credit_balances.update().where(bal.org_id == s.org_id).values(
            balance_nanos=bal.balance_nanos - (debit - was["cost_nanos"]),
            held_nanos=bal.held_nanos - held, in_flight=bal.in_flight - leases))
        self._key_usage(conn, s.key_id, debit - was["cost_nanos"], key_hold, now)
        self._daily(conn, s, _aware(event.started_at), debit, was, fix, event.endpoint)
        return debit

    def _event(self, conn, s):
        ev = usage_events.c
        columns = (ev.status, ev.hold_nanos, ev.started_at, ev.cost_nanos, ev.prompt_tokens,
                   ev.cached_tokens, ev.completion_tokens, ev.endpoint)
        event = conn.execute(sa.select(*columns).where(ev.id == s.gid)).first()
        if event is None and s.expired_before is None:  # an admission lost in a crash
            conn.execute(usage_events.insert().values(
                id=s.gid, org_id=s.org_id, api_key_id=s.key_id, model=s.model, stream=s.stream,
                status=Status.PENDING.value, hold_nanos=0, started_at=s.started_at or utcnow()))
            event = conn.execute(sa.select(*columns).where(ev.id == s.gid)).first()
        return event

    def _settles(self, conn, s, event):
        if s.expired_before is None:
            return event.status in (Status.PENDING, Status.ABANDONED)
        if event.status != Status.PENDING:
            return False
        lease = conn.execute(sa.select(in_flight.c.expires_at)
                             .where(in_flight.c.generation_id == s.gid)).first()
        return lease is not None and _aware(lease.expires_at) < s.expired_before

    def _key_free(self, conn, key_id, now):
        """What the key's spend limit leaves beyond its spend this period and its holds
        (nano-dollars), or None when it has no limit: a cost above the hold takes no more."""
        k = conn.execute(sa.select(api_keys).where(api_keys.c.id == key_id)).first()
        if k is None or k.limit_usd is None:
            return None
        spent = 0 if _aware(k.period_start) != period_start(k.limit_reset, now) \
            else k.period_spent_nanos
        return int(round(k.limit_usd * NANOS)) - spent - k.held_nanos

    def _key_usage(self, conn, key_id, debit, key_hold, now):
        k = conn.execute(sa.select(api_keys).where(api_keys.c.id == key_id)).first()
        period = period_start(k.limit_reset, now)
        spent = debit if _aware(k.period_start) != period else k.period_spent_nanos + debit
        conn.execute(api_keys.update().where(api_keys.c.id == key_id).values(
            period_start=period, period_spent_nanos=spent, held_nanos=k.held_nanos - key_hold))

    def _daily(self, conn, s, began, debit, was, fix, endpoint):
        d = usage_daily.c
        key = {"org_id": s.org_id, "day": began.astimezone(timezone.utc).date(),
               "model": s.model, "api_key_id": s.key_id, "endpoint": endpoint}
        u = s.usage
        add = {"requests": int(not fix), "errors": int(s.status not in NOT_ERRORS) - int(fix),
               "prompt_tokens": u.prompt - was["prompt_tokens"],
               "cached_tokens": u.cached - was["cached_tokens"],
               "completion_tokens": u.completion - was["completion_tokens"],
               "cost_nanos": debit - was["cost_nanos"]}
        changed = conn.execute(usage_daily.update().where(*(d[k] == v for k, v in key.items()))
                               .values(**{k: d[k] + v for k, v in add.items()})).rowcount
        if not changed:
            conn.execute(usage_daily.insert().values(**key, **add))

    def renew(self, leases, lease_ttl_s):
        now, states = utcnow(), {}
        with self.engine.begin() as conn:
            for gid, usage in leases:
                status = conn.execute(sa.select(usage_events.c.status)
                                      .where(usage_events.c.id == gid)).scalar()
                if status != Status.PENDING:
                    states[gid] = "missing" if status is None else "settled"
                    continue
                if usage is not None:
                    conn.execute(usage_events.update().where(usage_events.c.id == gid).values(
                        prompt_tokens=usage.prompt, cached_tokens=usage.cached,
                        completion_tokens=usage.completion, estimated=True))
                conn.execute(in_flight.update().where(in_flight.c.generation_id == gid)
                             .values(expires_at=now + timedelta(seconds=lease_ttl_s)))
                states[gid] = "leased"
        return states

    def expired(self, org_id, limit):
        now, ev = utcnow(), usage_events.c
        query = (sa.select(in_flight.c.generation_id.label("gid"), ev.org_id.label("org"),
                           ev.api_key_id.label("key"), ev.model, ev.stream, ev.prompt_tokens,
                           ev.cached_tokens, ev.completion_tokens, ev.started_at)
                 .join(usage_events, ev.id == in_flight.c.generation_id)
                 .where(in_flight.c.expires_at < now).limit(limit))
        if org_id is not None:
            query = query.where(in_flight.c.org_id == org_id)
        with self.engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        return [{**r, "cutoff": now} for r in rows]


def _row(gid=None, started_at=None, reason=None, available=None, in_flight=None,
         expired=False, key_remaining=None, period_start=None):
    """A row shaped like the Postgres ``kiln_admit`` result."""
    return (gid, started_at, reason, available, in_flight, expired, key_remaining, period_start)
