"""Pricing, credit holds, admission and settlement.

Admission places a hold for the request's worst-case cost and takes an in-flight lease;
settlement (exactly once) closes the usage event, debits the exact cost and releases hold and
lease. On Postgres each is a single statement, sent in autocommit mode: one round trip each.
Money is integer nano-dollars in SQL and Decimal USD in Python, never floats.
"""
import secrets
import time
from dataclasses import dataclass
from datetime import timedelta
from decimal import ROUND_HALF_UP, Decimal

import sqlalchemy as sa

from .db import is_postgres, utcnow
from .errors import InsufficientCredits, RateLimited
from .models import credit_balances, in_flight, usage_events

NANOS_PER_USD = Decimal(10 ** 9)
NANO = Decimal("1E-9")
PER_MILLION = Decimal(10 ** 6)
MESSAGE_OVERHEAD_TOKENS = 8   # chat-template tokens around each message
REQUEST_OVERHEAD_TOKENS = 32  # template tokens around the whole prompt


@dataclass(frozen=True)
class Usage:
    """Token counts of one generation. ``completion`` includes reasoning tokens."""

    prompt: int = 0
    cached: int = 0
    completion: int = 0
    estimated: bool = False

    @classmethod
    def from_openai(cls, usage, estimated=False):
        """Read an OpenAI ``usage`` object; missing or null counts are 0."""
        usage = usage or {}
        details = usage.get("prompt_tokens_details") or {}
        return cls(prompt=_count(usage.get("prompt_tokens")),
                   cached=_count(details.get("cached_tokens")),
                   completion=_count(usage.get("completion_tokens")), estimated=estimated)

    def to_openai(self):
        """Return the OpenAI ``usage`` object (without cost)."""
        out = {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
               "total_tokens": self.prompt + self.completion}
        if self.cached:
            out["prompt_tokens_details"] = {"cached_tokens": self.cached}
        return out


MAX_TOKENS_COUNT = 2 ** 31 - 1  # the token columns are 32-bit; no real generation is near it


def _count(value):
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        return 0
    return min(value, MAX_TOKENS_COUNT)


def cost_usd(usage, pricing):
    """Price ``usage`` in USD, exact, rounded half-up to the nano-dollar.

    ``cost = (prompt - cached) * input + cached * cached_input + completion * output`` with
    prices per million tokens; ``cached`` is clamped to ``[0, prompt]`` (DESIGN.md, Pricing).

    :param usage: :class:`Usage`.
    :param pricing: :class:`gateway.catalog.Pricing`.
    :returns: Decimal USD, never negative.
    """
    cached = min(max(usage.cached, 0), max(usage.prompt, 0))
    uncached = max(usage.prompt, 0) - cached
    raw = (uncached * pricing.input + cached * pricing.cached_input
           + max(usage.completion, 0) * pricing.output) / PER_MILLION
    return max(raw, Decimal(0)).quantize(NANO, rounding=ROUND_HALF_UP)


def to_nanos(usd):
    """Return integer nano-dollars for a Decimal USD amount (already at nano precision)."""
    return int((usd * NANOS_PER_USD).to_integral_value(rounding=ROUND_HALF_UP))


def from_nanos(nanos):
    """Return Decimal USD for integer nano-dollars."""
    return Decimal(int(nanos)) / NANOS_PER_USD


def hold_for(entry, body_bytes, n_messages, max_tokens, has_images):
    """Return the hold in nano-dollars: an upper bound of the request's cost.

    The prompt is bounded by the body size in bytes (a token covers at least one byte of text)
    plus template overhead, and by the context window; images count as a full context window.
    The completion is bounded by ``max_tokens``, or the model's max output when absent.
    """
    prompt = body_bytes + MESSAGE_OVERHEAD_TOKENS * n_messages + REQUEST_OVERHEAD_TOKENS
    if has_images:
        prompt = entry.context_window
    usage = Usage(prompt=min(prompt, entry.context_window),
                  completion=max_tokens or entry.max_output_tokens)
    return to_nanos(cost_usd(usage, entry.pricing))


