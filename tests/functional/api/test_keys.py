"""Keys people hand out: ``kiln key create/set/list`` on both dialects (the real console script),
and ``GET /v1/key`` / ``GET /v1/keys`` through the real gateway on Postgres."""
import json
import os
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pytest
import requests
import sqlalchemy as sa

from gateway.ledger.sqlite import period_start
from gateway.models import api_keys, usage_events
from gateway_proc import ROOT, create_database, drop_database, make_org, usage_event, wait_until

KILN = str(Path(sys.executable).with_name("kiln"))
BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "Say hello"}]}
BAD_LIMITS = ["NaN", "Infinity", "1e3", "-1", "-0.000000001", "0.0000000001", "1,5", "ten", "",
              " 5", "0x10"]
TOO_BIG = {"postgres": "9223372036.854775808", "sqlite": "1000000"}


@pytest.fixture(params=["postgres", "sqlite"])
def db(request, tmp_path):
    """A database migrated by ``kiln db upgrade`` with the org ``acme``: ``(dialect, url,
    engine)``."""
    if request.param == "postgres":
        name = f"kiln_keys_{uuid.uuid4().hex[:10]}"
        url = create_database(name)
    else:
        url = f"sqlite:///{tmp_path}/kiln.db"
    kiln(url, "db", "upgrade")
    kiln(url, "org", "create", "acme")
    engine = sa.create_engine(url)
    yield request.param, url, engine
    engine.dispose()
    if request.param == "postgres":
        drop_database(name)


def kiln(url, *args, code=0):
    result = subprocess.run([KILN, *args], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "KILN_DATABASE_URL": url})
    assert result.returncode == code, result.stdout + result.stderr
    return result


def key_row(engine, prefix):
    with engine.connect() as conn:
        return conn.execute(sa.select(api_keys).where(api_keys.c.prefix == prefix)
                            ).mappings().one()


def create(url, *options):
    secret = kiln(url, "key", "create", "acme", *options).stdout.splitlines()[-1]
    return secret, secret[:12]


def aware(ts):
    return ts if ts is None or ts.tzinfo else ts.replace(tzinfo=timezone.utc)


# -- kiln key ------------------------------------------------------------------------------------

def test_create_with_label_limit_reset_and_rate_then_list(db):
    _dialect, url, engine = db
    secret, prefix = create(url, "--label", "ci-bot", "--limit", "10.00", "--reset", "monthly",
                            "--rpm", "60")
    row = key_row(engine, prefix)
    assert (row["name"], row["limit_usd"], row["limit_reset"], row["rpm_limit"]) == \
        ("ci-bot", Decimal("10"), "monthly", 60)
    assert secret.startswith("kiln-") and len(secret) > 40
    _other, plain = create(url)
    lines = kiln(url, "key", "list", "acme").stdout.splitlines()
    assert lines[0].split("\t") == ["prefix", "label", "limit_usd", "limit_reset", "usage_usd",
                                    "remaining_usd", "rpm", "created_at", "last_used_at",
                                    "status"]
    first = lines[1].split("\t")
    assert first[:7] == [prefix, "ci-bot", "10", "monthly", "0", "10", "60"]
    assert datetime.fromisoformat(first[7]).tzinfo is not None
    assert first[8:] == ["-", "active"]
    assert lines[2].split("\t")[:7] == [plain, "-", "-", "-", "0", "-", "-"]
    assert secret not in "\n".join(lines) and "key_hash" not in lines[0]


@pytest.mark.parametrize("limit", BAD_LIMITS)
def test_a_limit_that_is_not_an_exact_decimal_is_refused_and_nothing_written(db, limit):
    _dialect, url, engine = db
    result = kiln(url, "key", "create", "acme", "--limit", limit, code=2)
    assert "--limit" in result.stderr
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM api_keys")).scalar_one() == 0


def test_a_limit_beyond_what_admission_compares_is_refused(db):
    dialect, url, engine = db
    result = kiln(url, "key", "create", "acme", "--limit", TOO_BIG[dialect], code=2)
    assert "largest limit" in result.stderr
    _secret, prefix = create(url, "--limit", "0")  # zero: a key that cannot spend
    assert key_row(engine, prefix)["limit_usd"] == 0
    kiln(url, "key", "set", prefix, "--limit", TOO_BIG[dialect], code=2)
    assert key_row(engine, prefix)["limit_usd"] == 0


