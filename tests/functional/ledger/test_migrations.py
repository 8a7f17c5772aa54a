"""Migrations on both dialects: upgrade, downgrade to nothing and upgrade again; no drift from
the models (``kiln db check``); the credit triggers work in plain SQL on Postgres and SQLite."""
import json
import os
import subprocess
import sys
import uuid
from decimal import Decimal
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway_proc import create_database, drop_database

KILN = str(Path(sys.executable).with_name("kiln"))
TABLES = {"orgs", "api_keys", "credit_balances", "credit_grants", "usage_events", "in_flight",
          "maintenance", "usage_daily", "stored_responses", "key_changes", "webhooks",
          "webhook_outbox", "webhook_deliveries"}


def kiln(url, *args, check=True):
    result = subprocess.run([KILN, *args], capture_output=True, text=True, timeout=180,
                            env={**os.environ, "KILN_DATABASE_URL": url})
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(params=["postgres", "sqlite"])
def empty_db(request, tmp_path):
    """``(url, engine)`` of an empty database of each dialect."""
    if request.param == "postgres":
        name = f"kiln_migrations_{uuid.uuid4().hex[:10]}"
        url = create_database(name)
    else:
        url = f"sqlite:///{tmp_path / 'kiln.db'}"
    engine = sa.create_engine(url)
    yield url, engine
    engine.dispose()
    if request.param == "postgres":
        drop_database(name)


def tables(engine):
    return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}


def test_upgrade_downgrade_upgrade_without_drift(empty_db):
    url, engine = empty_db
    kiln(url, "db", "upgrade")
    assert tables(engine) == TABLES
    assert "No new upgrade operations detected" in kiln(url, "db", "check").stdout
    kiln(url, "db", "downgrade", "base")
    engine.dispose()
    assert tables(engine) == set()
    with engine.connect() as conn:
        assert not [v for v in sa.inspect(conn).get_view_names() if v == "org_credits"]
    kiln(url, "db", "upgrade")
    engine.dispose()
    assert tables(engine) == TABLES
    kiln(url, "db", "check")
    kiln(url, "db", "downgrade", "0001")  # the newest step alone goes back and forth
    kiln(url, "db", "upgrade")
    kiln(url, "db", "check")


def test_check_reports_drift(empty_db):
    """``kiln db check`` is not vacuous: a column the models lack fails it."""
    url, engine = empty_db
    kiln(url, "db", "upgrade")
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE orgs ADD COLUMN stray INTEGER"))
    result = kiln(url, "db", "check", check=False)
    assert result.returncode != 0 and "stray" in result.stdout + result.stderr


def _grant(conn, org_id, amount):
    conn.execute(sa.text(f"INSERT INTO credit_grants (org_id, amount_usd, note) "
                         f"VALUES ({org_id}, {amount}, 'plain sql')"))


def _balance(engine, org_id):
    with engine.connect() as conn:
        return tuple(conn.execute(sa.text(
            "SELECT balance_nanos, held_nanos FROM credit_balances WHERE org_id = :o"),
            {"o": org_id}).one())


