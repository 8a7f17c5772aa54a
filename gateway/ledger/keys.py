"""What a key holder and an operator see of keys: the rows and their public description that
``GET /v1/key`` and ``GET /v1/keys`` serve (the views are in :mod:`gateway.api.auth`, beside the key
check; never a secret), and the limit changes of ``kiln key``.

A key's spend limit counts what it spent in the current period (UTC day, ISO week, month, or
all time when it never resets) plus the holds of its requests in flight; admission enforces it
(:mod:`gateway.ledger`). The period's spend is kept on the key's row and moves with each
settlement; a period that has ended but not yet seen a request still shows its old spend in the
row, so the views here count it as 0.
"""
import hashlib
import secrets
from dataclasses import dataclass
from datetime import timezone
from decimal import Decimal

import sqlalchemy as sa

from ..billing import from_nanos, to_nanos
from ..db import utcnow
from . import next_period
from .sqlite import period_start
from ..models import api_keys, usage_events
from ..endings import Status

RESETS = ("daily", "weekly", "monthly")
_COLUMNS = (api_keys.c.id, api_keys.c.prefix, api_keys.c.name, api_keys.c.created_at,
            api_keys.c.revoked_at, api_keys.c.last_used_at, api_keys.c.limit_usd,
            api_keys.c.limit_reset, api_keys.c.period_start, api_keys.c.period_spent_nanos,
            api_keys.c.held_nanos, api_keys.c.rpm_limit, api_keys.c.org_read,
            api_keys.c.org_id, api_keys.c.allowed_models, api_keys.c.manage,
            api_keys.c.expires_at, api_keys.c.in_flight_limit, api_keys.c.previous_expires_at)


KEY_PREFIX = "kiln-"
PREFIX_LEN = 12  # "kiln-" plus 7 random characters: enough to tell keys apart in logs


