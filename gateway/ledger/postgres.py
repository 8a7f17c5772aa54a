"""The ledger on Postgres: four functions, each one round trip, called on raw psycopg connections.

The functions are installed by the migrations (``FUNCTIONS``, ``CREATE OR REPLACE``): PL/pgSQL
caches each statement's plan per server connection, so the statements are prepared once per
connection, also through pgbouncer in transaction mode, where protocol-level prepared statements
need pgbouncer 1.21 or later (Kiln turns psycopg's off; ``gateway.db``). Row locks are taken in
the order the package docstring gives.
"""
import psycopg
import sqlalchemy as sa

from ..errors import ServiceUnavailable
from ..endings import Status
from .responses import dumps  # JSON text: orjson, the standard library for what it refuses

# The usage-event statuses the functions below name, spelled by the one enum of them.
PENDING, ABANDONED, COMPLETED, CANCELLED, INTERRUPTED = (
    Status.PENDING.value, Status.ABANDONED.value, Status.COMPLETED.value,
    Status.CLIENT_CANCELLED.value, Status.INTERRUPTED.value)

SETTLEMENT_TYPE = """CREATE TYPE kiln_settlement AS (
  gid text, org integer, key integer, model text, stream boolean, status text,
  prompt integer, cached integer, completion integer, cost bigint, hold bigint,
  http_status integer, error text, error_code text, backend text, attempts text,
  anomaly boolean, estimated boolean, started_at timestamptz, first_token_at timestamptz,
  expired_before timestamptz)"""
# Migration 0014 adds the attributes ``prompt_by text, completion_by text`` (which count each
# kind of token is: gateway.billing.COUNTED_BY) to the type above, as created by 0003.
SETTLEMENT_COUNTED_BY = ("ALTER TYPE kiln_settlement ADD ATTRIBUTE prompt_by text, "
                         "ADD ATTRIBUTE completion_by text")

PERIOD_START = """CREATE OR REPLACE FUNCTION kiln_period_start(p_reset text, p_at timestamptz)
RETURNS timestamptz LANGUAGE sql IMMUTABLE AS $$
  -- The start of the UTC day, ISO week or month holding p_at; NULL for a limit that never resets.
  SELECT (CASE p_reset WHEN 'daily' THEN date_trunc('day', p_at AT TIME ZONE 'UTC')
                       WHEN 'weekly' THEN date_trunc('week', p_at AT TIME ZONE 'UTC')
                       WHEN 'monthly' THEN date_trunc('month', p_at AT TIME ZONE 'UTC')
          END) AT TIME ZONE 'UTC'
$$"""