def test_plain_sql_grants_move_the_balance_and_never_below_the_holds(empty_db):
    """The triggers of both dialects: an org gets its balance row; a plain INSERT moves the
    balance exactly; grants are append-only; a negative grant may not take the balance below
    the holds of requests in flight (migration 0002)."""
    url, engine = empty_db
    kiln(url, "db", "upgrade")
    with engine.begin() as conn:
        org_id = conn.execute(sa.text("INSERT INTO orgs (name) VALUES ('plain') RETURNING id"))\
            .scalar_one()
    assert _balance(engine, org_id) == (0, 0)
    with engine.begin() as conn:
        _grant(conn, org_id, "12.345678901")
        _grant(conn, org_id, "0.000000001")
    assert _balance(engine, org_id) == (12_345_678_902, 0)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE credit_balances SET held_nanos = 2000000000 "
                             "WHERE org_id = :o"), {"o": org_id})
    for statement in (lambda c: _grant(c, org_id, "-10.345678903"),  # 1 nano below the holds
                      lambda c: c.execute(sa.text("UPDATE credit_grants SET amount_usd = 0")),
                      lambda c: c.execute(sa.text("DELETE FROM credit_grants")),
                      lambda c: c.execute(sa.text("UPDATE credit_balances SET balance_nanos = 1"))):
        with pytest.raises(sa.exc.DatabaseError) as err, engine.begin() as conn:
            statement(conn)
        assert any(word in str(err.value) for word in ("refused", "append-only", "holds",
                                                       "covers_holds"))
    assert _balance(engine, org_id) == (12_345_678_902, 2_000_000_000)
    with engine.begin() as conn:
        _grant(conn, org_id, "-10.345678902")  # exactly down to the holds
    assert _balance(engine, org_id) == (2_000_000_000, 2_000_000_000)
    with engine.connect() as conn:
        view = conn.execute(sa.text("SELECT balance_usd, available_usd FROM org_credits "
                                    "WHERE org_id = :o"), {"o": org_id}).one()
    assert (Decimal(str(view.balance_usd)), Decimal(str(view.available_usd))) == (2, 0)
    with engine.begin() as conn:
        _grant(conn, org_id, "2.998511501")
    with engine.connect() as conn:  # exact on both dialects (SQLite divides integers as such)
        view = conn.execute(sa.text("SELECT balance_usd, held_usd, available_usd "
                                    "FROM org_credits WHERE org_id = :o"), {"o": org_id}).one()
    assert tuple(Decimal(str(v)) for v in view) == (Decimal("4.998511501"), 2,
                                                    Decimal("2.998511501"))


def test_0006_takes_client_cancellations_out_of_the_rollups_errors_and_back(empty_db):
    """A day's row that counted a cancelled and a failed generation as 2 errors counts 1 after
    0006 (docs/ACTIVITY.md, "What a row counts"), and 2 again after its downgrade."""
    url, engine = empty_db
    kiln(url, "db", "upgrade", "0005")
    org, key = _org_key_and_events(engine, [
        (gid, status, "2026-11-30 23:59:59+00", 0) for gid, status in (
            ("gen-1", "completed"), ("gen-2", "client_cancelled"), ("gen-3", "upstream_error"))])
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO usage_daily (org_id, day, model, api_key_id, "
                             "requests, errors) VALUES (:o, '2026-11-30', 'm', :k, 3, 2)"),
                     {"o": org, "k": key})

    def errors():
        with engine.connect() as conn:
            return conn.execute(sa.text("SELECT errors FROM usage_daily")).scalar_one()
    kiln(url, "db", "upgrade")
    assert errors() == 1
    kiln(url, "db", "downgrade", "0005")
    assert errors() == 2


def _org_key_and_events(engine, events):
    """Insert an org, a key and ``events`` [(id, status, started_at, cost_nanos)]: (org, key)."""
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO orgs (name) VALUES ('acme')"))
        org = conn.execute(sa.text("SELECT id FROM orgs")).scalar_one()
        conn.execute(sa.text("INSERT INTO api_keys (org_id, prefix, key_hash) VALUES "
                             "(:o, 'kiln-abc', 'h')"), {"o": org})
        key = conn.execute(sa.text("SELECT id FROM api_keys")).scalar_one()
        for gid, status, started_at, cost in events:
            conn.execute(sa.text(
                "INSERT INTO usage_events (id, org_id, api_key_id, model, stream, status, "
                "started_at, cost_nanos, completion_tokens) "
                "VALUES (:g, :o, :k, 'm', false, :s, :t, :c, 7)"),
                {"g": gid, "o": org, "k": key, "s": status, "t": started_at, "c": cost})
    return org, key


EVENTS = (("gen-1", "completed", "2026-11-29 10:00:00+00:00", 5),
          ("gen-2", "upstream_error", "2026-11-29 23:59:59+00:00", 0),
          ("gen-3", "completed", "2026-11-30 00:00:01+00:00", 11),
          ("gen-4", "pending", "2026-11-30 08:00:00+00:00", 0))