def hash_key(key):
    """Return the hex SHA-256 of ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_secret():
    """Return a fresh key in clear: ``kiln-`` and 43 URL-safe characters (256 random bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def create_key(conn, org_id, name=None, allowed_models=None, org_read=None, **limits):
    """Create a key for ``org_id`` and return it in clear (the only time it exists in clear).

    :param allowed_models: iterable of public model ids, or None for every model.
    :param org_read: the key may read the org's other keys and org-wide activity; None: unless
        it is restricted (a model allow-list or a spend limit).
    :param limits: ``limit_usd`` (Decimal USD), ``limit_reset`` (``daily``, ``weekly``,
        ``monthly``), ``rpm_limit`` (requests per minute), ``in_flight_limit`` (requests at
        once), ``expires_at`` (aware datetime), ``manage`` (may manage the org's keys: the
        operator's to give); absent or None: no limit.
    """
    return create_key_row(conn, org_id, name, allowed_models, org_read, **limits)[1]


def create_key_row(conn, org_id, name=None, allowed_models=None, org_read=None, **limits):
    """Create a key as :func:`create_key` does; return ``(its id, the key in clear)``."""
    key = new_secret()
    if org_read is None:
        org_read = (not allowed_models and limits.get("limit_usd") is None) \
            or bool(limits.get("manage"))
    key_id = conn.execute(api_keys.insert().values(
        org_id=org_id, prefix=key[:PREFIX_LEN], key_hash=hash_key(key), name=name,
        allowed_models=models_column(allowed_models), org_read=org_read,
        **{k: v for k, v in limits.items() if v is not None}).returning(api_keys.c.id)
    ).scalar_one()
    return key_id, key


def models_column(allowed_models):
    """Return an allow-list as ``api_keys.allowed_models`` keeps it (None: every model)."""
    return " ".join(sorted(set(allowed_models))) if allowed_models else None


def revoke_key(conn, prefix):
    """Revoke the key with display ``prefix``; return whether one was revoked."""
    result = conn.execute(api_keys.update()
                          .where(api_keys.c.prefix == prefix, api_keys.c.revoked_at.is_(None))
                          .values(revoked_at=utcnow()))
    return result.rowcount == 1


@dataclass(frozen=True)
class KeyUsage:
    """A key's limits and what counts against them now (nano-dollars; None: no limit)."""

    limit_nanos: int
    spent_nanos: int
    held_nanos: int
    period_start: object
    resets_at: object

    @property
    def remaining_nanos(self):
        """What the key may still hold or spend in this period (never below 0), or None."""
        if self.limit_nanos is None:
            return None
        return max(self.limit_nanos - self.spent_nanos - self.held_nanos, 0)


def key_usage(row, now):
    """Return the :class:`KeyUsage` of an ``api_keys`` row at ``now`` (aware UTC)."""
    current = period_start(row.limit_reset, now)
    spent = row.period_spent_nanos if _utc(row.period_start) == current else 0
    limit = None if row.limit_usd is None else to_nanos(Decimal(row.limit_usd))
    return KeyUsage(limit_nanos=limit, spent_nanos=spent, held_nanos=row.held_nanos,
                    period_start=current,
                    resets_at=None if current is None else next_period(row.limit_reset, current))


def key_view(row, now):
    """Return the public description of an ``api_keys`` row: no hash, no secret.

    Amounts are exact decimal strings of USD; ``usage_usd`` is the current period's spend,
    ``held_usd`` the holds of its requests in flight, ``remaining_usd`` the limit less both
    (None without a limit); times are ISO 8601 UTC. ``id`` is the key's stable id (the keys
    API's paths; a rotation keeps it), ``models`` its allow-list (None: every model),
    ``in_flight_limit`` its own cap (None: only the org's), ``expires_at`` when it stops
    working, ``previous_key_expires_at`` when the secret it had before its last rotation stops
    working (None once it has), ``manage`` whether it may manage the org's keys.
    """
    usage = key_usage(row, now)
    return {
        "object": "key", "label": row.name, "prefix": row.prefix,
        "limit_usd": _usd(usage.limit_nanos), "limit_reset": row.limit_reset,
        "usage_usd": _usd(usage.spent_nanos), "held_usd": _usd(usage.held_nanos),
        "remaining_usd": _usd(usage.remaining_nanos),
        "period_start": _iso(usage.period_start), "resets_at": _iso(usage.resets_at),
        "rate_limit": None if row.rpm_limit is None else {"requests_per_minute": row.rpm_limit},
        "created_at": _iso(row.created_at), "last_used_at": _iso(row.last_used_at),
        "revoked": row.revoked_at is not None, "org_read": row.org_read,
        "id": row.id, "models": row.allowed_models.split() if row.allowed_models else None,
        "in_flight_limit": row.in_flight_limit, "expires_at": _iso(row.expires_at),
        "previous_key_expires_at": _previous_until(row, now), "manage": row.manage,
    }


def _previous_until(row, now):
    """When the secret before the last rotation stops working, while it still works."""
    until = _utc(row.previous_expires_at)
    return None if until is None or until <= now else until.isoformat()


def org_keys(engine, org_id):
    """Return the ``api_keys`` rows of ``org_id`` (the columns of :data:`_COLUMNS`), oldest
    first."""
    query = sa.select(*_COLUMNS).where(api_keys.c.org_id == org_id).order_by(api_keys.c.id)
    with engine.connect() as conn:
        return conn.execute(query).all()


def key_by_id(engine, key_id):
    """Return the ``api_keys`` row of ``key_id`` (the columns of :data:`_COLUMNS`)."""
    with engine.connect() as conn:
        return conn.execute(sa.select(*_COLUMNS).where(api_keys.c.id == key_id)).one()


# -- a new reset period (kiln key set, PATCH /v1/keys/{id}) ---------------------------------------

def recount(conn, key_id, reset):
    """Return the ``period_start`` and ``period_spent_nanos`` of a key whose reset becomes
    ``reset`` now: its settled events' costs since the new period's start (all of them when it
    never resets)."""
    start = period_start(reset, utcnow())
    ev = usage_events.c
    spent = sa.select(sa.func.coalesce(sa.func.sum(ev.cost_nanos), 0)).where(
        ev.api_key_id == key_id, ev.status != Status.PENDING.value)
    if start is not None:
        spent = spent.where(ev.ended_at >= start)
    return {"period_start": start, "period_spent_nanos": conn.execute(spent).scalar_one()}


def _utc(ts):
    """SQLite hands back naive datetimes; they are UTC."""
    return ts if ts is None or ts.tzinfo else ts.replace(tzinfo=timezone.utc)


def _usd(nanos):
    return None if nanos is None else format(from_nanos(nanos), "f")


def _iso(ts):
    return None if ts is None else _utc(ts).isoformat()