ADMIT = f"""CREATE OR REPLACE FUNCTION kiln_admit(
  p_gid text, p_org integer, p_key integer, p_model text, p_stream boolean, p_hold bigint,
  p_limit integer, p_ttl_s double precision, p_key_checks boolean,
  p_endpoint text DEFAULT 'chat')
RETURNS TABLE (gid text, started_at timestamptz, reason text, available bigint,
               in_flight integer, expired boolean, key_remaining bigint,
               period_start timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
  v_now timestamptz := clock_timestamp();
  v_key api_keys%ROWTYPE;
  v_period timestamptz;
  v_spent bigint;
  v_limit bigint;
  v_rate integer;
  v_leases integer;
  v_minute timestamptz := date_trunc('minute', v_now);
BEGIN
  -- Not durable at once: an admission lost in a crash is written by its settlement.
  PERFORM set_config('synchronous_commit', 'off', true);
  -- The org's row decides, under its lock: concurrent admissions of one org wait here and
  -- re-check the condition on the newest row, so the limit and credits are exact.
  UPDATE credit_balances b SET in_flight = b.in_flight + 1, held_nanos = b.held_nanos + p_hold
   WHERE b.org_id = p_org AND b.in_flight < p_limit AND b.balance_nanos - b.held_nanos >= p_hold;
  IF NOT FOUND THEN
    RETURN QUERY
      SELECT NULL::text, NULL::timestamptz,
             CASE WHEN b.in_flight >= p_limit THEN 'in_flight'
                  WHEN b.balance_nanos - b.held_nanos < p_hold THEN 'credits' ELSE 'retry' END,
             b.balance_nanos - b.held_nanos, b.in_flight,
             EXISTS (SELECT 1 FROM in_flight f WHERE f.org_id = p_org AND f.expires_at < v_now),
             NULL::bigint, NULL::timestamptz
        FROM credit_balances b WHERE b.org_id = p_org;
    RETURN;
  END IF;
  IF p_key_checks THEN
    SELECT * INTO v_key FROM api_keys k WHERE k.id = p_key FOR UPDATE;
    v_period := kiln_period_start(v_key.limit_reset, v_now);
    v_spent := CASE WHEN v_key.period_start IS DISTINCT FROM v_period THEN 0
                    ELSE v_key.period_spent_nanos END;
    v_limit := CAST(ROUND(v_key.limit_usd * 1000000000) AS bigint);
    v_rate := CASE WHEN v_key.rate_window = v_minute THEN v_key.rate_count ELSE 0 END;
    -- The key's in-flight cap counts its lease rows, read under the key's row lock (a new
    -- snapshot per statement: every admission that held the lock before has committed its
    -- lease); a lease deleted anywhere (settlement, the sweeper) no longer counts.
    SELECT count(*) INTO v_leases FROM in_flight f
     WHERE v_key.in_flight_limit IS NOT NULL AND f.api_key_id = p_key;
    IF (v_key.in_flight_limit IS NOT NULL AND v_leases >= v_key.in_flight_limit)
       OR (v_key.rpm_limit IS NOT NULL AND v_rate >= v_key.rpm_limit)
       OR (v_limit IS NOT NULL AND v_spent + v_key.held_nanos + p_hold > v_limit) THEN
      -- Give the org's slot and hold back: this statement holds its row lock, nobody saw them.
      UPDATE credit_balances b SET in_flight = b.in_flight - 1,
                                   held_nanos = b.held_nanos - p_hold WHERE b.org_id = p_org;
      RETURN QUERY SELECT NULL::text, NULL::timestamptz,
        CASE WHEN v_key.in_flight_limit IS NOT NULL AND v_leases >= v_key.in_flight_limit
             THEN 'key_in_flight'
             WHEN v_key.rpm_limit IS NOT NULL AND v_rate >= v_key.rpm_limit THEN 'rate'
             ELSE 'key_limit' END,
        NULL::bigint, v_leases,
        EXISTS (SELECT 1 FROM in_flight f WHERE f.api_key_id = p_key AND f.expires_at < v_now),
        v_limit - v_spent - v_key.held_nanos, v_period;
      RETURN;
    END IF;
    UPDATE api_keys k SET period_start = v_period, period_spent_nanos = v_spent,
                          held_nanos = k.held_nanos + p_hold, rate_window = v_minute,
                          rate_count = v_rate + 1
     WHERE k.id = p_key;
  END IF;
  INSERT INTO usage_events (id, org_id, api_key_id, model, stream, status, hold_nanos,
                            started_at, endpoint)
  VALUES (p_gid, p_org, p_key, p_model, p_stream, '{PENDING}', p_hold, v_now, p_endpoint);
  INSERT INTO in_flight (generation_id, org_id, hold_nanos, key_hold_nanos, expires_at,
                         api_key_id)
  VALUES (p_gid, p_org, p_hold, CASE WHEN p_key_checks THEN p_hold ELSE 0 END,
          v_now + p_ttl_s * interval '1 second', p_key);
  RETURN QUERY SELECT p_gid, v_now, NULL::text, NULL::bigint, NULL::integer, false,
                      NULL::bigint, NULL::timestamptz;
END $$"""

