"""The ``kiln`` command as an operator runs it (the real console script, on Postgres and on the
SQLite file of ``make run``): every amount is an exact, finite decimal the balance can hold, or a
clear error that writes nothing; org references are names, ids only as ``id:N``."""
import os
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlalchemy as sa

from factories import CATALOG
from factories import UNREACHABLE_BACKEND
from gateway import create_app
from gateway_proc import create_database, drop_database

KILN = str(Path(sys.executable).with_name("kiln"))
MAX_NANOS = 2**63 - 1

# Refused everywhere: not plain decimal notation, zero, or finer than a nano-dollar.
BAD_AMOUNTS = ["NaN", "-sNaN", "Infinity", "-inf", "1e400", "1E2", "0x10", "1_000",
               "\uff11\uff10", "", " 5", "1,5", "1.2.3", "five", "0", "-0.000000000",
               "1.0000000001", "0.0000000005", "99999999999.999999999", "1" + "0" * 30]
TOO_BIG = {"postgres": ["9223372036.854775808", "-9223372036.854775808"],
           "sqlite": ["1000000", "-1000000", "9223372036.854775807", "1234567.123456789"]}


@pytest.fixture(params=["postgres", "sqlite"])
def db(request, tmp_path):
    """An empty database migrated by ``kiln db upgrade``: ``(dialect, url, engine)``."""
    if request.param == "postgres":
        name = f"kiln_cli_{uuid.uuid4().hex[:10]}"
        url = create_database(name)
    else:
        url = f"sqlite:///{tmp_path}/kiln.db"
    kiln(url, "db", "upgrade")
    engine = sa.create_engine(url)
    yield request.param, url, engine
    engine.dispose()
    if request.param == "postgres":
        drop_database(name)


def kiln(url, *args, check=True):
    """Run the ``kiln`` command on ``url``; arguments may be bytes (argv is bytes on Linux)."""
    result = subprocess.run([KILN, *args], capture_output=True, timeout=120,
                            env={**os.environ, "KILN_DATABASE_URL": url})
    result.stdout, result.stderr = (result.stdout.decode(errors="replace"),
                                    result.stderr.decode(errors="replace"))
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def ledger(engine, org_id):
    """Return ``(number of grants, balance_nanos)`` of an org."""
    with engine.connect() as conn:
        grants = conn.execute(sa.text("SELECT count(*) FROM credit_grants WHERE org_id = :o"),
                              {"o": org_id}).scalar_one()
        balance = conn.execute(sa.text("SELECT balance_nanos FROM credit_balances "
                                       "WHERE org_id = :o"), {"o": org_id}).scalar_one()
    return grants, balance


def refused(result, *words):
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr and result.stdout == ""
    for word in words:
        assert word in result.stderr, (word, result.stderr)


def test_amounts_outside_the_rules_are_refused_and_nothing_is_written(db):
    dialect, url, engine = db
    org_id = int(kiln(url, "org", "create", "acme").stdout)
    amounts = BAD_AMOUNTS + TOO_BIG[dialect]
    with ThreadPoolExecutor(2) as pool:  # one command each, as an operator types them
        results = pool.map(lambda a: kiln(url, "credits", "grant", "acme", "--", a,
                                          check=False), amounts)
        for amount, result in zip(amounts, results, strict=True):
            refused(result, "Invalid value for USD", repr(amount))
    assert ledger(engine, org_id) == (0, 0)


def test_exact_amounts_are_recorded_to_the_nano_dollar(db):
    dialect, url, engine = db
    org_id = int(kiln(url, "org", "create", "acme").stdout)
    expected = 0
    for amount, nanos in [("2.500000001", 2_500_000_001), ("+1", 10**9), ("1.", 10**9),
                          (".5", 5 * 10**8), ("-0.5", -5 * 10**8), ("1.5000000000", 15 * 10**8),
                          ("999999.999999999", 999_999_999_999_999),
                          ("123456.123456789", 123_456_123_456_789)]:
        kiln(url, "credits", "grant", "acme", "--", amount)
        expected += nanos
        assert ledger(engine, org_id)[1] == expected, amount
    # A negative amount typed as README "Administration" shows it, without "--".
    kiln(url, "credits", "grant", "acme", "-0.25", "--note", "correction")
    expected -= 25 * 10**7
    assert ledger(engine, org_id)[1] == expected
    if dialect == "postgres":
        rich = int(kiln(url, "org", "create", "rich").stdout)
        kiln(url, "credits", "grant", "rich", "9223372036.854775807")
        assert ledger(engine, rich)[1] == MAX_NANOS
    # `kiln credits reconcile` agrees with the trigger on every one of them.
    rows = kiln(url, "credits", "reconcile").stdout.splitlines()[1:]
    assert rows and all(row.endswith("ok") for row in rows)