def _rollup(engine):
    with engine.connect() as conn:
        return [(str(day), requests, errors, tokens, cost) for day, requests, errors, tokens, cost
                in conn.execute(sa.text(
                    "SELECT day, requests, errors, completion_tokens, cost_nanos "
                    "FROM usage_daily ORDER BY day"))]


def test_0003_backfills_one_row_per_utc_day(empty_db):
    """Events settled before 0003 land in their UTC day's row on both dialects (on SQLite a CAST
    to DATE would have made the year of each day)."""
    url, engine = empty_db
    kiln(url, "db", "upgrade", "0002")
    _org_key_and_events(engine, EVENTS)
    kiln(url, "db", "upgrade")
    assert _rollup(engine) == [("2026-11-29", 2, 1, 14, 5), ("2026-11-30", 1, 0, 7, 11)]


def test_0008_rebuilds_a_sqlite_rollup_whose_days_are_numbers(tmp_path):
    """A SQLite database that 0003 as first released left with the day 2026 is rebuilt from its
    settled events; one without such a row is left as it is."""
    url = f"sqlite:///{tmp_path / 'kiln.db'}"
    engine = sa.create_engine(url)
    kiln(url, "db", "upgrade", "0007")
    org, key = _org_key_and_events(engine, EVENTS)
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO usage_daily (org_id, day, model, api_key_id, requests, "
                             "errors, cost_nanos) VALUES (:o, 2026, 'm', :k, 3, 1, 16)"),
                     {"o": org, "k": key})
    kiln(url, "db", "upgrade")
    assert _rollup(engine) == [("2026-11-29", 2, 1, 14, 5), ("2026-11-30", 1, 0, 7, 11)]
    kiln(url, "db", "downgrade", "0007")
    with engine.begin() as conn:  # a healthy rollup, even one that disagrees, is not touched
        conn.execute(sa.text("UPDATE usage_daily SET requests = 9"))
    kiln(url, "db", "upgrade")
    assert [row[1] for row in _rollup(engine)] == [9, 9]
    engine.dispose()


def test_0013_folds_other_endpoints_into_chat_on_downgrade(empty_db):
    """After 0013 the rollup keeps a row per endpoint; its downgrade adds a day's other
    endpoints into chat's row, so no request or cost leaves the rollup."""
    url, engine = empty_db
    kiln(url, "db", "upgrade")
    org, key = _org_key_and_events(engine, [])
    with engine.begin() as conn:
        for endpoint, requests, cost in (("chat", 2, 10), ("messages", 3, 7),
                                         ("embeddings", 1, 1)):
            conn.execute(sa.text(
                "INSERT INTO usage_daily (org_id, day, model, api_key_id, endpoint, requests, "
                "errors, prompt_tokens, cached_tokens, completion_tokens, cost_nanos) VALUES "
                "(:o, '2026-11-30', 'm', :k, :e, :r, 1, 4, 0, 5, :c)"),
                {"o": org, "k": key, "e": endpoint, "r": requests, "c": cost})
    kiln(url, "db", "downgrade", "0012")
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT requests, errors, prompt_tokens, completion_tokens, "
                                    "cost_nanos FROM usage_daily")).all()
    assert [tuple(r) for r in rows] == [(6, 3, 12, 15, 18)]
    kiln(url, "db", "upgrade")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT endpoint FROM usage_daily")).scalar_one() == "chat"