ADMIT_BATCH = """CREATE OR REPLACE FUNCTION kiln_admit_batch(p_batch jsonb)
RETURNS TABLE (idx integer, gid text, started_at timestamptz, reason text, available bigint,
               in_flight integer, expired boolean, key_remaining bigint,
               period_start timestamptz)
LANGUAGE plpgsql AS $$
DECLARE
  r record;
BEGIN
  -- The batch comes ordered by org: every batch takes org rows in the same order. A request
  -- whose org has no balance row gets a row of NULLs.
  FOR r IN SELECT (x.ordinality - 1)::integer AS i, x.value AS a
             FROM jsonb_array_elements(p_batch) WITH ORDINALITY x LOOP
    RETURN QUERY
      SELECT r.i, k.* FROM kiln_admit(r.a->>'gid', (r.a->>'org')::integer,
                                      (r.a->>'key')::integer, r.a->>'model',
                                      (r.a->>'stream')::boolean, (r.a->>'hold')::bigint,
                                      (r.a->>'limit')::integer, (r.a->>'ttl')::float8,
                                      (r.a->>'key_checks')::boolean,
                                      COALESCE(r.a->>'endpoint', 'chat')) k;
  END LOOP;
END $$"""

SETTLE = f"""CREATE OR REPLACE FUNCTION kiln_settle(p_batch jsonb)
RETURNS TABLE (gid text, debited bigint)
LANGUAGE plpgsql
-- Each statement is planned once per session, not at every call: the batch is a parameter, so
-- a plan made for one batch fits every other (ids are looked up through the primary key), and
-- planning the statements below cost more than running them (PostgreSQL manual, "Plan
-- Caching" under PL/pgSQL, and the plan_cache_mode setting).
-- Every row is reached through its key with = ANY(an array), and never by a sequential scan
-- (migration 0020): a plan made once must not keep scanning a table that the planner took for
-- small when it made it (enable_seqscan only prices such a scan out where an index serves).
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off AS $$
DECLARE
  v_now timestamptz := clock_timestamp();
  -- The batch, parsed once.
  v_rows kiln_settlement[] := ARRAY(SELECT x FROM jsonb_populate_recordset(
                                      NULL::kiln_settlement, p_batch) x);
  v_gids text[] := ARRAY(SELECT r.gid FROM unnest(v_rows) r);
  v_ids text[];
  v_lost text[];
BEGIN
  -- Durable: the commit waits for the disk (what a client is told it paid must survive a
  -- crash of the database and of the worker together); batches share one flush.
  -- 1. The batch's events, locked in id order: pending ones, and ones the sweeper closed as
  --    abandoned while their worker was in fact alive (its real settlement corrects them).
  --    The sweeper's entries count only if their lease is still expired once the event is
  --    locked (renewal locks the event first).
  SELECT array_agg(e.id) INTO v_ids FROM (
    SELECT e.id FROM usage_events e
     WHERE e.id = ANY(v_gids)
       AND e.status IN ('{PENDING}', '{ABANDONED}')
     ORDER BY e.id FOR UPDATE) e;
  SELECT array_agg(s.gid) INTO v_ids
    FROM unnest(v_rows) s
    JOIN usage_events e ON e.id = s.gid
   WHERE s.gid = ANY(v_ids) AND e.id = ANY(v_ids)
     AND CASE WHEN s.expired_before IS NULL THEN true
              WHEN e.status = '{PENDING}' THEN EXISTS (
                SELECT 1 FROM in_flight f WHERE f.generation_id = s.gid
                                            AND f.expires_at < s.expired_before)
              ELSE false END;
  -- Admissions lost in a database crash (no event at all): written here, with no hold.
  SELECT array_agg(s.gid) INTO v_lost
    FROM unnest(v_rows) s
   WHERE s.expired_before IS NULL
     AND NOT EXISTS (SELECT 1 FROM usage_events e WHERE e.id = s.gid);
  INSERT INTO usage_events (id, org_id, api_key_id, model, stream, status, hold_nanos,
                            started_at)
  SELECT s.gid, s.org, s.key, s.model, s.stream, '{PENDING}', 0, COALESCE(s.started_at, v_now)
    FROM unnest(v_rows) s
   WHERE s.gid = ANY(v_lost)
  ON CONFLICT (id) DO NOTHING;
  v_ids := COALESCE(v_ids, '{{}}') || COALESCE(v_lost, '{{}}');
  -- 2. The orgs' balance rows, locked in org order (keys and daily rows belong to an org).
  PERFORM 1 FROM credit_balances b
   WHERE b.org_id = ANY(ARRAY(SELECT e.org_id FROM usage_events e WHERE e.id = ANY(v_ids)))
   ORDER BY b.org_id FOR UPDATE;
  -- 3. Everything else, in one statement on the locked rows. A generation may take what it
  --    holds (a pending one: its hold; a corrected one: what it was charged) plus what its org
  --    has free and its key's spend limit leaves, shared in id order: a backend that reported
  --    more than the hold is billed in full while the balance and the key's limit allow it (the
  --    key's row is read under the org's lock, which every admission on it takes first). A
  --    correction moves the balance, the key's spend and
  --    the daily rollup by the difference from what the sweeper wrote.
  RETURN QUERY
  WITH s AS (SELECT * FROM unnest(v_rows) x
              WHERE x.gid = ANY(v_ids)),
  lease AS (DELETE FROM in_flight f USING s WHERE f.generation_id = s.gid
                                              AND f.generation_id = ANY(v_ids)
            RETURNING f.generation_id, f.key_hold_nanos),
  -- The events, read apart (MATERIALIZED) through their key: joined in one query with the
  -- balance rows, a plan could reach them through the org (every event the org ever had) once
  -- the balance table's statistics were fresher than usage_events' (migration 0021).
  j AS MATERIALIZED (
        SELECT s.*, e.org_id, e.api_key_id, e.endpoint, e.hold_nanos, e.started_at AS began,
               COALESCE(l.key_hold_nanos, 0) AS key_hold, (l.generation_id IS NOT NULL) AS leased,
               (e.status = '{ABANDONED}') AS fix,
               CASE WHEN e.status = '{ABANDONED}' THEN e.cost_nanos ELSE e.hold_nanos END AS base,
               CASE WHEN e.status = '{ABANDONED}' THEN e.cost_nanos ELSE 0 END AS was_cost,
               CASE WHEN e.status = '{ABANDONED}' THEN e.prompt_tokens ELSE 0 END AS was_prompt,
               CASE WHEN e.status = '{ABANDONED}' THEN e.cached_tokens ELSE 0 END AS was_cached,
               CASE WHEN e.status = '{ABANDONED}' THEN e.completion_tokens ELSE 0 END
                 AS was_completion
          FROM s JOIN usage_events e ON e.id = s.gid AND e.id = ANY(v_ids)
          LEFT JOIN lease l ON l.generation_id = s.gid),
  d AS (SELECT j.*, CAST(LEAST(j.cost, j.base + GREATEST(0, LEAST(
                   b.balance_nanos - b.held_nanos
                   - (SUM(GREATEST(j.cost - j.base, 0)) OVER w - GREATEST(j.cost - j.base, 0)),
                   -- and what the key's spend limit leaves (NULL, so ignored, with no limit)
                   CAST(ROUND(k.limit_usd * 1000000000) AS bigint) - k.held_nanos
                   - CASE WHEN k.period_start IS DISTINCT FROM
                               kiln_period_start(k.limit_reset, v_now)
                          THEN 0 ELSE k.period_spent_nanos END
                   - (SUM(GREATEST(j.cost - j.base, 0)) OVER wk
                      - GREATEST(j.cost - j.base, 0))))) AS bigint) AS debit
          FROM j JOIN credit_balances b ON b.org_id = j.org_id
          LEFT JOIN api_keys k ON k.id = j.api_key_id
        WINDOW w AS (PARTITION BY j.org_id ORDER BY j.gid),
               wk AS (PARTITION BY j.api_key_id ORDER BY j.gid)),
  ev AS (UPDATE usage_events e
            SET status = d.status, prompt_tokens = d.prompt, cached_tokens = d.cached,
                completion_tokens = d.completion, cost_nanos = d.debit,
                estimated = d.estimated, prompt_counted_by = d.prompt_by,
                completion_counted_by = d.completion_by, http_status = d.http_status,
                error = d.error,
                error_code = d.error_code, backend = COALESCE(d.backend, e.backend),
                attempts = COALESCE(d.attempts, e.attempts),
                anomaly = COALESCE(d.anomaly, false) OR d.debit < d.cost,
                first_token_at = COALESCE(d.first_token_at, e.first_token_at),
                ended_at = v_now
           FROM d WHERE e.id = d.gid RETURNING e.id),
  bal AS (UPDATE credit_balances b
             SET balance_nanos = b.balance_nanos - t.debit, held_nanos = b.held_nanos - t.hold,
                 in_flight = b.in_flight - t.leases
            FROM (SELECT d.org_id, SUM(d.debit - d.was_cost) AS debit,
                         SUM(CASE WHEN d.leased THEN d.hold_nanos ELSE 0 END) AS hold,
                         COUNT(*) FILTER (WHERE d.leased) AS leases
                    FROM d GROUP BY d.org_id) t
           WHERE b.org_id = t.org_id AND b.org_id = ANY(ARRAY(SELECT d.org_id FROM d))
          RETURNING b.org_id),
  keys AS (UPDATE api_keys k
              SET period_spent_nanos = CASE
                    WHEN k.period_start IS DISTINCT FROM kiln_period_start(k.limit_reset, v_now)
                    THEN t.debit ELSE k.period_spent_nanos + t.debit END,
                  period_start = kiln_period_start(k.limit_reset, v_now),
                  held_nanos = k.held_nanos - t.key_hold
             FROM (SELECT d.api_key_id, SUM(d.debit - d.was_cost) AS debit,
                          SUM(d.key_hold) AS key_hold
                     FROM d GROUP BY d.api_key_id) t
            WHERE k.id = t.api_key_id AND k.id = ANY(ARRAY(SELECT d.api_key_id FROM d))
           RETURNING k.id),
  daily AS (INSERT INTO usage_daily AS u (org_id, day, model, api_key_id, endpoint, requests,
                                          errors, prompt_tokens, cached_tokens,
                                          completion_tokens, cost_nanos)
            SELECT d.org_id, CAST(d.began AT TIME ZONE 'UTC' AS date), d.model, d.api_key_id,
                   d.endpoint,
                   COUNT(*) FILTER (WHERE NOT d.fix),
                   SUM(CASE WHEN d.status NOT IN ('{COMPLETED}', '{CANCELLED}', '{INTERRUPTED}')
                            THEN 1 ELSE 0 END
                       - CASE WHEN d.fix THEN 1 ELSE 0 END),
                   SUM(d.prompt - d.was_prompt), SUM(d.cached - d.was_cached),
                   SUM(d.completion - d.was_completion), SUM(d.debit - d.was_cost)
              FROM d GROUP BY 1, 2, 3, 4, 5
            ON CONFLICT (org_id, day, model, api_key_id, endpoint) DO UPDATE
               SET requests = u.requests + EXCLUDED.requests,
                   errors = u.errors + EXCLUDED.errors,
                   prompt_tokens = u.prompt_tokens + EXCLUDED.prompt_tokens,
                   cached_tokens = u.cached_tokens + EXCLUDED.cached_tokens,
                   completion_tokens = u.completion_tokens + EXCLUDED.completion_tokens,
                   cost_nanos = u.cost_nanos + EXCLUDED.cost_nanos
            RETURNING 1)
  SELECT d.gid, d.debit FROM d;
END $$"""

