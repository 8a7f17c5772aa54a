"""API keys: creation, revocation, and the ``Authorization: Bearer`` check on every API view.

Keys are random, shown once, stored as SHA-256 plus a short display prefix. Lookups are cached
per process for ``KILN_KEY_CACHE_TTL_S`` seconds, so a revocation takes effect within that time.
A key found unknown is remembered as unknown for ``KILN_UNKNOWN_KEY_CACHE_TTL_S`` seconds, so a
client repeating a bad key costs no database query per request, and each repeat is answered
only after :data:`UNKNOWN_KEY_DELAY_S` (a wait costs a gevent worker nothing, and a client
flooding one bad key gets no more answers per second than it holds connections). Both caches
are bounded in size.
"""
import functools
import hashlib
import re
import secrets
import time
from dataclasses import dataclass

import gevent
import sqlalchemy as sa
from flask import current_app, g, request

from .db import utcnow
from .errors import Forbidden, Unauthorized
from .models import api_keys, orgs

KEY_PREFIX = "kiln-"
PREFIX_LEN = 12  # "kiln-" plus 7 random characters: enough to tell keys apart in logs
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

    @property
    def key_checks(self):
        """Admission also counts this key (it has a spend limit or a request rate)."""
        return self.limit_usd is not None or self.rpm_limit is not None

    def may_use(self, model_id):
        """Tell whether the key's allow-list admits ``model_id``."""
        return not self.allowed_models or model_id in self.allowed_models


def hash_key(key):
    """Return the hex SHA-256 of ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(conn, org_id, name=None, allowed_models=None, **limits):
    """Create a key for ``org_id`` and return it in clear (the only time it exists in clear).

    :param allowed_models: iterable of public model ids, or None for every model.
    :param limits: ``limit_usd`` (Decimal USD), ``limit_reset`` (``daily``, ``weekly``,
        ``monthly``), ``rpm_limit`` (requests per minute); absent or None: no limit.
    """
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    conn.execute(api_keys.insert().values(
        org_id=org_id, prefix=key[:PREFIX_LEN], key_hash=hash_key(key), name=name,
        allowed_models=" ".join(sorted(allowed_models)) if allowed_models else None, **limits))
    return key


def revoke_key(conn, prefix):
    """Revoke the key with display ``prefix``; return whether one was revoked."""
    result = conn.execute(api_keys.update()
                          .where(api_keys.c.prefix == prefix, api_keys.c.revoked_at.is_(None))
                          .values(revoked_at=utcnow()))
    return result.rowcount == 1


def lookup(engine, key, default_limit):
    """Return the :class:`Principal` for ``key`` in clear, or None when unknown."""
    k = api_keys.c
    query = (sa.select(k.id, k.prefix, k.revoked_at, k.allowed_models, k.limit_usd,
                       k.limit_reset, k.rpm_limit, orgs.c.id.label("org_id"), orgs.c.status,
                       orgs.c.in_flight_limit)
             .join(orgs, orgs.c.id == api_keys.c.org_id)
             .where(api_keys.c.key_hash == hash_key(key)))
    with engine.connect() as conn:
        row = conn.execute(query).first()
    if row is None:
        return None
    return Principal(key_id=row.id, key_prefix=row.prefix, org_id=row.org_id,
                     org_status=row.status, revoked=row.revoked_at is not None,
                     allowed_models=frozenset((row.allowed_models or "").split()),
                     in_flight_limit=row.in_flight_limit or default_limit,
                     limit_usd=row.limit_usd, limit_reset=row.limit_reset,
                     rpm_limit=row.rpm_limit)


def authenticate():
    """Resolve the request's bearer key into a :class:`Principal`.

    :raises Unauthorized: no key, or an unknown one (401).
    :raises Forbidden: a revoked key or a suspended org (403).
    """
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise Unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
    principal = _cached_lookup(key) if _KEY_SHAPE.fullmatch(key) else None
    if principal is None:
        raise Unauthorized("Incorrect API key provided.")
    if principal.revoked:
        raise Forbidden("This API key has been revoked.", code="key_revoked")
    if principal.org_status != "active":
        raise Forbidden("This organization is suspended.", code="org_suspended")
    return principal


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
    """Store ``entry`` under ``digest``; a full cache first drops its expired entries, and is
    emptied if none has expired (a flood of distinct keys cannot grow it past the bound)."""
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
