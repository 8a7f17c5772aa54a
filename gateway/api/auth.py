"""API keys: the ``Authorization: Bearer`` check on every API view (keys are created and revoked
by :mod:`gateway.ledger.keys`, whose names this module also offers its callers), and
the ``auth`` blueprint beside it: ``GET /v1/key`` (the calling key), whose row and limits are
read by :mod:`gateway.ledger.keys` (the org's keys, the keys API: :mod:`gateway.api.keys`).

Keys are random, shown once, stored as SHA-256 plus a short display prefix. Lookups are cached
per process for ``KILN_KEY_CACHE_TTL_S`` seconds, so a revocation takes effect within that time;
a key's ``expires_at`` (and the end of a rotated secret's grace period) is cached with it and
compared on every request, so an expiry takes effect exactly (docs/KEYS.md).
A key found unknown is remembered as unknown for ``KILN_UNKNOWN_KEY_CACHE_TTL_S`` seconds, so a
client repeating a bad key costs no database query per request, and each repeat is answered
only after :data:`UNKNOWN_KEY_DELAY_S` (a wait costs a gevent worker nothing, and a client
flooding one bad key gets no more answers per second than it holds connections). Both caches
are bounded in size.

A key's ``last_used_at`` is written by the key check itself, so that every accepted request
counts (also one then refused with 402 or 429, and ``GET`` calls), but not once per request:
each worker writes it at most once per key per ``KILN_KEY_LAST_USED_INTERVAL_S`` (60 s), by a
conditional ``UPDATE`` that leaves a time newer than the interval alone (so several workers and
hosts write it about once per interval between them), in a greenlet of its own: the request
neither waits for it nor fails with it; a failed write is logged.
"""
import functools
import logging
import re
import time
from dataclasses import dataclass
from datetime import timedelta, timezone

import gevent
import sqlalchemy as sa
from flask import Blueprint, current_app, g, jsonify, request

from ..db import utcnow
from ..errors import Forbidden, Unauthorized
from ..ledger.keys import (KEY_PREFIX, PREFIX_LEN, create_key, hash_key,  # noqa: F401
                           key_by_id, key_view, revoke_key)
from ..models import api_keys, orgs

bp = Blueprint("auth", __name__)
log = logging.getLogger("kiln.auth")

_CACHE_MAX = 10_000
UNKNOWN_KEY_DELAY_S = 0.5
# What create_key can produce ("kiln-" + token_urlsafe(32): 48 characters of the URL-safe
# alphabet), with room to spare. Anything else is refused without a database lookup.
_KEY_SHAPE = re.compile(r"[A-Za-z0-9_-]{1,256}")


@dataclass(frozen=True)
class Principal:
    """Who is calling: the key and its org, as read from the database."""

    key_id: int
    key_prefix: str
    org_id: int
    org_status: str
    revoked: bool
    allowed_models: frozenset  # empty: every model
    in_flight_limit: int
    limit_usd: object = None   # the key's spend limit (Decimal USD), or None
    limit_reset: str = None    # "daily", "weekly", "monthly", or None (never resets)
    rpm_limit: int = None      # requests per minute, or None
    org_read: bool = True      # may read the org's other keys and org-wide activity
    manage: bool = False       # a management key: manages the org's keys, calls no model
    expires_at: object = None  # aware UTC: refused from then on (the key's expiry, or the
    #                            end of a rotated secret's grace period); None: never
    key_in_flight_limit: int = None  # the key's own cap of requests in flight, or None

    @property
    def key_checks(self):
        """Admission also counts this key (a spend limit, a request rate or its own in-flight
        cap)."""
        return (self.limit_usd is not None or self.rpm_limit is not None
                or self.key_in_flight_limit is not None)

    @property
    def reads_org(self):
        """The key may read its org's other keys (``org_read``, or a management key)."""
        return self.org_read or self.manage

    def may_use(self, model_id):
        """Tell whether the key's allow-list admits ``model_id``."""
        return not self.allowed_models or model_id in self.allowed_models

    def expired(self, now):
        """Tell whether the key (or the rotated secret it was found by) has expired at
        ``now``."""
        return self.expires_at is not None and now >= self.expires_at


def lookup(engine, key, default_limit):
    """Return the :class:`Principal` for ``key`` in clear, or None when unknown: the key's
    secret, or the secret it had before its last rotation (until that one's grace period
    ends, which becomes the principal's ``expires_at`` when the key's own is not sooner)."""
    k, digest = api_keys.c, hash_key(key)
    query = (sa.select(k.id, k.prefix, k.revoked_at, k.allowed_models, k.limit_usd,
                       k.limit_reset, k.rpm_limit, k.org_read, k.manage, k.expires_at,
                       k.in_flight_limit.label("key_in_flight_limit"), k.key_hash,
                       k.previous_expires_at, orgs.c.id.label("org_id"), orgs.c.status,
                       orgs.c.in_flight_limit)
             .join(orgs, orgs.c.id == api_keys.c.org_id)
             .where(sa.or_(k.key_hash == digest, k.previous_key_hash == digest)))
    with engine.connect() as conn:
        row = conn.execute(query).first()
    if row is None:
        return None
    ends = [_aware(row.expires_at)]
    if row.key_hash != digest:  # the rotated secret
        ends.append(_aware(row.previous_expires_at) or utcnow())
    ends = [t for t in ends if t is not None]
    return Principal(key_id=row.id, key_prefix=row.prefix, org_id=row.org_id,
                     org_status=row.status, revoked=row.revoked_at is not None,
                     allowed_models=frozenset((row.allowed_models or "").split()),
                     in_flight_limit=row.in_flight_limit or default_limit,
                     limit_usd=row.limit_usd, limit_reset=row.limit_reset,
                     rpm_limit=row.rpm_limit, org_read=row.org_read, manage=row.manage,
                     expires_at=min(ends) if ends else None,
                     key_in_flight_limit=row.key_in_flight_limit)