RENEW = f"""CREATE OR REPLACE FUNCTION kiln_renew(
  p_ids text[], p_prompt integer[], p_cached integer[], p_completion integer[],
  p_ttl_s double precision)
RETURNS TABLE (gid text, state text)
LANGUAGE plpgsql
-- Every event is reached through its id, never by a sequential scan (migration 0022): a plan
-- kept while usage_events was small went on scanning it as it grew, until its next analyze.
SET enable_seqscan = off AS $$
DECLARE
  v_now timestamptz := clock_timestamp();
  v_locked text[];
BEGIN
  PERFORM set_config('synchronous_commit', 'off', true);
  -- Events being settled right now are skipped, not waited for: their lease goes with them.
  SELECT array_agg(e.id) INTO v_locked FROM (
    SELECT e.id FROM usage_events e WHERE e.id = ANY(p_ids) AND e.status = '{PENDING}'
     ORDER BY e.id FOR UPDATE SKIP LOCKED) e;
  UPDATE usage_events e SET prompt_tokens = p.prompt, cached_tokens = p.cached,
                            completion_tokens = p.completion, estimated = true
    FROM unnest(p_ids, p_prompt, p_cached, p_completion) AS p(id, prompt, cached, completion)
   WHERE e.id = p.id AND e.id = ANY(v_locked) AND p.prompt >= 0;
  UPDATE in_flight f SET expires_at = v_now + p_ttl_s * interval '1 second'
   WHERE f.generation_id = ANY(v_locked);
  RETURN QUERY
    SELECT i.id, CASE WHEN i.id = ANY(COALESCE(v_locked, '{{}}')) THEN 'leased'
                      WHEN e.id IS NULL THEN 'missing'
                      WHEN e.status = '{PENDING}' THEN 'busy' ELSE 'settled' END
      FROM unnest(p_ids) AS i(id)
      LEFT JOIN usage_events e ON e.id = i.id AND e.id = ANY(p_ids);
END $$"""

