"""Pricing, credit holds, admission and settlement.

Admission (one short transaction) places a hold for the request's worst-case cost and takes an
in-flight lease; settlement (one short transaction, exactly once) closes the usage event, debits
the exact cost and releases hold and lease. On Postgres each is a single statement.
"""
import secrets
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


def _count(value):
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


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
)
INSERT INTO in_flight (generation_id, org_id, hold_nanos, expires_at)
SELECT id, :org, :hold, :expires FROM event
RETURNING generation_id
""")


def admit(engine, principal, model_id, stream, hold_nanos, lease_ttl_s):
    """Place a hold and take an in-flight lease for one request; return its generation id.

    One statement on Postgres: the conditional UPDATE of the org's balance row serialises
    concurrent admissions of an org, across processes and hosts.

    :raises RateLimited: the org already has ``principal.in_flight_limit`` requests in flight.
    :raises InsufficientCredits: available credits do not cover ``hold_nanos``.
    """
    gid = new_generation_id()
    now = utcnow()
    params = {"hold": hold_nanos, "org": principal.org_id, "limit": principal.in_flight_limit,
              "gid": gid, "key": principal.key_id, "model": model_id, "stream": stream,
              "now": now, "expires": now + timedelta(seconds=lease_ttl_s)}
    if _try_admit(engine, params):
        return gid
    raise _rejection(engine, principal, hold_nanos)


def _try_admit(engine, params):
    if is_postgres(engine):
        with engine.begin() as conn:
            return conn.execute(_PG_ADMIT, params).first() is not None
    with engine.begin() as conn:
        bal = credit_balances.c
        admitted = conn.execute(
            credit_balances.update()
            .where(bal.org_id == params["org"], bal.in_flight < params["limit"],
                   bal.balance_nanos - bal.held_nanos >= params["hold"])
            .values(in_flight=bal.in_flight + 1, held_nanos=bal.held_nanos + params["hold"])
        ).rowcount == 1
        if admitted:
            conn.execute(usage_events.insert().values(
                id=params["gid"], org_id=params["org"], api_key_id=params["key"],
                model=params["model"], stream=params["stream"], status="pending",
                hold_nanos=params["hold"], started_at=params["now"]))
            conn.execute(in_flight.insert().values(
                generation_id=params["gid"], org_id=params["org"], hold_nanos=params["hold"],
                expires_at=params["expires"]))
        return admitted


def _rejection(engine, principal, hold_nanos):
    with engine.connect() as conn:
        row = conn.execute(sa.select(credit_balances).where(
            credit_balances.c.org_id == principal.org_id)).first()
    if row is not None and row.in_flight >= principal.in_flight_limit:
        return RateLimited(f"Too many requests in flight: this organization's limit is "
                           f"{principal.in_flight_limit} at once. Retry with backoff.")
    available = from_nanos(row.balance_nanos - row.held_nanos) if row else Decimal(0)
    return InsufficientCredits(
        f"Insufficient credits: {available} USD available, this request needs a hold of "
        f"{from_nanos(hold_nanos)} USD (its worst-case cost). Top up, or lower max_tokens.")


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


_PG_SETTLE = sa.text("""
WITH event AS (
  UPDATE usage_events
     SET status = :status, prompt_tokens = :prompt, cached_tokens = :cached,
         completion_tokens = :completion, cost_nanos = LEAST(:cost, hold_nanos),
         estimated = :estimated, http_status = :http_status, error = :error,
         backend = COALESCE(:backend, backend),
         first_token_at = COALESCE(:first_token_at, first_token_at), ended_at = :now
   WHERE id = :gid AND status = 'pending'
  RETURNING org_id, hold_nanos, cost_nanos
), lease AS (
  DELETE FROM in_flight WHERE generation_id = :gid AND EXISTS (SELECT 1 FROM event)
)
UPDATE credit_balances b
   SET balance_nanos = b.balance_nanos - event.cost_nanos,
       held_nanos = b.held_nanos - event.hold_nanos, in_flight = b.in_flight - 1
  FROM event WHERE b.org_id = event.org_id
RETURNING event.cost_nanos
""")


def settle(engine, gid, outcome):
    """Close usage event ``gid`` with ``outcome``, debit its cost, release hold and lease.

    Exactly once: a second call for the same generation changes nothing and returns None.
    The debit is capped at the hold, so a balance never goes below zero.

    :returns: the debited cost in nano-dollars, or None when ``gid`` was already settled.
    """
    u = outcome.usage
    params = {"gid": gid, "status": outcome.status, "prompt": u.prompt, "cached": u.cached,
              "completion": u.completion, "cost": outcome.cost_nanos, "estimated": u.estimated,
              "http_status": outcome.http_status, "error": outcome.error,
              "backend": outcome.backend, "first_token_at": outcome.first_token_at,
              "now": utcnow()}
    if is_postgres(engine):
        with engine.begin() as conn:
            row = conn.execute(_PG_SETTLE, params).first()
        return None if row is None else row[0]
    return _settle_generic(engine, params)


def _settle_generic(engine, params):
    ev = usage_events.c
    with engine.begin() as conn:
        row = conn.execute(
            usage_events.update().where(ev.id == params["gid"], ev.status == "pending")
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