def _aware(ts):
    """SQLite hands back naive datetimes; they are UTC."""
    return ts if ts is None or ts.tzinfo else ts.replace(tzinfo=timezone.utc)


def authenticate():
    """Resolve the request's key into a :class:`Principal`: ``Authorization: Bearer``, or,
    without that header, ``x-api-key`` (Anthropic's).

    :raises Unauthorized: no key, or an unknown one (401 ``invalid_api_key``); a key past its
        ``expires_at``, or a rotated secret past its grace period (401 ``key_expired``, also
        when the key's lookup is cached: the time is compared on every request).
    :raises Forbidden: a revoked key or a suspended org (403).
    """
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if not header and request.headers.get("x-api-key"):  # Anthropic's clients send this
        scheme, key = "bearer", request.headers["x-api-key"].strip()
    if scheme.lower() != "bearer" or not key:
        raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>' "
                           "(or 'x-api-key: <key>', as Anthropic's clients do).")
    principal = _cached_lookup(key) if _KEY_SHAPE.fullmatch(key) else None
    if principal is None:
        raise Unauthorized("Incorrect API key provided.")
    if principal.expired(utcnow()):
        raise Unauthorized(f"This API key expired at {principal.expires_at.isoformat()}.",
                           code="key_expired")
    if principal.revoked:
        raise Forbidden("This API key has been revoked.", code="key_revoked")
    if principal.org_status != "active":
        raise Forbidden("This organization is suspended.", code="org_suspended")
    _note_use(principal.key_id)
    return principal


def _note_use(key_id):
    """Write the key's ``last_used_at`` when this worker has not in the last interval."""
    interval_s = current_app.config["KILN"].key_last_used_interval_s
    noted = current_app.extensions["kiln.key_used"]
    now = time.monotonic()
    last = noted.get(key_id)
    if last is not None and last > now - interval_s:
        return
    _remember(noted, key_id, now, now - interval_s)
    gevent.spawn(touch_last_used, current_app.extensions["kiln.engine"], key_id, interval_s)


def touch_last_used(engine, key_id, interval_s):
    """Set the key's ``last_used_at`` to now unless it is already within ``interval_s``; return
    whether a row was written. A database error is logged, never raised (nothing waits for
    this)."""
    now = utcnow()
    k = api_keys.c
    try:
        with engine.begin() as conn:
            return conn.execute(api_keys.update().where(
                k.id == key_id,
                sa.or_(k.last_used_at.is_(None),
                       k.last_used_at < now - timedelta(seconds=interval_s)))
                .values(last_used_at=now)).rowcount == 1
    except sa.exc.SQLAlchemyError:  # a lost write only leaves last_used_at older
        log.exception("writing last_used_at of key %s failed", key_id)
        return False


def _cached_lookup(key):
    config = current_app.config["KILN"]
    cache = current_app.extensions["kiln.key_cache"]
    unknown = current_app.extensions["kiln.unknown_keys"]
    digest = hash_key(key)
    now = time.monotonic()
    hit = cache.get(digest)
    if hit is not None and hit[0] > now:
        return hit[1]
    if hit is not None:
        # Expired: this request looks the key up again; the requests with the same key that
        # arrive meanwhile keep the last answer, instead of each asking the database.
        cache[digest] = (now + config.key_cache_ttl_s, hit[1])
    elif unknown.get(digest, 0.0) > now:
        gevent.sleep(UNKNOWN_KEY_DELAY_S)
        return None
    try:
        principal = lookup(current_app.extensions["kiln.engine"], key,
                           config.default_in_flight_limit)
    except BaseException:
        if hit is not None:
            cache[digest] = hit  # still expired: the next request tries again
        raise
    if principal is not None:
        _remember(cache, digest, (now + config.key_cache_ttl_s, principal), now)
        unknown.pop(digest, None)
    else:
        cache.pop(digest, None)
        if config.unknown_key_cache_ttl_s > 0:
            _remember(unknown, digest, now + config.unknown_key_cache_ttl_s, now)
    return principal


def _remember(cache, digest, entry, now):
    """Store ``entry`` under ``digest``; a full cache first drops its entries that expire (or
    were noted) at or before ``now``, and is emptied if there are none (a flood of distinct
    keys cannot grow it past the bound)."""
    if len(cache) >= _CACHE_MAX:
        for stale in [d for d, e in cache.items() if (e[0] if isinstance(e, tuple) else e) <= now]:
            del cache[stale]
        if len(cache) >= _CACHE_MAX:
            cache.clear()
    cache[digest] = entry


def require_key(view):
    """Decorate ``view`` so that it runs only for a valid key; sets ``g.principal``."""
    @functools.wraps(view)
    def wrapper(*args, **kwargs):
        g.principal = authenticate()
        return view(*args, **kwargs)
    return wrapper


# -- the calling key (the org's keys: gateway.api.keys) -------------------------------------------

@bp.get("/key")
@require_key
def current_key():
    """Show the calling key: label, prefix, limit, reset, usage this period, remaining, rate
    limit, created and last-used times."""
    row = key_by_id(current_app.extensions["kiln.engine"], g.principal.key_id)
    return jsonify(key_view(row, utcnow()))