def test_set_changes_and_clears_limits(db):
    _dialect, url, engine = db
    _secret, prefix = create(url, "--limit", "1.5", "--rpm", "5")
    kiln(url, "key", "set", prefix, "--limit", "2.000000001", "--rpm", "7")
    row = key_row(engine, prefix)
    assert (row["limit_usd"], row["rpm_limit"]) == (Decimal("2.000000001"), 7)
    kiln(url, "key", "set", prefix, "--no-limit", "--no-rpm")
    row = key_row(engine, prefix)
    assert (row["limit_usd"], row["rpm_limit"]) == (None, None)
    assert "nothing to change" in kiln(url, "key", "set", prefix, code=2).stderr
    assert "not both" in kiln(url, "key", "set", prefix, "--limit", "1", "--no-limit",
                              code=2).stderr
    assert "no key" in kiln(url, "key", "set", "kiln-nothere", "--rpm", "1", code=1).stderr


def test_a_new_reset_period_recounts_the_spend_from_the_events(db):
    """Events settled this week and long ago: ``--reset weekly`` counts this week's only,
    ``--reset never`` all of them; reconciliation agrees each time."""
    _dialect, url, engine = db
    _secret, prefix = create(url)
    now = datetime.now(timezone.utc)
    with engine.begin() as conn:
        ids = conn.execute(sa.text("SELECT id, org_id FROM api_keys WHERE prefix = :p"),
                           {"p": prefix}).one()
        for gid, cost, ended in (("gen-old", 700, now - timedelta(days=60)),
                                 ("gen-new", 40, now)):
            conn.execute(usage_events.insert().values(
                id=gid, org_id=ids.org_id, api_key_id=ids.id, model="m", stream=False,
                status="completed", cost_nanos=cost, started_at=ended, ended_at=ended))
    kiln(url, "key", "set", prefix, "--reset", "weekly")
    row = key_row(engine, prefix)
    assert (row["period_spent_nanos"], aware(row["period_start"])) == \
        (40, period_start("weekly", now))
    kiln(url, "key", "set", prefix, "--reset", "never")
    row = key_row(engine, prefix)
    assert (row["period_spent_nanos"], row["period_start"], row["limit_reset"]) == \
        (740, None, None)
    recon = kiln(url, "credits", "reconcile", code=1)  # the org's balance knows no such events
    assert f"key {prefix}" not in recon.stderr


def test_revoke_by_prefix(db):
    _dialect, url, engine = db
    _secret, prefix = create(url)
    assert kiln(url, "key", "revoke", prefix).stdout.strip() == f"revoked {prefix}"
    assert key_row(engine, prefix)["revoked_at"] is not None
    assert kiln(url, "key", "list", "acme").stdout.splitlines()[1].endswith("\trevoked")


# -- GET /v1/key, GET /v1/keys -------------------------------------------------------------------

def get(gateway, path, org):
    return requests.get(gateway.base_url + path, headers=org.headers, timeout=30)


def set_limits(engine, org, **columns):
    assignments = ", ".join(f"{name} = :{name}" for name in columns)
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE api_keys SET {assignments} WHERE org_id = :org"),
                     {**columns, "org": org.id})


