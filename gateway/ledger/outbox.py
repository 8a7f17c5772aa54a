"""The webhook outbox on Postgres: events written in the transaction of what caused them, and
the statements the deliverers claim and finish them with (docs/WEBHOOKS.md).

Events and where they are written:

- ``balance.low``: a trigger on ``credit_balances`` when a debit (a settlement, the sweeper, a
  negative grant) takes the balance from at or above a webhook's ``balance_below_usd`` to
  below it; one crossing, one event (a top-up above the threshold arms it again).
- ``key.limit_reached``: a trigger on ``api_keys`` when a key's spend in its period reaches its
  spend limit, and :func:`record_refusal` when admission refuses a request for the key's
  limit; at most one per key, period and limit (``dedup_key``).
- ``credits.refused``: :func:`record_refusal` when admission refuses a request for the org's
  credits (402 ``insufficient_credits``); at most one per org between two grants.
- ``key.expiring``: :func:`scan_expiring`, for keys with an ``expires_at`` within the window
  (only where ``api_keys`` has that column); at most one per key and expiry.

The refusals leave nothing else behind (``kiln_admit`` writes nothing for them), so their row
is written by the ledger in its own short transaction, right after the refusal.

Delivery: :func:`claim` takes due events with ``FOR UPDATE SKIP LOCKED`` and marks them taken
for ``claim_s`` (their attempt counted) in one short transaction, so that no connection stays
open while a receiver answers and several workers and hosts never take the same event; a
worker that dies with a claim leaves it to be taken again after ``claim_s`` (at least once).
:func:`finish` records the attempt's outcome under that attempt number.
"""
import os
import socket

import sqlalchemy as sa

EVENTS = ("balance.low", "key.limit_reached", "key.expiring", "credits.refused")

SECRET_FUNCTION = r"""CREATE OR REPLACE FUNCTION kiln_webhook_secret() RETURNS text
LANGUAGE sql VOLATILE AS $$
  -- whsec_ + base64 of 32 bytes from two version 4 UUIDs (244 random bits: gen_random_uuid
  -- draws from the server's strong random source); Kiln's CLI draws its own 32 bytes.
  SELECT 'whsec_' || encode(decode(replace(gen_random_uuid()::text, '-', '')
                                   || replace(gen_random_uuid()::text, '-', ''), 'hex'),
                            'base64')
$$"""

USD_FUNCTION = """CREATE OR REPLACE FUNCTION kiln_usd(p_nanos bigint) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
  -- Nano-dollars as an exact decimal string of USD (9 places).
  SELECT CAST(CAST(p_nanos AS numeric) / 1000000000 AS numeric(30, 9))::text
$$"""

EMIT_FUNCTION = """CREATE OR REPLACE FUNCTION kiln_webhook_emit(
  p_org integer, p_type text, p_dedup text, p_data jsonb)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
  v_rows integer;
BEGIN
  -- One outbox row per webhook of the org that wants p_type; p_dedup makes a second call for
  -- the same occurrence write nothing. The body is the Standard Webhooks payload shape.
  INSERT INTO webhook_outbox (webhook_id, event_type, dedup_key, payload)
  SELECT w.id, p_type, p_dedup,
         jsonb_build_object('type', p_type,
                            'timestamp', to_char(clock_timestamp() AT TIME ZONE 'UTC',
                                                 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
                            'data', p_data)::text
    FROM webhooks w
   WHERE w.org_id = p_org AND p_type = ANY(string_to_array(replace(w.events, ' ', ''), ','))
  ON CONFLICT (webhook_id, dedup_key) DO NOTHING;
  GET DIAGNOSTICS v_rows = ROW_COUNT;
  RETURN v_rows;
END $$"""