def test_0019_plans_settlement_once_and_its_downgrade_puts_back_the_parse_per_statement(
        empty_db):
    """0019 installs ``kiln_settle`` planned once per session (docs in the migration); its
    downgrade puts back the function that parses the batch in each statement, with no setting,
    and upgrade again this revision's, word for word."""
    url, engine = empty_db
    if engine.dialect.name != "postgresql":
        pytest.skip("kiln_settle is Postgres's; SQLite settles in Python")
    definition = ("SELECT pg_get_functiondef('kiln_settle(jsonb)'::regprocedure), "
                  "(SELECT proconfig FROM pg_proc WHERE oid = 'kiln_settle(jsonb)'::regprocedure)")
    kiln(url, "db", "upgrade")
    with engine.connect() as conn:
        after, config = conn.execute(sa.text(definition)).one()
    assert config == ["plan_cache_mode=force_generic_plan", "enable_seqscan=off"]
    # the batch parsed once; its ids and four statements read the parsed rows
    assert after.count("unnest(v_rows)") == 5 and after.count("jsonb_populate_recordset(") == 1
    kiln(url, "db", "downgrade", "0016")
    with engine.connect() as conn:
        before, config = conn.execute(sa.text(definition)).one()
    assert config is None and "v_rows" not in before and "v_gids" not in before
    assert before.count("jsonb_populate_recordset(NULL::kiln_settlement, p_batch)") == 4
    assert before.count("jsonb_populate_recordset(NULL::kiln_settlement,\n") == 1
    kiln(url, "db", "upgrade")
    with engine.connect() as conn:
        assert tuple(conn.execute(sa.text(definition)).one()) == (
            after, ["plan_cache_mode=force_generic_plan", "enable_seqscan=off"])


def _explain_as_notices(cur):
    """Have the session of ``cur`` send the plan of every statement it runs, nested ones
    included (a function's), as a notice (auto_explain, PostgreSQL manual F.4)."""
    for setting in ("LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0",
                    "SET auto_explain.log_nested_statements = on",
                    "SET auto_explain.log_level = notice", "SET client_min_messages = notice"):
        cur.execute(setting)


def _settle_plans(engine, batch):
    """The plans of ``kiln_settle``'s statements for ``batch`` (auto_explain, as notices), in a
    session whose plans were made first on the tables as they were then (one call, empty)."""
    conn = engine.raw_connection()
    try:
        notices = []
        conn.driver_connection.add_notice_handler(lambda diag: notices.append(diag.message_primary))
        with conn.cursor() as cur:
            cur.execute("SELECT * FROM kiln_settle('[]'::jsonb)")  # plans made now, kept
            conn.commit()
            yield
            _explain_as_notices(cur)
            cur.execute("SELECT * FROM kiln_settle(%s::jsonb)", (batch,))
            conn.rollback()
        yield "\n".join(notices)
    finally:
        conn.close()


def _org_and_probe(engine):
    """An org with a key, and the settlement batch of one generation of theirs, ``gen-probe``."""
    with engine.begin() as conn:
        org = conn.execute(sa.text("INSERT INTO orgs (name) VALUES ('o') RETURNING id")).scalar()
        # (an org's balance row comes with it)
        key = conn.execute(sa.text("INSERT INTO api_keys (org_id, prefix, key_hash) VALUES "
                                   "(:o, 'kiln-abc', 'h') RETURNING id"), {"o": org}).scalar()
    batch = json.dumps([{"gid": "gen-probe", "org": org, "key": key, "model": "m", "stream": False,
                         "status": "completed", "prompt": 1, "cached": 0, "completion": 1,
                         "cost": 10, "hold": 0, "http_status": 200,
                         "estimated": False, "anomaly": False}])
    return org, key, batch


def _add_events(engine, org, key, settled=5000):
    """Give the org ``settled`` settled events and the pending ``gen-probe``."""
    with engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO usage_events (id, org_id, api_key_id, model, stream, status, "
            "hold_nanos, started_at) SELECT 'gen-' || i, :o, :k, 'm', false, 'completed', 0, "
            "now() FROM generate_series(1, :n) i"), {"o": org, "k": key, "n": settled})
        conn.execute(sa.text("INSERT INTO usage_events (id, org_id, api_key_id, model, "
                             "stream, status, hold_nanos, started_at) VALUES ('gen-probe', "
                             ":o, :k, 'm', false, 'pending', 0, now())"), {"o": org, "k": key})


