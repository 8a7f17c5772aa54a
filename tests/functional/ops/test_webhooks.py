"""Webhooks end to end (docs/WEBHOOKS.md): the real gateway on its own Postgres database, a real
HTTP receiver (tests/support/webhook_receiver.py) that checks every signature as the Standard
Webhooks specification tells a receiver to, webhooks set by ``kiln webhook`` and by plain SQL.

Each event is delivered once per occurrence (a debit crossing the threshold, the first refusal
between two grants); a receiver that is down for several retry rounds gets every event once it
is back; an event whose attempts are used up is marked failed and counted; two workers deliver
each event once by their own bookkeeping, both at work at the same moment; private addresses
are refused by ``kiln webhook add`` unless allowed. Short backoffs and polls stand for the
minutes of production: nothing here waits on a clock, only for outcomes, with generous
deadlines.
"""
import os
import re
import subprocess
import sys
import uuid
from decimal import Decimal
from pathlib import Path

import pytest
import requests
import sqlalchemy as sa

from factories import fake_model_nanos
from fake_upstream import chat_completion, json_reply, make_usage
from gateway.ledger.outbox import scan_expiring
from gateway_proc import (Gateway, balance_nanos, create_database, drop_database, gateway_env,
                          make_org, metric, migrate, settled_event, wait_until)
from webhook_receiver import Receiver, verify

pytestmark = pytest.mark.postgres

KILN = str(Path(sys.executable).with_name("kiln"))
CHAT = "/v1/chat/completions"
# Production retries over minutes; here over a fraction of a second per round.
FAST = {"webhook_poll_s": 0.1, "webhook_backoff_s": 0.2, "webhook_backoff_max_s": 0.5,
        "webhook_timeout_s": 5, "webhook_expiring_scan_s": 0.5}
DEADLINE_S = 60


@pytest.fixture(scope="module")
def wh_url():
    """A database of this module's own (its outbox and its ``api_keys.expires_at`` are no
    other test's), migrated to head."""
    name = f"kiln_webhooks_{os.getpid()}"
    url = create_database(name)
    migrate(url)
    yield url
    drop_database(name)


@pytest.fixture(scope="module")
def wh_engine(wh_url):
    engine = sa.create_engine(wh_url)
    yield engine
    engine.dispose()


@pytest.fixture
def start(wh_url, catalog_path):
    """Factory: a gateway on this module's database with :data:`FAST` and ``overrides``."""
    started = []

    def run(workers=1, **overrides):
        gw = Gateway(gateway_env(wh_url, catalog_path, **{**FAST, **overrides}),
                     workers=workers).start()
        started.append(gw)
        return gw
    yield run
    for gw in started:
        gw.stop()


@pytest.fixture
def receiver():
    with Receiver() as r:
        yield r


def new_org(engine, usd="10"):
    return make_org(engine, f"wh-{uuid.uuid4().hex[:10]}", usd=usd)


def add_hook(engine, org, url, events, below=None):
    """Add a webhook by plain SQL, as an operator may: the database draws its secret. Return
    ``(id, secret)``."""
    with engine.begin() as conn:
        return tuple(conn.execute(sa.text(
            "INSERT INTO webhooks (org_id, url, events, balance_below_usd, allow_private) "
            "VALUES (:o, :u, :e, CAST(:b AS NUMERIC(20, 9)), true) RETURNING id, secret"),
            {"o": org.id, "u": url, "e": events, "b": below}).one())


def grant(engine, org, usd):
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO credit_grants (org_id, amount_usd, note) "
                             "VALUES (:o, CAST(:a AS NUMERIC(20, 9)), 'webhook test')"),
                     {"o": org.id, "a": usd})


def outbox(engine, webhook_id):
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT * FROM webhook_outbox WHERE webhook_id = :w "
                                    "ORDER BY id"), {"w": webhook_id}).mappings().all()


def attempts_log(engine, webhook_id):
    with engine.connect() as conn:
        return conn.execute(sa.text(
            "SELECT d.* FROM webhook_deliveries d JOIN webhook_outbox o ON o.id = d.outbox_id "
            "WHERE o.webhook_id = :w ORDER BY d.outbox_id, d.attempt"),
            {"w": webhook_id}).mappings().all()