BALANCE_LOW_FUNCTION = """CREATE OR REPLACE FUNCTION kiln_webhook_balance_low() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
  -- Each webhook whose threshold this debit crossed, from at or above to below.
  INSERT INTO webhook_outbox (webhook_id, event_type, payload)
  SELECT w.id, 'balance.low',
         jsonb_build_object('type', 'balance.low',
                            'timestamp', to_char(clock_timestamp() AT TIME ZONE 'UTC',
                                                 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
                            'data', jsonb_build_object(
                              'org_id', NEW.org_id, 'org', o.name,
                              'balance_usd', kiln_usd(NEW.balance_nanos),
                              'threshold_usd', CAST(w.balance_below_usd AS numeric(30, 9))::text))
                            ::text
    FROM webhooks w JOIN orgs o ON o.id = w.org_id
   WHERE w.org_id = NEW.org_id AND w.balance_below_usd IS NOT NULL
     AND 'balance.low' = ANY(string_to_array(replace(w.events, ' ', ''), ','))
     AND OLD.balance_nanos >= CAST(ROUND(w.balance_below_usd * 1000000000) AS bigint)
     AND NEW.balance_nanos < CAST(ROUND(w.balance_below_usd * 1000000000) AS bigint);
  RETURN NULL;
END $$"""

BALANCE_LOW_TRIGGER = """CREATE TRIGGER webhook_balance_low
AFTER UPDATE OF balance_nanos ON credit_balances FOR EACH ROW
WHEN (NEW.balance_nanos < OLD.balance_nanos)
EXECUTE FUNCTION kiln_webhook_balance_low()"""

KEY_LIMIT_FUNCTION = """CREATE OR REPLACE FUNCTION kiln_webhook_key_limit(
  p_key integer, p_cause text, p_hold bigint DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
  k api_keys%ROWTYPE;
  v_period timestamptz;
  v_spent bigint;
BEGIN
  SELECT * INTO k FROM api_keys WHERE id = p_key;
  IF NOT FOUND OR k.limit_usd IS NULL THEN
    RETURN 0;
  END IF;
  v_period := kiln_period_start(k.limit_reset, clock_timestamp());
  v_spent := CASE WHEN k.period_start IS DISTINCT FROM v_period THEN 0
                  ELSE k.period_spent_nanos END;
  -- One per key, period and limit, whether the spend reached it or a request was refused.
  RETURN kiln_webhook_emit(k.org_id, 'key.limit_reached',
    'key.limit_reached:' || k.id || ':' || COALESCE(extract(epoch FROM v_period)::bigint::text,
                                                    'never') || ':' || k.limit_usd::text,
    jsonb_build_object('org_id', k.org_id, 'key_id', k.id, 'key_prefix', k.prefix,
                       'key_label', k.name,
                       'limit_usd', CAST(k.limit_usd AS numeric(30, 9))::text,
                       'limit_reset', k.limit_reset,
                       'spent_usd', kiln_usd(v_spent), 'held_usd', kiln_usd(k.held_nanos),
                       'period_start', v_period, 'cause', p_cause,
                       'refused_hold_usd', kiln_usd(p_hold)));
END $$"""

KEY_LIMIT_TRIGGER_FUNCTION = """CREATE OR REPLACE FUNCTION kiln_webhook_key_spent()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM kiln_webhook_key_limit(NEW.id, 'spent');
  RETURN NULL;
END $$"""

KEY_LIMIT_TRIGGER = """CREATE TRIGGER webhook_key_limit_reached
AFTER UPDATE OF period_spent_nanos ON api_keys FOR EACH ROW
WHEN (NEW.limit_usd IS NOT NULL
      AND NEW.period_spent_nanos >= CAST(ROUND(NEW.limit_usd * 1000000000) AS bigint)
      AND (OLD.period_spent_nanos < CAST(ROUND(NEW.limit_usd * 1000000000) AS bigint)
           OR OLD.period_start IS DISTINCT FROM NEW.period_start))
EXECUTE FUNCTION kiln_webhook_key_spent()"""