FUNCTIONS = (PERIOD_START, ADMIT, ADMIT_BATCH, SETTLE, RENEW)
DROP = ("DROP FUNCTION IF EXISTS kiln_renew(text[], integer[], integer[], integer[], "
        "double precision)",
        "DROP FUNCTION IF EXISTS kiln_settle(jsonb)",
        "DROP FUNCTION IF EXISTS kiln_admit_batch(jsonb)",
        "DROP FUNCTION IF EXISTS kiln_admit(text, integer, integer, text, boolean, bigint, "
        "integer, double precision, boolean, text)",
        "DROP FUNCTION IF EXISTS kiln_admit(text, integer, integer, text, boolean, bigint, "
        "integer, double precision, boolean)",
        "DROP FUNCTION IF EXISTS kiln_period_start(text, timestamptz)",
        "DROP TYPE IF EXISTS kiln_settlement")

_ADMIT_CALL = ("SELECT * FROM kiln_admit(%s::text, %s::integer, %s::integer, %s::text, "
               "%s::boolean, %s::bigint, %s::integer, %s::float8, %s::boolean, %s::text)")
# A settlement batch commits without waiting for its WAL flush, so that the org and key rows it
# locks are free again as soon as it has run (the next admission of the org waited out that
# flush before); the writer then waits for the flush in a transaction that locks nothing
# (_DURABLE), and only then counts the batch committed (PostgresStore.settle_batch). LATERAL:
# the setting is made before the function runs, whatever it returns.
_SETTLE_CALL = ("SELECT s.* FROM (SELECT set_config('synchronous_commit', 'off', true)) AS a "
                "CROSS JOIN LATERAL kiln_settle(%s::jsonb) AS s")