def chat(gw, org, **body):
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}], **body}
    return requests.post(gw.base_url + CHAT, json=body, headers=org.headers, timeout=30)


def delivered(engine, webhook_id, count):
    """Wait until ``count`` events of the webhook are delivered; return its outbox rows."""
    return wait_until(lambda: (rows := outbox(engine, webhook_id))
                      and sum(r["status"] == "delivered" for r in rows) >= count and rows,
                      timeout_s=DEADLINE_S)


def kiln(url, *args, check=True, **env):
    result = subprocess.run([KILN, *args], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "KILN_DATABASE_URL": url, **env})
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_balance_low_once_per_crossing_with_the_exact_balance(start, receiver, wh_engine, fake):
    gw = start()
    org = new_org(wh_engine, usd="10")
    hook, secret = add_hook(wh_engine, org, receiver.url + "/low", "balance.low", below="10")
    first = chat(gw, org)
    assert first.status_code == 200, first.text
    cost = settled_event(wh_engine, first.headers["X-Neocloud-Generation-Id"])["cost_nanos"]
    assert cost == fake_model_nanos(**{k: first.json()["usage"][f"{k}_tokens"]
                                       for k in ("prompt", "completion")}) > 0
    second = chat(gw, org)  # still below: no second event
    assert second.status_code == 200
    settled_event(wh_engine, second.headers["X-Neocloud-Generation-Id"])
    rows = delivered(wh_engine, hook, 1)
    assert [r["event_type"] for r in rows] == ["balance.low"]
    [sent] = wait_until(lambda: receiver.at("/low"), timeout_s=DEADLINE_S)
    event = verify(secret, sent)
    assert sent.id == f"msg_{rows[0]['id']}"
    assert event["type"] == "balance.low"
    assert event["data"] == {"org_id": org.id, "org": org.name,
                             "balance_usd": str((Decimal(10 * 10**9 - cost) / 10**9)
                                                .quantize(Decimal("1e-9"))),
                             "threshold_usd": "10.000000000"}
    # A top-up to the threshold arms it again: the next debit below is a new crossing.
    balance = balance_nanos(wh_engine, org.id)[0]
    grant(wh_engine, org, str(Decimal(10 * 10**9 - balance) / 10**9))
    assert balance_nanos(wh_engine, org.id)[0] == 10 * 10**9
    assert chat(gw, org).status_code == 200
    assert len(delivered(wh_engine, hook, 2)) == 2


def test_credits_refused_once_between_grants_by_a_cli_webhook(start, receiver, wh_engine,
                                                               wh_url):
    gw = start()
    org = new_org(wh_engine, usd="0.0001")  # below any hold of fake-model at max_tokens 1024
    added = kiln(wh_url, "webhook", "add", org.name, receiver.url + "/refused",
                 "--events", "credits.refused", "--allow-private")
    hook_id, secret = (int(added.stdout.split()[0]), added.stdout.splitlines()[-1])
    for _ in range(3):
        refused = chat(gw, org, max_tokens=1024)
        assert refused.status_code == 402
        assert refused.json()["error"]["code"] == "insufficient_credits"
    assert len(outbox(wh_engine, hook_id)) == 1  # written with the refusal: three refusals, one
    grant(wh_engine, org, "0.00001")  # a top-up that still does not cover the hold
    assert chat(gw, org, max_tokens=1024).status_code == 402
    rows = delivered(wh_engine, hook_id, 2)
    assert len(rows) == 2
    sent = wait_until(lambda: len(got := receiver.at("/refused")) >= 2 and got,
                      timeout_s=DEADLINE_S)
    # Both can be claimed in one poll and sent at once: their ids give the order they happened.
    assert sorted(d.id for d in sent) == sorted(f"msg_{r['id']}" for r in rows)
    sent = sorted(sent, key=lambda d: int(d.id.removeprefix("msg_")))
    events = [verify(secret, d) for d in sent]
    assert [e["type"] for e in events] == ["credits.refused"] * 2
    assert events[0]["data"]["balance_usd"] == "0.000100000"
    assert events[1]["data"]["balance_usd"] == "0.000110000"
    assert all(e["data"]["code"] == "insufficient_credits"
               and Decimal(e["data"]["refused_hold_usd"]) > Decimal(e["data"]["available_usd"])
               for e in events)