CREDITS_REFUSED_FUNCTION = """CREATE OR REPLACE FUNCTION kiln_webhook_credits_refused(
  p_org integer, p_hold bigint) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
  b credit_balances%ROWTYPE;
  v_grant integer;
BEGIN
  SELECT * INTO b FROM credit_balances WHERE org_id = p_org;
  SELECT max(id) INTO v_grant FROM credit_grants WHERE org_id = p_org;
  -- One per org between two grants: the first refusal after a top-up tells, the next are
  -- the same news.
  RETURN kiln_webhook_emit(p_org, 'credits.refused',
    'credits.refused:' || p_org || ':' || COALESCE(v_grant, 0),
    jsonb_build_object('org_id', p_org, 'org', (SELECT name FROM orgs WHERE id = p_org),
                       'code', 'insufficient_credits',
                       'balance_usd', kiln_usd(COALESCE(b.balance_nanos, 0)),
                       'held_usd', kiln_usd(COALESCE(b.held_nanos, 0)),
                       'available_usd', kiln_usd(COALESCE(b.balance_nanos - b.held_nanos, 0)),
                       'refused_hold_usd', kiln_usd(p_hold)));
END $$"""

# In creation order; dropped in reverse by the migration's downgrade.
FUNCTIONS = (SECRET_FUNCTION, USD_FUNCTION, EMIT_FUNCTION, BALANCE_LOW_FUNCTION,
             KEY_LIMIT_FUNCTION, KEY_LIMIT_TRIGGER_FUNCTION, CREDITS_REFUSED_FUNCTION)
TRIGGERS = (BALANCE_LOW_TRIGGER, KEY_LIMIT_TRIGGER)
DROP = ("DROP TRIGGER IF EXISTS webhook_key_limit_reached ON api_keys",
        "DROP TRIGGER IF EXISTS webhook_balance_low ON credit_balances",
        "DROP FUNCTION IF EXISTS kiln_webhook_credits_refused(integer, bigint)",
        "DROP FUNCTION IF EXISTS kiln_webhook_key_spent()",
        "DROP FUNCTION IF EXISTS kiln_webhook_key_limit(integer, text, bigint)",
        "DROP FUNCTION IF EXISTS kiln_webhook_balance_low()",
        "DROP FUNCTION IF EXISTS kiln_webhook_emit(integer, text, text, jsonb)",
        "DROP FUNCTION IF EXISTS kiln_usd(bigint)",
        "DROP FUNCTION IF EXISTS kiln_webhook_secret()")


def record_refusal(conn, reason, org_id, key_id, hold_nanos):
    """Write the outbox rows of a 402 refusal (``reason`` ``credits`` or ``key_limit``, as
    ``kiln_admit`` names it) on ``conn`` (a SQLAlchemy connection in a transaction); return how
    many were written (0: no webhook wants it, or it was told already)."""
    if reason == "credits":
        sql, params = "SELECT kiln_webhook_credits_refused(:org, :hold)", {
            "org": org_id, "hold": hold_nanos}
    else:
        sql, params = "SELECT kiln_webhook_key_limit(:key, 'refused', :hold)", {
            "key": key_id, "hold": hold_nanos}
    return conn.execute(sa.text(sql), params).scalar_one()


EXPIRING = """SELECT COALESCE(SUM(kiln_webhook_emit(
    k.org_id, 'key.expiring',
    'key.expiring:' || k.id || ':' || extract(epoch FROM k.expires_at)::bigint,
    jsonb_build_object('org_id', k.org_id, 'key_id', k.id, 'key_prefix', k.prefix,
                       'key_label', k.name, 'expires_at', k.expires_at))), 0)
  FROM api_keys k
 WHERE k.revoked_at IS NULL AND k.expires_at > now()
   AND k.expires_at <= now() + make_interval(secs => :window_s)
   AND k.org_id IN (SELECT org_id FROM webhooks
                     WHERE 'key.expiring' = ANY(string_to_array(replace(events, ' ', ''), ',')))"""


def scan_expiring(engine, window_s):
    """Write a ``key.expiring`` event for each unrevoked key expiring within ``window_s``
    seconds whose org has a webhook for it; return how many were written, or None when
    ``api_keys`` has no ``expires_at`` column (keys do not expire on this database)."""
    with engine.begin() as conn:
        if not conn.execute(sa.text(
                "SELECT 1 FROM information_schema.columns WHERE table_schema = "
                "current_schema() AND table_name = 'api_keys' AND column_name = 'expires_at'"
                )).first():
            return None
        return int(conn.execute(sa.text(EXPIRING), {"window_s": window_s}).scalar_one())


