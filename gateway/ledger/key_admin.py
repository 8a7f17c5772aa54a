"""Changes to keys, by a management key (the keys API, docs/KEYS.md) or by the operator
(``kiln key``), each recorded in the append-only ``key_changes`` table in the transaction that
makes it: who (the acting key's id, or the operator), what (the action and the columns it set,
as JSON: never a secret or a hash), when.

Every function here takes the key's org: a key id of another org is not found, so a caller
cannot reach past its org whatever id it sends. Rules of who may do what (a management key
cannot create another) are the caller's (:mod:`gateway.api.keys`); this module writes.
"""
import json
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal

import sqlalchemy as sa

from ..db import utcnow
from ..models import api_keys, key_changes
from .keys import (_COLUMNS, PREFIX_LEN, create_key_row, hash_key, models_column, new_secret,
                   recount)


@dataclass(frozen=True)
class Actor:
    """Who changes a key: a management key (its id), or the operator (``key_id`` None)."""

    key_id: int = None

    @property
    def kind(self):
        return "operator" if self.key_id is None else "key"


OPERATOR = Actor()


def record(conn, org_id, key_id, actor, action, changes):
    """Append one row to ``key_changes``.

    :param action: ``create``, ``update``, ``rotate`` or ``revoke``.
    :param changes: ``{column: value}``; Decimals and datetimes are written as strings.
    """
    conn.execute(key_changes.insert().values(
        org_id=org_id, api_key_id=key_id, actor=actor.kind, actor_key_id=actor.key_id,
        action=action, changes=json.dumps(changes, default=_json_value, sort_keys=True),
        created_at=utcnow()))


def _json_value(value):
    return format(value, "f") if isinstance(value, Decimal) else value.isoformat()


def find_key(conn, org_id, key_id, lock=False):
    """Return the ``api_keys`` row (the columns of :func:`gateway.ledger.keys.key_by_id`) of
    ``key_id`` in ``org_id``, or None; ``lock`` takes its row lock."""
    query = sa.select(*_COLUMNS).where(api_keys.c.id == key_id, api_keys.c.org_id == org_id)
    return conn.execute(query.with_for_update() if lock else query).first()


def create(engine, org_id, values, actor):
    """Create a key with ``values`` (``api_keys`` columns; ``allowed_models`` a list) and
    record it; return ``(key id, the key in clear)``."""
    with engine.begin() as conn:
        fields = {k: v for k, v in values.items() if k not in ("name", "allowed_models",
                                                               "org_read")}
        key_id, secret = create_key_row(conn, org_id, values.get("name"),
                                        values.get("allowed_models"), values.get("org_read"),
                                        **fields)
        record(conn, org_id, key_id, actor, "create", values)
    return key_id, secret


def update(engine, org_id, key_id, values, actor):
    """Apply ``values`` (``api_keys`` columns; None clears one) to the key and record them;
    return whether the key exists in ``org_id``.

    A new reset period starts now: the key's spend is recounted from its settled events since
    the new period's start, under the key's row lock, which settlement takes too.
    """
    with engine.begin() as conn:
        row = find_key(conn, org_id, key_id, lock=True)
        if row is None:
            return False
        columns = dict(values)
        if "allowed_models" in values:
            columns["allowed_models"] = models_column(values["allowed_models"])
        if "limit_reset" in values and values["limit_reset"] != row.limit_reset:
            columns.update(recount(conn, key_id, values["limit_reset"]))
        conn.execute(api_keys.update().where(api_keys.c.id == key_id).values(**columns))
        record(conn, org_id, key_id, actor, "update", values)
    return True


def revoke(engine, org_id, key_id, actor):
    """Revoke the key and record it (a revoked key stays revoked: no second record); return
    whether the key exists in ``org_id``."""
    with engine.begin() as conn:
        row = find_key(conn, org_id, key_id, lock=True)
        if row is None:
            return False
        if row.revoked_at is None:
            now = utcnow()
            conn.execute(api_keys.update().where(api_keys.c.id == key_id)
                         .values(revoked_at=now))
            record(conn, org_id, key_id, actor, "revoke", {"revoked_at": now})
    return True


def rotate(engine, org_id, key_id, grace_period_s, actor):
    """Give the key a new secret and return it in clear (None: no such key in ``org_id``).

    The old secret keeps working for ``grace_period_s`` seconds (0: not at all), in place of
    any earlier one still in its grace period; the key keeps its id, limits and spend, and its
    display prefix becomes the new secret's.
    """
    with engine.begin() as conn:
        row = conn.execute(sa.select(api_keys.c.id, api_keys.c.key_hash).where(
            api_keys.c.id == key_id, api_keys.c.org_id == org_id).with_for_update()).first()
        if row is None:
            return None
        secret = new_secret()
        until = utcnow() + timedelta(seconds=grace_period_s) if grace_period_s else None
        conn.execute(api_keys.update().where(api_keys.c.id == key_id).values(
            key_hash=hash_key(secret), prefix=secret[:PREFIX_LEN],
            previous_key_hash=row.key_hash if until else None, previous_expires_at=until))
        record(conn, org_id, key_id, actor, "rotate",
               {"grace_period_s": grace_period_s, "previous_expires_at": until})
    return secret


def set_limits(engine, prefix, changes):
    """Apply ``changes`` (``api_keys`` columns; None clears one) to the key with display
    ``prefix`` as the operator (``kiln key set``); return whether there was one."""
    found = by_prefix(engine, prefix)
    return found is not None and update(engine, found.org_id, found.id, changes, OPERATOR)


def revoke_prefix(engine, prefix):
    """Revoke the active key with display ``prefix`` as the operator (``kiln key revoke``);
    return whether there was one."""
    found = by_prefix(engine, prefix)
    if found is None or found.revoked_at is not None:
        return False
    return revoke(engine, found.org_id, found.id, OPERATOR)


def by_prefix(engine, prefix):
    """Return ``(org_id, id, revoked_at)`` of the key with display ``prefix``, or None."""
    with engine.connect() as conn:
        return conn.execute(sa.select(api_keys.c.org_id, api_keys.c.id, api_keys.c.revoked_at)
                            .where(api_keys.c.prefix == prefix)).first()


def changes_of(engine, org_id, key_id):
    """Return the ``key_changes`` rows of a key in ``org_id``, oldest first."""
    c = key_changes.c
    with engine.connect() as conn:
        return conn.execute(sa.select(key_changes).where(c.org_id == org_id, c.api_key_id == key_id)
                            .order_by(c.id)).all()