@pytest.mark.postgres
def test_the_calling_key_shows_its_limit_usage_and_remaining(gateway, fake, engine):
    org = make_org(engine, f"key-{uuid.uuid4().hex[:8]}")
    set_limits(engine, org, limit_usd="0.5", limit_reset="daily", rpm_limit=100)
    reply = requests.post(gateway.base_url + "/v1/chat/completions", json=BODY,
                          headers=org.headers, timeout=30)
    cost = usage_event(engine, reply.headers["X-Neocloud-Generation-Id"])["cost_nanos"]
    assert cost > 0
    # The key check writes last_used_at in a greenlet of its own, off the request's path.
    wait_until(lambda: last_used(engine, org)[1])
    key = get(gateway, "/v1/key", org).json()
    today = datetime.now(timezone.utc).date()
    assert {k: key[k] for k in ("object", "label", "prefix", "limit_usd", "limit_reset",
                                "held_usd", "rate_limit", "revoked")} == {
        "object": "key", "label": "test", "prefix": org.key[:12], "limit_usd": "0.5",
        "limit_reset": "daily", "held_usd": "0", "rate_limit": {"requests_per_minute": 100},
        "revoked": False}
    assert Decimal(key["usage_usd"]) * 10**9 == cost
    assert Decimal(key["remaining_usd"]) == Decimal("0.5") - Decimal(key["usage_usd"])
    assert key["period_start"] == f"{today}T00:00:00+00:00"
    assert key["resets_at"] == f"{today + timedelta(days=1)}T00:00:00+00:00"
    assert datetime.fromisoformat(key["created_at"]) <= datetime.fromisoformat(
        key["last_used_at"])
    assert "key_hash" not in key and org.key not in str(key)


@pytest.fixture
def last_used_writes(engine):
    """Count the writes of ``api_keys.last_used_at`` (rows whose value changed), by key id,
    with a trigger for the test's duration: ``writes(key_id)``."""
    ddl = ["CREATE TABLE test_last_used_writes (key_id bigint, at timestamptz)",
           "CREATE FUNCTION test_log_last_used() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
           "INSERT INTO test_last_used_writes VALUES (NEW.id, NEW.last_used_at); "
           "RETURN NEW; END $$",
           "CREATE TRIGGER test_last_used AFTER UPDATE ON api_keys FOR EACH ROW WHEN "
           "(OLD.last_used_at IS DISTINCT FROM NEW.last_used_at) "
           "EXECUTE FUNCTION test_log_last_used()"]
    with engine.begin() as conn:
        for statement in ddl:
            conn.execute(sa.text(statement))

    def writes(key_id):
        with engine.connect() as conn:
            return conn.execute(sa.text("SELECT count(*) FROM test_last_used_writes WHERE "
                                        "key_id = :k"), {"k": key_id}).scalar_one()
    yield writes
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TRIGGER test_last_used ON api_keys"))
        conn.execute(sa.text("DROP FUNCTION test_log_last_used()"))
        conn.execute(sa.text("DROP TABLE test_last_used_writes"))


def last_used(engine, org):
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT id, last_used_at FROM api_keys WHERE org_id = :o"),
                            {"o": org.id}).one()


@pytest.mark.postgres
def test_last_used_is_written_once_for_20_requests_of_every_kind_within_a_minute(
        gateway, fake, engine, last_used_writes):
    """Twenty requests within a minute on the two-worker gateway: chat completions, refused
    ones (402: the org has no credits) and ``GET`` calls. Every one passes the key check, the
    first writes ``last_used_at``; no other request writes it (each worker tries at most once
    a minute, and a try finds it already within the minute)."""
    org = make_org(engine, f"used-{uuid.uuid4().hex[:8]}")
    broke = make_org(engine, f"broke-{uuid.uuid4().hex[:8]}", usd="0")
    key_id, before = last_used(engine, org)
    assert before is None
    started = datetime.now(timezone.utc)
    for i in range(20):
        if i % 2:
            assert get(gateway, "/v1/credits" if i % 4 == 1 else "/v1/key", org).ok
        else:
            reply = requests.post(gateway.base_url + "/v1/chat/completions", json=BODY,
                                  headers=org.headers, timeout=30)
            assert reply.status_code == 200
            usage_event(engine, reply.headers["X-Neocloud-Generation-Id"])
        refused = requests.post(gateway.base_url + "/v1/chat/completions", json=BODY,
                                headers=broke.headers, timeout=30)
        assert refused.json()["error"]["code"] == "insufficient_credits"
    wait_until(lambda: last_used(engine, broke)[1] is not None)
    assert datetime.now(timezone.utc) - started < timedelta(minutes=1)
    assert started <= last_used(engine, org)[1] <= datetime.now(timezone.utc)
    assert last_used_writes(key_id) == 1
    assert last_used_writes(last_used(engine, broke)[0]) == 1