def test_a_grant_past_the_largest_balance_is_refused(db):
    _, url, engine = db
    org_id = int(kiln(url, "org", "create", "acme").stdout)
    kiln(url, "credits", "grant", "acme", "1")
    with engine.begin() as conn:  # as after years of top-ups
        conn.execute(sa.text("UPDATE credit_balances SET balance_nanos = :b WHERE org_id = :o"),
                     {"b": MAX_NANOS - 5, "o": org_id})
    refused(kiln(url, "credits", "grant", "acme", "0.000000006", check=False),
            "refused", "9223372036.854775807 USD")
    assert ledger(engine, org_id) == (1, MAX_NANOS - 5)
    kiln(url, "credits", "grant", "acme", "0.000000005")
    assert ledger(engine, org_id) == (2, MAX_NANOS)


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)  # the same query on both
def test_org_references_are_names_and_ids_only_as_id_prefix(db):
    _, url, engine = db
    first = int(kiln(url, "org", "create", "first").stdout)
    # The org named after the first org's id: a bare number is always a name.
    named = int(kiln(url, "org", "create", str(first)).stdout)
    assert named != first
    kiln(url, "credits", "grant", str(first), "3")
    kiln(url, "credits", "grant", f"id:{first}", "5")
    assert ledger(engine, named)[1] == 3 * 10**9 and ledger(engine, first)[1] == 5 * 10**9
    assert "balance_usd=5 " in kiln(url, "credits", "show", f"id:{first}").stdout
    assert "balance_usd=3 " in kiln(url, "credits", "show", str(first)).stdout
    kiln(url, "org", "set", f"id:{first}", "--limit", "3")
    assert kiln(url, "key", "create", f"id:{first}").stdout.strip().startswith("kiln-")
    # An id written bare, where no org has that name: refused, with the right spelling.
    refused(kiln(url, "credits", "grant", str(named), "1", check=False),
            f"no org named '{named}'", f"id:{named}")
    for ref in ("id:", "id:x", "id:-1", "id:99999", "nobody", b"no\xffbody"):
        refused(kiln(url, "credits", "show", ref, check=False), "no org")
    assert ledger(engine, named) == (1, 3 * 10**9) and ledger(engine, first) == (1, 5 * 10**9)


@pytest.mark.parametrize("db", ["postgres"], indirect=True)  # it enforces the name's length
def test_org_names_that_would_be_ambiguous_or_unstorable_are_refused(db):
    _, url, engine = db
    for name in ("id:9", "ID:9", "", " lead", "trail ", "tab\there", "x" * 201, b"a\xffb",
                 "no\u00a0break"):
        refused(kiln(url, "org", "create", name, check=False), "Invalid value for NAME")
    for name in ("7", "Acme Corp", "\u00fcn\u00efc\u00f6d\u00e9", "y" * 200):
        kiln(url, "org", "create", name)
    with engine.connect() as conn:
        names = conn.execute(sa.text("SELECT name FROM orgs ORDER BY id")).scalars().all()
    assert names == ["7", "Acme Corp", "\u00fcn\u00efc\u00f6d\u00e9", "y" * 200]


@pytest.mark.parametrize("db", ["postgres"], indirect=True)  # it refuses NUL and bad UTF-8
def test_text_options_the_database_cannot_store_are_refused(db):
    _, url, engine = db
    org_id = int(kiln(url, "org", "create", "acme").stdout)
    refused(kiln(url, "credits", "grant", "acme", "1", "--note", b"bad\xffnote", check=False),
            "Invalid value for '--note'")
    refused(kiln(url, "key", "create", "acme", "--name", b"\xfe", check=False),
            "Invalid value for '--name'")
    refused(kiln(url, "key", "revoke", b"kiln-\xff", check=False), "Invalid value for 'PREFIX'")
    refused(kiln(url, "maintenance", "on", "--message", "two\nlines", check=False),
            "Invalid value for '--message'")
    assert ledger(engine, org_id) == (0, 0)
    assert "maintenance=off" in kiln(url, "maintenance", "status").stdout


def org_row(engine, org_id):
    """Return ``(in_flight_limit, status)`` of an org."""
    with engine.connect() as conn:
        return tuple(conn.execute(sa.text("SELECT in_flight_limit, status FROM orgs "
                                          "WHERE id = :o"), {"o": org_id}).one())


def test_org_create_with_a_limit_and_org_set_change_the_org(db):
    _, url, engine = db
    limited = int(kiln(url, "org", "create", "limited", "--limit", "16").stdout)
    plain = int(kiln(url, "org", "create", "plain").stdout)
    assert org_row(engine, limited) == (16, "active")
    assert org_row(engine, plain) == (None, "active")  # KILN_DEFAULT_IN_FLIGHT_LIMIT applies
    kiln(url, "org", "set", "plain", "--limit", "3")
    assert org_row(engine, plain) == (3, "active")
    kiln(url, "org", "set", f"id:{plain}", "--status", "suspended")
    assert org_row(engine, plain) == (3, "suspended")
    kiln(url, "org", "set", "plain", "--status", "active", "--limit", "1")
    assert org_row(engine, plain) == (1, "active")
    assert org_row(engine, limited) == (16, "active")  # the other org is untouched


