"""``GET /v1/activity``: the caller's org by UTC day × model × key, from the daily rollup.

Through the real gateway on Postgres, the sums equal the usage events and the balance change;
on the SQLite file of ``make run`` (Flask's test client), the 30-day window and ``?date=``.
"""
import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest
import requests
import sqlalchemy as sa

from fake_upstream import Hang, Status, chat_completion, error_reply, json_reply, make_usage
from gateway.api import auth
from gateway import create_app
from gateway.models import orgs, usage_daily
from gateway_proc import balance_nanos, make_org, migrate, wait_until

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "Say hello"}]}
BAD_DATES = ["2026-02-30", "2026-1-01", "20261201", "yesterday", "", "2026-12-01T00:00:00",
             "\uff12\uff10\uff12\uff16-01-01", "2026-13-01", "0000-01-01", "x" * 500]


def chat(gateway, key, model):
    return requests.post(gateway.base_url + "/v1/chat/completions", timeout=30,
                         json={**BODY, "model": model}, headers={"Authorization": f"Bearer {key}"})


def activity(gateway, org, **params):
    return requests.get(gateway.base_url + "/v1/activity", params=params, headers=org.headers,
                        timeout=30)


def reply_with_cache(cached):
    """The backend's answer, reporting ``cached`` of its 10 prompt tokens served from cache."""
    usage = {**make_usage(10, 5), "prompt_tokens_details": {"cached_tokens": cached}}
    return json_reply(chat_completion("Hello", usage=usage))


@pytest.mark.postgres
def test_activity_sums_equal_the_usage_events_and_the_balance_change(gateway, fake, engine):
    """Two keys, two models, cached prompt tokens, one backend failure and one request its
    client cancels: one row per model × key, whose requests, errors (the failure, not the
    cancellation: docs/ACTIVITY.md), tokens and cost sum to the org's usage events; the costs
    sum to what left the balance; another org sees none of it."""
    org = make_org(engine, f"act-{uuid.uuid4().hex[:8]}", usd="10")
    with engine.begin() as conn:
        second = auth.create_key(conn, org.id, name="ci-bot")
    start = balance_nanos(engine, org.id)[0]
    for key, model, cached in ((org.key, "fake-model", 4), (org.key, "fake-model", 0),
                               (org.key, "fake-vision", 3), (second, "fake-model", 6)):
        fake.enqueue(reply_with_cache(cached))
        assert chat(gateway, key, model).status_code == 200
    fake.enqueue(error_reply(500, "backend down"))
    assert chat(gateway, second, "fake-model").status_code == 502
    fake.enqueue([Status(200, {"Content-Type": "text/event-stream"}), Hang()])
    with requests.post(gateway.base_url + "/v1/chat/completions", stream=True, timeout=30,
                       json={**BODY, "stream": True},
                       headers={"Authorization": f"Bearer {second}"}) as cancelled:
        assert cancelled.status_code == 200
        wait_until(lambda: fake.active == 1)
    balance = balance_nanos(engine, org.id)[0]
    with engine.connect() as conn:
        statuses = sorted(conn.execute(sa.text("SELECT status FROM usage_events WHERE "
                                               "org_id = :o"), {"o": org.id}).scalars())
    assert statuses == ["client_cancelled"] + ["completed"] * 4 + ["upstream_error"]
    body = activity(gateway, org).json()
    today = datetime.now(timezone.utc).date()
    assert (body["object"], body["end_date"]) == ("activity", today.isoformat())
    assert body["start_date"] == (today - timedelta(days=29)).isoformat()
    rows = body["data"]
    assert [(r["date"], r["model"], r["key_prefix"], r["requests"], r["errors"],
             r["cached_tokens"]) for r in rows] \
        == sorted([(today.isoformat(), "fake-model", org.key[:12], 2, 0, 4),
                   (today.isoformat(), "fake-model", second[:12], 3, 1, 6),
                   (today.isoformat(), "fake-vision", org.key[:12], 1, 0, 3)])
    with engine.connect() as conn:
        events = conn.execute(sa.text(
            "SELECT count(*), sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens), "
            "sum(cost_nanos) FROM usage_events WHERE org_id = :o"), {"o": org.id}).one()
    cost = sum(Decimal(r["cost_usd"]) for r in rows)
    assert (sum(r["requests"] for r in rows), sum(r["prompt_tokens"] for r in rows),
            sum(r["cached_tokens"] for r in rows), sum(r["completion_tokens"] for r in rows),
            cost * 10**9) == tuple(events)
    assert events[2] == 13
    assert cost * 10**9 == start - balance and cost > 0
    assert {r["key_label"] for r in rows} == {"test", "ci-bot"}
    assert activity(gateway, org, date=today.isoformat()).json()["data"] == rows
    other = make_org(engine, f"other-{uuid.uuid4().hex[:8]}")
    assert activity(gateway, other).json()["data"] == []