def test_key_limit_reached_once_per_period_and_limit(start, receiver, wh_engine):
    gw = start()
    org = new_org(wh_engine)
    hook, secret = add_hook(wh_engine, org, receiver.url + "/key", "key.limit_reached")
    with wh_engine.begin() as conn:  # as an operator sets a limit (deploy/RUNBOOK.md)
        conn.execute(sa.text("UPDATE api_keys SET limit_usd = 0.000001 WHERE org_id = :o"),
                     {"o": org.id})
    for _ in range(2):
        refused = chat(gw, org)
        assert refused.status_code == 402
        assert refused.json()["error"]["code"] == "key_limit_exceeded"
    assert len(outbox(wh_engine, hook)) == 1
    delivered(wh_engine, hook, 1)
    [sent] = wait_until(lambda: receiver.at("/key"), timeout_s=DEADLINE_S)
    event = verify(secret, sent)
    assert event["type"] == "key.limit_reached"
    assert event["data"]["cause"] == "refused"
    assert event["data"]["limit_usd"] == "0.000001000"
    assert event["data"]["key_prefix"] == org.key[:len(event["data"]["key_prefix"])]


def test_key_limit_reached_when_the_spend_reaches_it(start, receiver, wh_engine, fake):
    """A backend that reports more than the hold is billed up to what the key's limit leaves
    (README, "Metering"): the spend then equals the limit, and the key's trigger tells."""
    gw = start()
    org = new_org(wh_engine)
    hook, secret = add_hook(wh_engine, org, receiver.url + "/spent", "key.limit_reached")
    with wh_engine.begin() as conn:
        conn.execute(sa.text("UPDATE api_keys SET limit_usd = 0.001, limit_reset = 'monthly' "
                             "WHERE org_id = :o"), {"o": org.id})
    fake.enqueue(json_reply(chat_completion("Hello", usage=make_usage(10, 100000))))
    answer = chat(gw, org, max_tokens=10)
    assert answer.status_code == 200, answer.text
    event_row = settled_event(wh_engine, answer.headers["X-Neocloud-Generation-Id"])
    assert event_row["cost_nanos"] == 10**6 and event_row["anomaly"]
    delivered(wh_engine, hook, 1)
    [sent] = wait_until(lambda: receiver.at("/spent"), timeout_s=DEADLINE_S)
    event = verify(secret, sent)
    assert event["type"] == "key.limit_reached"
    assert {k: event["data"][k] for k in ("cause", "limit_usd", "spent_usd", "limit_reset")} \
        == {"cause": "spent", "limit_usd": "0.001000000", "spent_usd": "0.001000000",
            "limit_reset": "monthly"}
    # The next request is refused by the same limit in the same period: the same news.
    assert chat(gw, org).json()["error"]["code"] == "key_limit_exceeded"
    assert len(outbox(wh_engine, hook)) == 1


def test_key_expiring_where_keys_have_an_expiry(start, receiver, wh_engine):
    """``api_keys.expires_at`` belongs to the keys' own migration; on a database that has the
    column, a key expiring within the window is announced once."""
    start()
    org = new_org(wh_engine)
    hook, secret = add_hook(wh_engine, org, receiver.url + "/expiring", "key.expiring")
    with wh_engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE api_keys ADD COLUMN IF NOT EXISTS expires_at "
                             "timestamptz"))
        conn.execute(sa.text("UPDATE api_keys SET expires_at = now() + interval '1 hour' "
                             "WHERE org_id = :o"), {"o": org.id})
    delivered(wh_engine, hook, 1)
    [sent] = wait_until(lambda: receiver.at("/expiring"), timeout_s=DEADLINE_S)
    event = verify(secret, sent)
    assert event["type"] == "key.expiring"
    assert event["data"]["org_id"] == org.id and event["data"]["expires_at"]
    # Another scan (the workers' own function) finds the same key and expiry: nothing new.
    assert scan_expiring(wh_engine, 7 * 24 * 3600) == 0
    assert len(outbox(wh_engine, hook)) == 1


def crossings(engine, org, count):
    """Take the org's balance from 10 to 4 and back ``count`` times by plain SQL grants: each
    is one balance.low crossing of a threshold of 5."""
    for _ in range(count):
        grant(engine, org, "-6")
        grant(engine, org, "6")