def test_org_limits_and_statuses_outside_the_rules_are_refused(db):
    _, url, engine = db
    org_id = int(kiln(url, "org", "create", "acme", "--limit", "4").stdout)
    for args, words in [(["--limit", "0"], ["Invalid value for '--limit'"]),
                        (["--limit", "-2"], ["Invalid value for '--limit'"]),
                        (["--limit", "many"], ["Invalid value for '--limit'"]),
                        (["--status", "closed"], ["Invalid value for '--status'"]),
                        ([], ["nothing to change"])]:
        refused(kiln(url, "org", "set", "acme", *args, check=False), *words)
    refused(kiln(url, "org", "set", "nobody", "--limit", "2", check=False), "no org")
    refused(kiln(url, "org", "create", "other", "--limit", "0", check=False),
            "Invalid value for '--limit'")
    assert org_row(engine, org_id) == (4, "active")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM orgs")).scalar_one() == 1


INT_MAX = 2**31 - 1  # a Postgres INTEGER
TOO_LARGE = [str(INT_MAX + 1), "9" * 20, "1" + "0" * 400]


def test_integer_options_beyond_their_column_are_refused_and_nothing_is_written(db):
    _, url, engine = db
    org_id = int(kiln(url, "org", "create", "acme", "--limit", "4").stdout)
    kiln(url, "key", "create", "acme", "--rpm", "60")
    range_words = f"is not in the range 1<=x<={INT_MAX}"
    for value in TOO_LARGE:
        for args in (["org", "create", "big", "--limit", value],
                     ["org", "set", "acme", "--limit", value],
                     ["maintenance", "on", "--retry-after", value],
                     ["key", "create", "acme", "--rpm", value]):
            result = kiln(url, *args, check=False)
            refused(result, "Invalid value for", range_words)
            assert result.returncode == 2, (args, result.returncode)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM orgs")).scalar_one() == 1
        assert conn.execute(sa.text("SELECT rpm_limit FROM api_keys")).scalar_one() == 60
    assert org_row(engine, org_id) == (4, "active")
    assert "maintenance=off" in kiln(url, "maintenance", "status").stdout


def test_integer_options_at_their_column_maximum_are_stored_as_given(db):
    _, url, engine = db
    org_id = int(kiln(url, "org", "create", "big", "--limit", str(INT_MAX)).stdout)
    assert org_row(engine, org_id) == (INT_MAX, "active")
    kiln(url, "org", "set", "big", "--limit", str(INT_MAX - 1))
    assert org_row(engine, org_id) == (INT_MAX - 1, "active")
    assert f"retry_after_s={INT_MAX} " in kiln(url, "maintenance", "on", "--retry-after",
                                               str(INT_MAX)).stdout
    kiln(url, "key", "create", "big", "--rpm", str(INT_MAX))
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT rpm_limit FROM api_keys")).scalar_one() == INT_MAX


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_what_org_set_changes_is_what_the_gateway_enforces(db, tmp_path):
    _, url, engine = db
    kiln(url, "org", "create", "acme", "--limit", "5")
    key = kiln(url, "key", "create", "acme").stdout.strip().splitlines()[-1]
    app = create_app({"database_url": url, "models": str(catalog(tmp_path)),
                      "sweep_interval_s": 0, "key_cache_ttl_s": 0})
    client, headers = app.test_client(), {"Authorization": f"Bearer {key}"}
    assert client.get("/v1/credits", headers=headers).get_json()["in_flight_limit"] == 5
    kiln(url, "org", "set", "acme", "--limit", "2")
    assert client.get("/v1/credits", headers=headers).get_json()["in_flight_limit"] == 2
    kiln(url, "org", "set", "acme", "--status", "suspended")
    r = client.get("/v1/credits", headers=headers)
    assert (r.status_code, r.get_json()["error"]["code"]) == (403, "org_suspended")


def catalog(directory):
    path = Path(directory) / "models.toml"
    path.write_text(CATALOG.format(url=UNREACHABLE_BACKEND))
    return path


def test_a_key_for_a_model_that_is_not_in_the_catalog_is_refused(db):
    """``kiln key create --models`` names catalog ids (KILN_MODELS; here the demo catalog's
    smollm2-135m): a misspelt id would make a key that can call nothing, so it writes nothing."""
    _dialect, url, engine = db
    kiln(url, "org", "create", "acme")
    refused = kiln(url, "key", "create", "acme", "--models", "smollm2-135m,smolm2", check=False)
    assert refused.returncode == 2
    assert "not in the catalog: 'smolm2'" in refused.stderr and "smollm2-135m" in refused.stderr
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM api_keys")).scalar() == 0
    kiln(url, "key", "create", "acme", "--models", "smollm2-135m")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT allowed_models FROM api_keys")).scalar() \
            == "smollm2-135m"