def new_generation_id():
    """Return a fresh generation id (``gen-`` + 24 hex digits)."""
    return "gen-" + secrets.token_hex(12)


def autocommit(engine):
    """Return a connection whose statements commit on their own.

    Admission, settlement and renewal are each one statement on Postgres, atomic by itself:
    without an explicit transaction they cost one round trip instead of three (BEGIN, the
    statement, COMMIT).
    """
    return engine.connect().execution_options(isolation_level="AUTOCOMMIT")


# -- admission -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Admission:
    """What one admission attempt saw.

    ``gid`` is the generation id when admitted, else None; the other fields describe the org's
    balance row as the attempt saw it (only meaningful when rejected).
    """

    gid: str = None
    available_nanos: int = 0
    in_flight: int = 0
    expired_leases: bool = False


# The conditional UPDATE of the org's balance row decides: concurrent admissions of one org wait
# on its row lock and re-check the condition on the newest row (READ COMMITTED), so the limit
# and the credits are exact across processes and hosts. The trailing SELECT tells a rejection's
# reason in the same round trip (from the statement's snapshot, hence `rejection` may say None).
_PG_ADMIT = sa.text("""
WITH admitted AS (
  UPDATE credit_balances
     SET in_flight = in_flight + 1, held_nanos = held_nanos + :hold
   WHERE org_id = :org AND in_flight < :limit AND balance_nanos - held_nanos >= :hold
  RETURNING org_id
), event AS (
  INSERT INTO usage_events (id, org_id, api_key_id, model, stream, status, hold_nanos, started_at)
  SELECT :gid, org_id, :key, :model, :stream, 'pending', :hold, :now FROM admitted
  RETURNING id
), lease AS (
  INSERT INTO in_flight (generation_id, org_id, hold_nanos, expires_at)
  SELECT id, :org, :hold, :expires FROM event
  RETURNING generation_id
)
SELECT (SELECT generation_id FROM lease) AS gid,
       b.balance_nanos - b.held_nanos AS available, b.in_flight,
       EXISTS (SELECT 1 FROM in_flight f
                WHERE f.org_id = :org AND f.expires_at < :now) AS expired
  FROM credit_balances b WHERE b.org_id = :org
""")


def try_admit(engine, principal, model_id, stream, hold_nanos, lease_ttl_s):
    """Try once to place a hold and take an in-flight lease; never raises a rejection.

    One statement (one round trip) on Postgres. A rejected attempt changes nothing.

    :param hold_nanos: the hold, integer nano-dollars (:func:`hold_for`).
    :param lease_ttl_s: seconds until the lease expires unless renewed.
    :returns: :class:`Admission`; ``gid`` is None when rejected.
    """
    now = utcnow()
    params = {"hold": hold_nanos, "org": principal.org_id, "limit": principal.in_flight_limit,
              "gid": new_generation_id(), "key": principal.key_id, "model": model_id,
              "stream": stream, "now": now, "expires": now + timedelta(seconds=lease_ttl_s)}
    if not is_postgres(engine):
        return _admit_generic(engine, params)
    row = _execute_reconnecting(engine, _PG_ADMIT, params)
    if row is None:  # no balance row: the org cannot pay
        return Admission()
    return Admission(row.gid, row.available, row.in_flight, row.expired)


def _execute_reconnecting(engine, statement, params):
    """Run one autocommit statement; on a pooled connection found dead (a database restart;
    the pool does not ping on checkout) run it once more on a fresh one. The retry reuses the
    same generation id, so it can never admit twice."""
    try:
        with autocommit(engine) as conn:
            return conn.execute(statement, params).first()
    except sa.exc.DBAPIError as err:
        if not err.connection_invalidated:
            raise
    with autocommit(engine) as conn:
        return conn.execute(statement, params).first()