@pytest.mark.postgres
def test_last_used_moves_once_the_interval_has_passed(start_gateway, fake, engine,
                                                      last_used_writes):
    """With ``KILN_KEY_LAST_USED_INTERVAL_S=3``: a use within the interval leaves
    ``last_used_at``; a use after it writes it again. A value written by another worker or
    host within the interval is left alone (the ``UPDATE`` is conditional)."""
    gw = start_gateway(workers=1, key_last_used_interval_s=3)
    org = make_org(engine, f"moves-{uuid.uuid4().hex[:8]}")
    assert get(gw, "/v1/key", org).ok
    key_id, first = wait_until(lambda: (row := last_used(engine, org))[1] and row)
    assert get(gw, "/v1/key", org).ok
    time.sleep(3.2)
    assert get(gw, "/v1/key", org).ok
    key_id, second = wait_until(lambda: (row := last_used(engine, org))[1] > first and row)
    assert second >= first + timedelta(seconds=3)
    assert last_used_writes(key_id) == 2
    future = second + timedelta(seconds=30)  # "another worker" wrote it just now
    set_limits(engine, org, last_used_at=future)
    time.sleep(3.2)
    shown = get(gw, "/v1/key", org).json()["last_used_at"]
    assert datetime.fromisoformat(shown) == future
    time.sleep(0.5)
    assert last_used(engine, org)[1] == future


@pytest.mark.postgres
def test_an_orgs_keys_are_listed_without_secrets_and_only_to_that_org(gateway, engine):
    org = make_org(engine, f"keys-{uuid.uuid4().hex[:8]}")
    other = make_org(engine, f"other-{uuid.uuid4().hex[:8]}")
    from gateway.api import auth
    with engine.begin() as conn:
        second = auth.create_key(conn, org.id, name="ci-bot", limit_usd=Decimal("3"),
                                 limit_reset="weekly")
    listed = get(gateway, "/v1/keys", org).json()
    assert listed["object"] == "list"
    assert [(k["prefix"], k["label"], k["limit_usd"], k["remaining_usd"])
            for k in listed["data"]] == [(org.key[:12], "test", None, None),
                                         (second[:12], "ci-bot", "3", "3")]
    text = str(listed)
    assert org.key not in text and second not in text and "hash" not in text
    assert other.key[:12] not in text
    wait_until(lambda: requests.get(gateway.base_url + "/v1/keys", timeout=30)
               .status_code == 401)


def runbook_sql():
    """The SQL block of deploy/RUNBOOK.md, section "Key limits"."""
    text = (ROOT / "deploy" / "RUNBOOK.md").read_text()
    section = text.split("### Key limits", 1)[1]
    return section.split("```sql\n", 1)[1].split("```", 1)[0]


@pytest.mark.parametrize("db", ["postgres"], indirect=True)  # psql, kiln_period_start
def test_the_runbooks_sql_sets_limits_and_recounts_a_new_period(db):
    """The runbook's statements, as an operator pastes them into psql: the key ends with a
    monthly period whose spend is its events of this month, and reconciliation agrees."""
    _dialect, url, engine = db
    _secret, prefix = create(url)
    now = datetime.now(timezone.utc)
    with engine.begin() as conn:
        ids = conn.execute(sa.select(api_keys.c.id, api_keys.c.org_id)
                           .where(api_keys.c.prefix == prefix)).one()
        for gid, cost, ended in (("gen-old", 700, now - timedelta(days=40)),
                                 ("gen-new", 40, now)):
            conn.execute(usage_events.insert().values(
                id=gid, org_id=ids.org_id, api_key_id=ids.id, model="m", stream=False,
                status="completed", cost_nanos=cost, started_at=ended, ended_at=ended))
    raw = engine.raw_connection()
    try:
        raw.driver_connection.autocommit = True
        with raw.cursor() as cur:  # statement by statement, as psql sends them
            for statement in runbook_sql().replace("kiln-AbCdEfG", prefix).split(";\n"):
                if statement.strip():
                    cur.execute(statement)
            shown = cur.fetchall()
    finally:
        raw.close()
    row = key_row(engine, prefix)
    assert (row["limit_usd"], row["rpm_limit"], row["limit_reset"]) == (None, None, "monthly")
    assert (row["period_start"], row["period_spent_nanos"]) == \
        (period_start("monthly", now), 40)
    assert shown[0][0] == prefix
    assert f"key {prefix}" not in kiln(url, "credits", "reconcile", code=1).stderr