def test_a_receiver_down_for_retry_rounds_gets_every_event_after(start, wh_engine):
    receiver = Receiver()  # not started: its port refuses connections
    start(webhook_max_attempts=1000)
    org = new_org(wh_engine)
    hook, secret = add_hook(wh_engine, org, receiver.url + "/down", "balance.low", below="5")
    crossings(wh_engine, org, 3)
    # Several retry rounds fail while it is down, each logged without an HTTP status.
    wait_until(lambda: len(rows := outbox(wh_engine, hook)) == 3
               and all(r["attempts"] >= 3 for r in rows), timeout_s=DEADLINE_S)
    failures = attempts_log(wh_engine, hook)
    assert failures and all(f["status_code"] is None and "ConnectionError" in f["error"]
                            for f in failures)
    assert all(r["status"] == "pending" for r in outbox(wh_engine, hook))
    with receiver:
        rows = delivered(wh_engine, hook, 3)
        sent = wait_until(lambda: len(got := receiver.at("/down")) >= 3 and got,
                          timeout_s=DEADLINE_S)
    assert sorted(d.id for d in sent) == sorted(f"msg_{r['id']}" for r in rows)
    assert all(verify(secret, d)["type"] == "balance.low" for d in sent)
    last = {f["outbox_id"]: f for f in attempts_log(wh_engine, hook)}
    assert all(f["status_code"] == 204 and f["error"] is None for f in last.values())


def test_attempts_are_bounded_then_the_event_is_failed(start, wh_engine):
    with Receiver(status=500) as receiver:
        gw = start(webhook_max_attempts=3)
        org = new_org(wh_engine)
        hook, secret = add_hook(wh_engine, org, receiver.url + "/500", "balance.low",
                                below="5")
        crossings(wh_engine, org, 1)
        [row] = wait_until(lambda: (rows := outbox(wh_engine, hook))
                           and rows[0]["status"] == "failed" and rows, timeout_s=DEADLINE_S)
        sent = receiver.at("/500")
    assert row["attempts"] == 3 and row["finished_at"] is not None
    log = attempts_log(wh_engine, hook)
    assert [(f["attempt"], f["status_code"], f["error"]) for f in log] == [
        (1, 500, "HTTP 500"), (2, 500, "HTTP 500"), (3, 500, "HTTP 500")]
    # Every attempt is the same message (one webhook-id), signed anew.
    assert [d.id for d in sent] == [f"msg_{row['id']}"] * 3
    assert all(verify(secret, d) for d in sent)
    assert metric(gw.base_url, "kiln_webhooks_failed_total", event="balance.low") == 1
    assert metric(gw.base_url, "kiln_webhook_attempts_failed_total", event="balance.low") == 2


def test_two_workers_deliver_each_event_once(start, wh_engine):
    """Each worker takes one event at a time; the receiver holds the first until a second
    arrives, which only the other worker can have sent: both deliver at once, and every event
    arrives once, on its first attempt."""
    with Receiver(hold_for_pair_s=30) as receiver:
        org = new_org(wh_engine)
        hook, secret = add_hook(wh_engine, org, receiver.url + "/pair", "balance.low",
                                below="5")
        crossings(wh_engine, org, 10)
        gw = start(workers=2, webhook_batch=1, webhook_poll_s=0.05)
        rows = delivered(wh_engine, hook, 10)
        sent = receiver.at("/pair")
    assert len(rows) == 10
    assert sorted(d.id for d in sent) == sorted(f"msg_{r['id']}" for r in rows)
    assert all(r["attempts"] == 1 for r in rows)
    assert receiver.most_at_once == 2
    log = attempts_log(wh_engine, hook)
    assert len(log) == 10 and len({f["deliverer"] for f in log}) == 2
    assert all(verify(secret, d) for d in sent)
    assert metric(gw.base_url, "kiln_webhooks_delivered_total", event="balance.low") == 10
    wait_until(lambda: outbox_depth(gw) == 0, timeout_s=DEADLINE_S)  # the gauge comes down


def outbox_depth(gw):
    """``kiln_webhook_outbox_depth`` as served (None while absent)."""
    found = re.search(r"^kiln_webhook_outbox_depth(?:\{[^}]*\})? (\S+)$",
                      requests.get(gw.base_url + "/metrics", timeout=10).text, re.M)
    return None if found is None else float(found.group(1))