def _admit_generic(engine, p):
    bal = credit_balances.c
    with engine.begin() as conn:
        admitted = conn.execute(
            credit_balances.update()
            .where(bal.org_id == p["org"], bal.in_flight < p["limit"],
                   bal.balance_nanos - bal.held_nanos >= p["hold"])
            .values(in_flight=bal.in_flight + 1, held_nanos=bal.held_nanos + p["hold"])
        ).rowcount == 1
        if admitted:
            conn.execute(usage_events.insert().values(
                id=p["gid"], org_id=p["org"], api_key_id=p["key"], model=p["model"],
                stream=p["stream"], status="pending", hold_nanos=p["hold"], started_at=p["now"]))
            conn.execute(in_flight.insert().values(
                generation_id=p["gid"], org_id=p["org"], hold_nanos=p["hold"],
                expires_at=p["expires"]))
            return Admission(p["gid"])
        row = conn.execute(sa.select(bal.balance_nanos - bal.held_nanos, bal.in_flight)
                           .where(bal.org_id == p["org"])).first()
        expired = conn.execute(sa.select(sa.exists().where(
            in_flight.c.org_id == p["org"], in_flight.c.expires_at < p["now"]))).scalar()
    return Admission(None, *row, bool(expired)) if row else Admission()


def current_state(engine, org_id):
    """Read the org's balance row now (a fresh statement, after any lock wait), as an
    :class:`Admission` without a generation id."""
    bal = credit_balances.c
    with engine.connect() as conn:
        row = conn.execute(sa.select((bal.balance_nanos - bal.held_nanos).label("available"),
                                     bal.in_flight).where(bal.org_id == org_id)).first()
    return Admission(None, row.available, row.in_flight) if row else Admission()


def rejection(admission, principal, hold_nanos):
    """Return the error for a rejected :class:`Admission`, or None when its snapshot shows room
    (the org's row changed meanwhile: the caller tries again).

    The in-flight limit is told first: it clears by itself, and holds of running requests also
    lower the available credits.
    """
    if admission.in_flight >= principal.in_flight_limit:
        return RateLimited(f"Too many requests in flight: this organization's limit is "
                           f"{principal.in_flight_limit} at once. Retry with backoff.")
    if admission.available_nanos < hold_nanos:
        return insufficient_credits(admission.available_nanos, hold_nanos)
    return None


def insufficient_credits(available_nanos, hold_nanos):
    """Return the 402 error: the available amount, the hold, and what to do (issue 4)."""
    return InsufficientCredits(
        f"Insufficient credits: {_usd(available_nanos)} USD available (balance minus the holds "
        f"of requests in flight), but this request needs a hold of {_usd(hold_nanos)} USD, its "
        f"worst-case cost at max_tokens. Lower max_tokens, or add credits.")


def _usd(nanos):
    return format(from_nanos(max(nanos, 0)).normalize(), "f")


# -- settlement ----------------------------------------------------------------------------------

@dataclass
class Outcome:
    """How a generation ended; what settlement writes."""

    status: str
    usage: Usage
    cost_nanos: int
    http_status: int = None
    error: str = None
    backend: str = None
    first_token_at: object = None


SETTLE_BACKOFF_S = (0.2, 1.0)  # waits between settlement attempts (connection lost, deadlock)

# Row locks are taken in one order by every statement that touches a pending generation:
# usage event, then lease, then balance (renewal: event, then lease). The uncorrelated
# `(SELECT count(*) FROM lease)` is evaluated before the balance row is locked, which pins
# the order; without it Postgres deletes the lease after updating the balance.
_PG_SETTLE = """
WITH event AS (
  UPDATE usage_events
     SET status = :status, prompt_tokens = :prompt, cached_tokens = :cached,
         completion_tokens = :completion, cost_nanos = LEAST(:cost, hold_nanos),
         estimated = :estimated, http_status = :http_status, error = :error,
         backend = COALESCE(:backend, backend),
         first_token_at = COALESCE(:first_token_at, first_token_at), ended_at = :now
   WHERE id = :gid AND status = 'pending' {only_expired}
  RETURNING org_id, hold_nanos, cost_nanos
), lease AS (
  DELETE FROM in_flight WHERE generation_id = :gid AND EXISTS (SELECT 1 FROM event)
  RETURNING generation_id
)
UPDATE credit_balances b
   SET balance_nanos = b.balance_nanos - event.cost_nanos,
       held_nanos = b.held_nanos - event.hold_nanos, in_flight = b.in_flight - 1
  FROM event
 WHERE b.org_id = event.org_id AND (SELECT count(*) FROM lease) >= 0
RETURNING event.cost_nanos
"""
_ONLY_EXPIRED = ("AND EXISTS (SELECT 1 FROM in_flight "
                 "WHERE generation_id = :gid AND expires_at < :expired_before)")