def test_a_restricted_key_reads_only_itself_until_given_org_read(start_gateway, engine):
    """A key created with a spend limit (or a model allow-list) has no ``org_read``: it sees
    itself in ``GET /v1/keys`` and its own rows in ``GET /v1/activity``; the operator's plain
    key sees the org's. ``kiln key set --org-read`` gives it the org's view."""
    gw = start_gateway(key_cache_ttl_s=0.2)
    org = make_org(engine, f"scoped-{uuid.uuid4().hex[:8]}")
    from gateway.api import auth
    with engine.begin() as conn:
        bot = auth.create_key(conn, org.id, name="ci-bot", limit_usd=Decimal("3"))
        app = auth.create_key(conn, org.id, name="app", allowed_models=["fake-model"])
        wide = auth.create_key(conn, org.id, name="wide", allowed_models=["fake-model"],
                               org_read=True)

    def listed(key):
        r = requests.get(gw.base_url + "/v1/keys", timeout=30,
                         headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return sorted((k["prefix"], k["org_read"]) for k in r.json()["data"])

    every = sorted([(org.key[:12], True), (bot[:12], False), (app[:12], False),
                    (wide[:12], True)])
    assert listed(org.key) == every == listed(wide)
    assert listed(bot) == [(bot[:12], False)] and listed(app) == [(app[:12], False)]
    activity = requests.get(gw.base_url + "/v1/activity", timeout=30,
                            headers={"Authorization": f"Bearer {bot}"}).json()
    assert activity["scope"] == "key"
    assert requests.get(gw.base_url + "/v1/activity", timeout=30,
                        headers={"Authorization": f"Bearer {org.key}"}).json()["scope"] == "org"
    kiln(gw.env["KILN_DATABASE_URL"], "key", "set", bot[:12], "--org-read")
    wait_until(lambda: len(listed(bot)) == 4)


def test_the_operator_creates_a_management_key_and_every_change_is_recorded(db):
    """``kiln key create --manage`` makes a management key (it reads the org's keys);
    ``--in-flight`` caps a key; create, set and revoke are each a row of ``key_changes`` by the
    operator, which the database keeps append-only."""
    _dialect, url, engine = db
    _secret, admin = create(url, "--manage", "--label", "admin")
    _bot, bot = create(url, "--in-flight", "3", "--limit", "2")
    assert (key_row(engine, admin)["manage"], key_row(engine, admin)["org_read"]) == (True, True)
    assert (key_row(engine, bot)["manage"], key_row(engine, bot)["in_flight_limit"]) == \
        (False, 3)
    kiln(url, "key", "set", bot, "--rpm", "9")
    kiln(url, "key", "set", bot, "--no-in-flight")
    assert key_row(engine, bot)["in_flight_limit"] is None
    kiln(url, "key", "revoke", bot)
    kiln(url, "key", "revoke", bot, code=1)  # already revoked: nothing more recorded
    with engine.connect() as conn:
        rows = conn.execute(sa.text(
            "SELECT k.prefix, c.action, c.actor, c.actor_key_id, c.changes FROM key_changes c "
            "JOIN api_keys k ON k.id = c.api_key_id ORDER BY c.id")).all()
    assert [(r.prefix, r.action, r.actor, r.actor_key_id) for r in rows] == [
        (admin, "create", "operator", None), (bot, "create", "operator", None),
        (bot, "update", "operator", None), (bot, "update", "operator", None),
        (bot, "revoke", "operator", None)]
    assert json.loads(rows[0].changes) == {"name": "admin", "manage": True}
    assert json.loads(rows[1].changes) == {"in_flight_limit": 3, "limit_usd": "2"}
    assert json.loads(rows[2].changes) == {"rpm_limit": 9}
    assert json.loads(rows[3].changes) == {"in_flight_limit": None}
    for statement in ("UPDATE key_changes SET actor = 'key'", "DELETE FROM key_changes"):
        with pytest.raises(sa.exc.DBAPIError, match="append-only"), engine.begin() as conn:
            conn.execute(sa.text(statement))
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM key_changes")).scalar_one() == 5
