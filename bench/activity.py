"""GET /v1/activity on 1,000,000 usage events: the query plan and its timing.

Makes a scratch Postgres database (migrated by the project's alembic migrations), generates the
events with one ``generate_series`` statement (20 orgs, 5 keys each, 4 models, 90 UTC days, 2%
failed), builds the daily rollup from them as settlement would have (``usage_daily``), then
shows ``EXPLAIN (ANALYZE, BUFFERS)`` of the query the endpoint runs (:func:`gateway.api.activity.
activity_query`) and its median time, beside the same grouping computed from the events
themselves, for scale. The database is dropped at the end.

    .venv/bin/python bench/activity.py [--events 1000000] [--runs 30]

Needs Postgres at 127.0.0.1:5432 (trust, user postgres), as the tests do. docs/ACTIVITY.md
holds one run's output.
"""
import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from gateway.api.activity import DAYS, activity_query, org_activity  # noqa: E402
from gateway.db import utcnow  # noqa: E402
from gateway_proc import create_database, drop_database, migrate  # noqa: E402

ORGS, KEYS_PER_ORG = 20, 5

SETUP = [
    "INSERT INTO orgs (id, name) SELECT o, 'bench-' || o FROM generate_series(1, :orgs) o",
    """INSERT INTO api_keys (id, org_id, prefix, key_hash, name)
       SELECT k, 1 + (k - 1) / :per_org, 'kiln-' || lpad(k::text, 7, '0'), md5(k::text),
              'key ' || k FROM generate_series(1, :orgs * :per_org) k""",
    # Event i: org 1 + i % 20; within an org, its n-th event (n = i / 20) falls on day
    # n % 90 back, key n / 90 % 5 and model n / 450 % 4: every day, key and model alike.
    """INSERT INTO usage_events (id, org_id, api_key_id, model, stream, status, prompt_tokens,
                                cached_tokens, completion_tokens, cost_nanos, started_at,
                                ended_at)
       SELECT 'gen-' || lpad(i::text, 24, '0'), 1 + i % :orgs,
              (i % :orgs) * :per_org + 1 + (i / :orgs / 90) % :per_org,
              'model-' || (i / :orgs / 450) % 4, i % 2 = 0,
              CASE WHEN i % 50 = 0 THEN 'upstream_error' ELSE 'completed' END,
              100 + i % 900, (i % 900) / 2, 10 + i % 500,
              (100 + i % 900) * 100 + (10 + i % 500) * 300,
              :now - (i / :orgs % 90) * interval '1 day' - (i % 86400) * interval '1 second',
              :now - (i / :orgs % 90) * interval '1 day' - (i % 86400) * interval '1 second'
       FROM generate_series(1, :events) i""",
    # The rollup, as settlement writes it (and migration 0003 backfills it).
    """INSERT INTO usage_daily (org_id, day, model, api_key_id, requests, errors,
                               prompt_tokens, cached_tokens, completion_tokens, cost_nanos)
       SELECT org_id, CAST(started_at AT TIME ZONE 'UTC' AS date), model, api_key_id,
              count(*),
              sum(CASE WHEN status NOT IN ('completed', 'client_cancelled') THEN 1 ELSE 0 END),
              sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens), sum(cost_nanos)
         FROM usage_events GROUP BY 1, 2, 3, 4""",
    "ANALYZE",
]

# The same answer computed from the events (what the rollup saves), for scale.
FROM_EVENTS = """
SELECT CAST(e.started_at AT TIME ZONE 'UTC' AS date) AS day, e.model, k.prefix, k.name,
       count(*),
       sum(CASE WHEN e.status NOT IN ('completed', 'client_cancelled') THEN 1 ELSE 0 END),
       sum(e.prompt_tokens), sum(e.cached_tokens), sum(e.completion_tokens), sum(e.cost_nanos)
  FROM usage_events e JOIN api_keys k ON k.id = e.api_key_id
 WHERE e.org_id = :org AND e.started_at >= :since AND e.status <> 'pending'
 GROUP BY 1, 2, 3, 4 ORDER BY 1, 2, 3"""


def seed(engine, events, now):
    """Fill the scratch database; return the seconds it took."""
    started = time.monotonic()
    params = {"orgs": ORGS, "per_org": KEYS_PER_ORG, "events": events, "now": now}
    with engine.begin() as conn:
        for statement in SETUP[:-1]:
            conn.execute(sa.text(statement), params)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text(SETUP[-1]))
    return time.monotonic() - started


def explain(engine, statement, params=None):
    """Return the text of ``EXPLAIN (ANALYZE, BUFFERS)`` of ``statement``."""
    if not isinstance(statement, str):
        statement = str(statement.compile(engine, compile_kwargs={"literal_binds": True}))
    with engine.connect() as conn:
        rows = conn.execute(sa.text("EXPLAIN (ANALYZE, BUFFERS) " + statement), params or {})
        return "\n".join(r[0] for r in rows)


def median_ms(fn, runs):
    """Return the median wall time of ``fn()`` over ``runs`` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def report(engine, events, runs):
    now = utcnow()
    seconds = seed(engine, events, now)
    with engine.connect() as conn:
        counts = conn.execute(sa.text("SELECT (SELECT count(*) FROM usage_events), "
                                      "(SELECT count(*) FROM usage_daily)")).one()
    today = now.date()
    first = today - timedelta(days=DAYS - 1)
    since = now.replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(days=DAYS - 1)
    rows = org_activity(engine, 1, first, today)
    print(f"usage events: {counts[0]:,}; usage_daily rows: {counts[1]:,} "
          f"(generated in {seconds:.1f} s)")
    print(f"org 1, {first} to {today}: {len(rows)} rows of (day, model, key), "
          f"{sum(r['requests'] for r in rows):,} requests")
    print("\n## GET /v1/activity: the rollup (gateway.api.activity.activity_query)\n")
    print(explain(engine, activity_query(1, first, today)))
    query = activity_query(1, first, today)

    def from_rollup():
        with engine.connect() as conn:
            return conn.execute(query).all()
    rollup_ms = median_ms(from_rollup, runs)
    endpoint_ms = median_ms(lambda: org_activity(engine, 1, first, today), runs)
    print(f"\nmedian of {runs} runs: {rollup_ms:.2f} ms for the query and its rows; "
          f"{endpoint_ms:.2f} ms with the rows shaped as the API returns them")
    print("\n## The same grouping from the usage events (for scale)\n")
    params = {"org": 1, "since": since}
    print(explain(engine, FROM_EVENTS, params))

    def from_events():
        with engine.connect() as conn:
            return conn.execute(sa.text(FROM_EVENTS), params).all()
    events_ms = median_ms(from_events, max(3, runs // 10))
    print(f"\nmedian of {max(3, runs // 10)} runs: {events_ms:.2f} ms; "
          f"the rollup answers {events_ms / rollup_ms:.1f}x faster")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args(argv)
    name = f"kiln_bench_activity_{os.getpid()}"
    url = create_database(name)
    try:
        migrate(url)
        engine = sa.create_engine(url)
        report(engine, args.events, args.runs)
        engine.dispose()
    finally:
        drop_database(name)


if __name__ == "__main__":
    main()