_PG_SETTLE_ANY = sa.text(_PG_SETTLE.format(only_expired=""))
_PG_SETTLE_EXPIRED = sa.text(_PG_SETTLE.format(only_expired=_ONLY_EXPIRED))


def settle(engine, gid, outcome, expired_before=None):
    """Close usage event ``gid`` with ``outcome``, debit its cost, release hold and lease.

    Exactly once: a second call for the same generation changes nothing and returns None. The
    debit is capped at the hold, so a balance never goes below zero nor below open holds. One
    statement on Postgres; retried (it is idempotent) when the connection drops or on deadlock.

    :param expired_before: settle only if the lease expired before this time (the sweeper),
        so that a lease renewed meanwhile is left alone.
    :returns: the debited cost in nano-dollars, or None when there was nothing to settle.
    :raises sqlalchemy.exc.SQLAlchemyError: the database stayed unreachable.
    """
    u = outcome.usage
    params = {"gid": gid, "status": outcome.status, "prompt": u.prompt, "cached": u.cached,
              "completion": u.completion, "cost": outcome.cost_nanos, "estimated": u.estimated,
              "http_status": outcome.http_status, "error": outcome.error,
              "backend": outcome.backend, "first_token_at": outcome.first_token_at,
              "now": utcnow(), "expired_before": expired_before}
    for wait_s in SETTLE_BACKOFF_S + (None,):
        try:
            return _settle_once(engine, params)
        except sa.exc.OperationalError:
            if wait_s is None:
                raise
            time.sleep(wait_s)


def _settle_once(engine, params):
    if not is_postgres(engine):
        return _settle_generic(engine, params)
    statement = _PG_SETTLE_ANY if params["expired_before"] is None else _PG_SETTLE_EXPIRED
    with autocommit(engine) as conn:
        row = conn.execute(statement, params).first()
    return None if row is None else row[0]


def _settle_generic(engine, params):
    ev = usage_events.c
    pending = [ev.id == params["gid"], ev.status == "pending"]
    if params["expired_before"] is not None:
        pending.append(sa.exists().where(in_flight.c.generation_id == params["gid"],
                                         in_flight.c.expires_at < params["expired_before"]))
    with engine.begin() as conn:
        row = conn.execute(
            usage_events.update().where(*pending)
            .values(status=params["status"], prompt_tokens=params["prompt"],
                    cached_tokens=params["cached"], completion_tokens=params["completion"],
                    cost_nanos=sa.case((ev.hold_nanos < params["cost"], ev.hold_nanos),
                                       else_=params["cost"]),
                    estimated=params["estimated"], http_status=params["http_status"],
                    error=params["error"], backend=sa.func.coalesce(params["backend"], ev.backend),
                    first_token_at=sa.func.coalesce(params["first_token_at"], ev.first_token_at),
                    ended_at=params["now"])
            .returning(ev.org_id, ev.hold_nanos, ev.cost_nanos)).first()
        if row is None:
            return None
        conn.execute(in_flight.delete().where(in_flight.c.generation_id == params["gid"]))
        bal = credit_balances.c
        conn.execute(credit_balances.update().where(bal.org_id == row.org_id).values(
            balance_nanos=bal.balance_nanos - row.cost_nanos,
            held_nanos=bal.held_nanos - row.hold_nanos, in_flight=bal.in_flight - 1))
        return row.cost_nanos