def _probed(empty_db, function):
    """Upgrade the Postgres database of ``empty_db`` (skip SQLite, where ``function`` is
    Python's), with autovacuum off on ``usage_events`` so that no analyze replans a probed
    session behind the test's back. Return ``(url, engine, org, key, batch)``
    (:func:`_org_and_probe`)."""
    url, engine = empty_db
    if engine.dialect.name != "postgresql":
        pytest.skip(f"{function} is Postgres's; SQLite does it in Python")
    kiln(url, "db", "upgrade")
    with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        conn.execute(sa.text("ALTER TABLE usage_events SET (autovacuum_enabled = false)"))
    return (url, engine, *_org_and_probe(engine))


def test_0020_settles_through_indexes_whatever_the_tables_looked_like_when_planned(empty_db):
    """A settlement planned once per session (0019) while ``usage_events`` was empty still finds
    its events through their key once the table holds thousands (0020); 0019's plan scanned
    the whole table for them."""
    url, engine, org, key, batch = _probed(empty_db, "kiln_settle")

    def plans():
        steps = _settle_plans(engine, batch)
        next(steps)
        _add_events(engine, org, key)  # the table grows after the session planned
        text = next(steps)
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM usage_events"))
        return text

    head = plans()
    assert "pk_usage_events" in head and "Seq Scan" not in head
    kiln(url, "db", "downgrade", "0019")
    assert "Seq Scan on usage_events" in plans()
    kiln(url, "db", "upgrade")


def test_0021_reads_the_batchs_events_by_id_when_the_balances_were_vacuumed_since(empty_db):
    """With ``usage_events`` grown since its last analyze and ``credit_balances`` just vacuumed
    (autovacuum's usual order on these tables), 0020's plan reached a settlement's events
    through the org: every event the org had (``ix_usage_events_org_started_id``). 0021 reads
    them by id."""
    url, engine, org, key, batch = _probed(empty_db, "kiln_settle")
    autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
    _add_events(engine, org, key)

    def plans():
        with autocommit.connect() as conn:
            conn.execute(sa.text("VACUUM credit_balances"))
        steps = _settle_plans(engine, batch)
        next(steps)
        return next(steps)

    head = plans()
    assert "pk_usage_events" in head and "ix_usage_events_org_started_id" not in head
    kiln(url, "db", "downgrade", "0020")
    assert "Bitmap Index Scan on ix_usage_events_org_started_id" in plans()
    kiln(url, "db", "upgrade")
    assert "ix_usage_events_org_started_id" not in plans()


def test_0022_renews_through_ids_whatever_the_events_table_looked_like_when_planned(empty_db):
    """A renewer's session whose plans were made while ``usage_events`` was small (seven calls:
    PL/pgSQL may keep a generic plan after five) still reaches the events by id once the table
    holds thousands (0022); 0021's kept scanning the whole table."""
    url, engine, org, key, _ = _probed(empty_db, "kiln_renew")
    renew = ("SELECT * FROM kiln_renew(ARRAY['gen-probe'], ARRAY[1], ARRAY[0], ARRAY[1], "
             "30::float8)")

    def plans():
        conn = engine.raw_connection()
        try:
            notices = []
            conn.driver_connection.add_notice_handler(
                lambda diag: notices.append(diag.message_primary))
            with conn.cursor() as cur:
                for _ in range(7):
                    cur.execute(renew)
                conn.commit()
                _add_events(engine, org, key)  # the table grows after the session planned
                _explain_as_notices(cur)
                cur.execute(renew)
                assert cur.fetchall() == [("gen-probe", "leased")]
                conn.rollback()
        finally:
            conn.close()
            with engine.begin() as db:  # empty again, no page left (as DELETE would leave)
                db.execute(sa.text("TRUNCATE usage_events CASCADE"))
        return "\n".join(notices)

    head = plans()
    assert "pk_usage_events" in head and "Seq Scan" not in head
    kiln(url, "db", "downgrade", "0021")
    assert "Seq Scan on usage_events" in plans()
    kiln(url, "db", "upgrade")
    assert "Seq Scan" not in plans()