@pytest.mark.postgres
@pytest.mark.parametrize("text", BAD_DATES)
def test_a_bad_date_is_a_400_naming_the_parameter(gateway, engine, text, org):
    answer = activity(gateway, org, date=text)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert (error["param"], error["code"], error["type"]) == \
        ("date", "invalid_value", "invalid_request_error")


@pytest.mark.postgres
def test_activity_needs_a_key(gateway):
    answer = requests.get(gateway.base_url + "/v1/activity", timeout=30)
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "invalid_api_key"


@pytest.fixture
def sqlite_app(tmp_path):
    """The app on a migrated SQLite file, with an org and its key: ``(client, engine, org_id,
    key_id, key)``."""
    url = f"sqlite:///{tmp_path}/kiln.db"
    migrate(url)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        org_id = conn.execute(orgs.insert().values(name="acme").returning(orgs.c.id)).scalar_one()
        key = auth.create_key(conn, org_id, name="web")
        key_id = conn.execute(sa.text("SELECT id FROM api_keys")).scalar_one()
    app = create_app({"database_url": url})
    yield app.test_client(), engine, org_id, key_id, key
    engine.dispose()


def test_the_last_30_utc_days_or_one_date(sqlite_app):
    client, engine, org_id, key_id, key = sqlite_app
    today = datetime.now(timezone.utc).date()
    with engine.begin() as conn:
        for age, cost in ((0, 1), (29, 20), (30, 300)):
            conn.execute(usage_daily.insert().values(
                org_id=org_id, day=today - timedelta(days=age), model="m", api_key_id=key_id,
                requests=1, errors=0, prompt_tokens=2, cached_tokens=1, completion_tokens=3,
                cost_nanos=cost))
    headers = {"Authorization": f"Bearer {key}"}
    rows = client.get("/v1/activity", headers=headers).get_json()["data"]
    assert [(r["date"], Decimal(r["cost_usd"])) for r in rows] == [
        ((today - timedelta(days=29)).isoformat(), Decimal("0.00000002")),
        (today.isoformat(), Decimal("0.000000001"))]
    old = (today - timedelta(days=30)).isoformat()
    one = client.get(f"/v1/activity?date={old}", headers=headers).get_json()
    assert (one["start_date"], one["end_date"]) == (old, old)
    assert [(r["cost_usd"], r["prompt_tokens"], r["cached_tokens"], r["completion_tokens"],
             r["key_label"]) for r in one["data"]] == [("0.0000003", 2, 1, 3, "web")]


def test_the_page_and_its_files_are_served_without_a_key(sqlite_app):
    client = sqlite_app[0]
    with client.get("/activity") as page:
        assert page.status_code == 200 and page.mimetype == "text/html"
        assert page.headers["Content-Security-Policy"].startswith("default-src 'self'")
        assert (page.headers["X-Content-Type-Options"], page.headers["Cache-Control"]) == \
            ("nosniff", "no-store")
        html = page.get_data(as_text=True)
    assert "http://" not in html and "https://" not in html
    for name in ("activity.js", "activity.css"):
        with client.get(f"/activity/static/{name}") as served:
            assert served.status_code == 200
            text = served.get_data(as_text=True)
            headers = served.headers
        # the page's policy on every path it is served from
        assert headers["Content-Security-Policy"] == page.headers["Content-Security-Policy"]
        assert (headers["X-Content-Type-Options"], headers["Cache-Control"]) == \
            ("nosniff", "no-store"), name
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")