def test_cli_refuses_private_urls_unless_allowed_and_never_lists_a_secret(wh_url, wh_engine,
                                                                         tmp_path):
    org = new_org(wh_engine)
    count = f"SELECT count(*) FROM webhooks WHERE org_id = {org.id}"
    for url in ("http://127.0.0.1:9/x", "http://localhost/x"):  # more: test_webhook_signing
        refused = kiln(wh_url, "webhook", "add", org.name, url, "--events", "balance.low",
                       "--balance-below", "5", check=False)
        assert refused.returncode == 2 and "private or loopback" in refused.stderr, refused
    refused = kiln(wh_url, "webhook", "add", org.name, "http://127.0.0.1:9/x", "--events",
                   "balance.high", "--allow-private", check=False)
    assert refused.returncode == 2 and "balance.low, key.limit_reached" in refused.stderr
    with wh_engine.connect() as conn:
        assert conn.execute(sa.text(count)).scalar_one() == 0
    # The setting allows them as --allow-private does.
    added = kiln(wh_url, "webhook", "add", org.name, "http://127.0.0.1:9/x", "--events",
                 "credits.refused,balance.low", "--balance-below", "2.5",
                 KILN_WEBHOOK_ALLOW_PRIVATE="true")
    hook_id, secret = int(added.stdout.split()[0]), added.stdout.splitlines()[-1]
    assert re.fullmatch(r"whsec_[A-Za-z0-9+/]{43}=", secret)
    listed = kiln(wh_url, "webhook", "list", org.name).stdout
    assert secret not in listed and "whsec_" not in listed
    [line] = [ln for ln in listed.splitlines() if ln.startswith(f"{hook_id}\t")]
    assert line.split("\t")[1:6] == [org.name, "http://127.0.0.1:9/x",
                                     "credits.refused,balance.low", "2.500000000", "True"]
    assert kiln(wh_url, "webhook", "remove", str(hook_id)).stdout.strip() == \
        f"removed webhook {hook_id}"
    assert kiln(wh_url, "webhook", "remove", str(hook_id), check=False).returncode == 1
    with wh_engine.connect() as conn:
        assert conn.execute(sa.text(count)).scalar_one() == 0
    sqlite_url = f"sqlite:///{tmp_path}/kiln.db"
    kiln(sqlite_url, "db", "upgrade")
    on_sqlite = kiln(sqlite_url, "webhook", "list", check=False)
    assert on_sqlite.returncode == 1 and "webhooks need Postgres" in on_sqlite.stderr


def test_a_webhook_removed_takes_its_events_and_log(wh_engine):
    org = new_org(wh_engine)
    hook, _ = add_hook(wh_engine, org, "http://127.0.0.1:9/x", "balance.low", below="5")
    crossings(wh_engine, org, 1)
    assert len(outbox(wh_engine, hook)) == 1
    with wh_engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM webhooks WHERE id = :w"), {"w": hook})
    assert outbox(wh_engine, hook) == []


def test_a_failing_deliverer_is_named_by_readyz_and_restarted(start, wh_engine):
    """The deliverer is a background greenlet like the ledger's: a database error stops it for
    a backoff, ``/readyz`` names it meanwhile, and it runs again."""
    gw = start()

    def ready():
        answer = requests.get(gw.base_url + "/readyz", timeout=10)
        return answer.status_code, answer.json()
    wait_until(lambda: ready()[0] == 200, timeout_s=DEADLINE_S)
    with wh_engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE webhook_outbox RENAME TO webhook_outbox_away"))
    try:
        status, body = wait_until(lambda: (r := ready())[0] == 503 and r, timeout_s=DEADLINE_S)
        assert "webhooks" in body["background"], body
    finally:
        with wh_engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE webhook_outbox_away RENAME TO webhook_outbox"))
    wait_until(lambda: ready()[0] == 200, timeout_s=DEADLINE_S)
    restarts = re.search(r'^kiln_background_restarts_total\{name="webhooks"\} (\S+)$',
                         requests.get(gw.base_url + "/metrics", timeout=10).text, re.M)
    assert restarts is not None and float(restarts.group(1)) >= 1