# A commit that waits for the WAL flush, in a transaction that locks nothing. It must write WAL of
# its own: a transaction that only takes an id commits without waiting (PostgreSQL's
# RecordTransactionCommit flushes only for a transaction that wrote WAL). A transactional
# logical message is the smallest such write (any role, any wal_level from replica; a logical
# decoding consumer sees it under the prefix "kiln"); its commit record comes after every commit
# this session made before, so that once it returns they are on disk too (PostgreSQL manual,
# "Asynchronous Commit").
_DURABLE = "SELECT pg_logical_emit_message(true, 'kiln', 'settled')"
# Both in one round trip: a simple query of several statements, its parameter bound by the client
# (the extended protocol carries one statement per message). The explicit transaction ends at
# its COMMIT, so _DURABLE runs in a transaction of its own, as the protocol's implicit one
# (PostgreSQL manual, "Multiple Statements in a Simple Query"); an error skips what follows it.
_SETTLE_DURABLY = f"BEGIN; {_SETTLE_CALL}; COMMIT; {_DURABLE}"
_ADMIT_BATCH_CALL = "SELECT * FROM kiln_admit_batch(%s::jsonb)"
_RENEW_CALL = ("SELECT * FROM kiln_renew(%s::text[], %s::integer[], %s::integer[], "
               "%s::integer[], %s::float8)")
_EXPIRED = """SELECT f.generation_id AS gid, e.org_id AS org, e.api_key_id AS key, e.model,
       e.stream, e.prompt_tokens, e.cached_tokens, e.completion_tokens, e.started_at,
       clock_timestamp() AS cutoff
  FROM in_flight f JOIN usage_events e ON e.id = f.generation_id
 WHERE f.expires_at < clock_timestamp() AND (%s::integer IS NULL OR f.org_id = %s::integer)
 LIMIT %s"""