CLAIM = """WITH due AS (
  SELECT o.id FROM webhook_outbox o
   WHERE o.status = 'pending' AND o.next_attempt_at <= now() AND o.attempts < :max_attempts
   ORDER BY o.next_attempt_at, o.id LIMIT :batch FOR UPDATE SKIP LOCKED)
UPDATE webhook_outbox o SET attempts = o.attempts + 1,
                            next_attempt_at = now() + make_interval(secs => :claim_s)
  FROM due, webhooks w
 WHERE o.id = due.id AND w.id = o.webhook_id
RETURNING o.id, o.attempts, o.event_type, o.payload, w.url, w.secret, w.allow_private"""

# A claim whose worker died on its last attempt: nobody will report it.
GIVE_UP = """UPDATE webhook_outbox SET status = 'failed', finished_at = now()
 WHERE status = 'pending' AND attempts >= :max_attempts AND next_attempt_at <= now()"""

FINISH = """UPDATE webhook_outbox
   SET status = CASE WHEN :delivered THEN 'delivered'
                     WHEN attempts >= :max_attempts THEN 'failed' ELSE 'pending' END,
       finished_at = CASE WHEN :delivered OR attempts >= :max_attempts THEN now() END,
       next_attempt_at = now() + make_interval(secs => LEAST(
         :backoff_s * power(2, attempts - 1), :backoff_max_s))
 WHERE id = :id AND attempts = :attempt AND status = 'pending'
RETURNING status"""

LOG = """INSERT INTO webhook_deliveries (outbox_id, attempt, status_code, error, duration_ms,
                                     deliverer)
VALUES (:id, :attempt, :status_code, :error, :duration_ms, :deliverer)"""

DEPTH = "SELECT count(*) FROM webhook_outbox WHERE status = 'pending'"


def claim(engine, batch, claim_s, max_attempts):
    """Take up to ``batch`` due events for this worker for ``claim_s`` seconds; return their
    rows (``id``, ``attempts``: this attempt's number, ``event_type``, ``payload``, ``url``,
    ``secret``, ``allow_private``). Events whose last claim lapsed on their last attempt are
    marked failed; return ``(rows, given_up)``."""
    limits = {"max_attempts": max_attempts}
    with engine.begin() as conn:
        given_up = conn.execute(sa.text(GIVE_UP), limits).rowcount
        rows = conn.execute(sa.text(CLAIM), {**limits, "batch": batch,
                                             "claim_s": claim_s}).mappings().all()
    return rows, given_up


def finish(engine, row, outcome, retry):
    """Record the attempt ``row`` (from :func:`claim`) made: ``outcome`` has ``delivered``
    (bool), ``status_code`` (int or None), ``error`` (text or None), ``duration_ms``; ``retry``
    is ``(max_attempts, backoff_s, backoff_max_s)``. Return the event's status now
    (``delivered``, ``pending``: tried again after the backoff, ``failed``), or None when the
    claim had lapsed and another worker took the event."""
    max_attempts, backoff_s, backoff_max_s = retry
    with engine.begin() as conn:
        conn.execute(sa.text(LOG), {"id": row["id"], "attempt": row["attempts"],
                                    "status_code": outcome["status_code"],
                                    "error": outcome["error"],
                                    "duration_ms": outcome["duration_ms"],
                                    "deliverer": deliverer()})
        return conn.execute(sa.text(FINISH), {
            "id": row["id"], "attempt": row["attempts"], "delivered": outcome["delivered"],
            "max_attempts": max_attempts, "backoff_s": backoff_s,
            "backoff_max_s": backoff_max_s}).scalar()


def depth(engine):
    """Return how many events wait for delivery (pending)."""
    with engine.connect() as conn:
        return conn.execute(sa.text(DEPTH)).scalar_one()


def deliverer():
    """Return this worker's name in the delivery log: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"[:200]