class PostgresStore:
    """The ledger's statements on Postgres (one round trip each).

    :param engine: a SQLAlchemy engine whose pool hands out autocommit psycopg connections.
    """

    def __init__(self, engine):
        self.engine = engine

    def _call(self, sql, params, statements=1):
        """Run ``sql`` on a pooled connection; return its rows. With ``statements`` > 1, ``sql``
        is that many statements, sent as one simple query with ``params`` bound by the client,
        and the rows are those of the first that returns any.

        A connection found broken is dropped from the pool (a database restart) and the error
        raised; callers retry. So is one whose call was interrupted (a greenlet killed
        mid-statement), which may be left inside its transaction or its query.
        """
        try:
            conn = self.engine.raw_connection()
        except sa.exc.TimeoutError as err:
            raise ServiceUnavailable("Kiln's database connections are all busy; retry with "
                                     "backoff.", code="database_busy",
                                     headers={"Retry-After": "1"}) from err
        try:
            if statements == 1:
                with conn.cursor() as cur:
                    cur.execute(sql, params)
                    return cur.fetchall()
            with psycopg.ClientCursor(conn.driver_connection) as cur:
                cur.execute(sql, params)
                while cur.description is None and cur.nextset():
                    pass
                return cur.fetchall()
        except BaseException:
            conn.invalidate()
            raise
        finally:
            conn.close()

    def admit_once(self, a):
        """Try once to admit :class:`gateway.ledger.AdmissionRequest` ``a``; return the row."""
        rows = self._call(_ADMIT_CALL, (a.gid, a.org_id, a.key_id, a.model, a.stream, a.hold_nanos,
                                        a.in_flight_limit, a.lease_ttl_s, a.key_checks,
                                        a.endpoint))
        return rows[0] if rows else None

    def admit_batch(self, requests):
        """Try once to admit each of ``requests``, in one statement; return their rows in
        order (None where the org has no balance row)."""
        if len(requests) == 1:
            return [self.admit_once(requests[0])]
        batch = dumps([{"gid": a.gid, "org": a.org_id, "key": a.key_id, "model": a.model,
                             "stream": a.stream, "hold": a.hold_nanos,
                             "limit": a.in_flight_limit, "ttl": a.lease_ttl_s,
                             "key_checks": a.key_checks, "endpoint": a.endpoint}
                            for a in requests])
        rows = {row[0]: tuple(row[1:]) for row in self._call(_ADMIT_BATCH_CALL, (batch,))}
        return [rows.get(i) for i in range(len(requests))]

    def settle_batch(self, settlements):
        """Settle ``settlements`` in one transaction and return once it is durable: ``{gid:
        debited nano-dollars}`` for those it settled (the others were settled before).

        One round trip (:data:`_SETTLE_DURABLY`): the settlement, committed without waiting for
        its WAL flush (its row locks are released at once), then :data:`_DURABLE`, whose commit
        waits for the flush of both. A failure of either raises, and the caller retries the
        whole batch: ``kiln_settle`` settles each generation once, so a batch whose first
        commit survived a crash is not debited twice, and one whose commit was lost with the
        crash is written again.
        """
        batch = dumps([s.as_record() for s in settlements])
        return dict(self._call(_SETTLE_DURABLY, (batch,), statements=4))

    def renew(self, leases, lease_ttl_s):
        """Renew ``leases`` (with their progress); return ``{gid: state}``."""
        gids, prompt, cached, completion = [], [], [], []
        for gid, usage in leases:
            gids.append(gid)
            prompt.append(usage.prompt if usage else -1)
            cached.append(usage.cached if usage else 0)
            completion.append(usage.completion if usage else 0)
        return dict(self._call(_RENEW_CALL, (gids, prompt, cached, completion, lease_ttl_s)))

    def expired(self, org_id, limit):
        """Return rows of expired leases with their events' recorded progress."""
        with self.engine.connect() as conn:
            return conn.exec_driver_sql(_EXPIRED, (org_id, org_id, limit)).mappings().all()
