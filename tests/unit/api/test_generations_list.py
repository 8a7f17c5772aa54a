"""``GET /v1/generations`` and the CSV exports in process, on the SQLite file of ``make run``
(Flask's test client): the order and its cursor pages, each filter and its boundaries, every
bad parameter refused in the error envelope, what a key without ``org_read`` and another org
see, and the CSV of generations and of activity in several batches.

The same endpoint on Postgres through the real gateway, with the ledger's money, is in
``tests/functional/api/test_generations.py``.
"""
import csv
import io
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest
import sqlalchemy as sa

import factories
from gateway.api import auth, export, generations
from gateway.models import api_keys, usage_daily, usage_events

T0 = datetime(2026, 11, 20, 12, 0, tzinfo=timezone.utc)


def key_id(engine, key):
    with engine.connect() as conn:
        return conn.execute(sa.select(api_keys.c.id).where(
            api_keys.c.prefix == key[:12])).scalar_one()


def insert(engine, *events):
    with engine.begin() as conn:
        conn.execute(usage_events.insert(), list(events))
    return [e["id"] for e in events]


def get(client, secret, **params):
    return client.get("/v1/generations", query_string=params,
                      headers={"Authorization": f"Bearer {secret}"})


def pages(client, secret, limit, **params):
    """Every page of a listing: ``[(ids, has_more, next_cursor), ...]``."""
    out, cursor = [], None
    while True:
        body = get(client, secret, limit=limit, **params,
                   **({"cursor": cursor} if cursor else {})).get_json()
        out.append(([item["id"] for item in body["data"]], body["has_more"],
                    body["next_cursor"]))
        cursor = body["next_cursor"]
        if cursor is None:
            return out


def newest_first(engine, org_id):
    """The org's generation ids ordered as the listing must: ``(started_at, id)`` descending,
    by the database."""
    e = usage_events.c
    with engine.connect() as conn:
        return list(conn.execute(sa.select(e.id).where(e.org_id == org_id)
                                 .order_by(e.started_at.desc(), e.id.desc())).scalars())


@pytest.fixture
def seeded(engine):
    """A fresh org with two keys and 23 events, three per second (ties of ``started_at``):
    ``(org, second_key, ids)``."""
    org = factories.org(engine)
    with engine.begin() as conn:
        second = auth.create_key(conn, org.id, name="ci-bot")
    first_id, second_id = key_id(engine, org.key), key_id(engine, second)
    ids = insert(engine, *(factories.event_values(
        org.id, second_id if i % 4 == 3 else first_id, T0 + timedelta(seconds=i // 3))
        for i in range(23)))
    return org, second, ids


def test_pages_are_newest_first_by_start_and_id_with_no_gap_or_repeat(client, engine, seeded):
    org, _second, ids = seeded
    got = pages(client, org.key, 5)
    assert [len(p[0]) for p in got] == [5, 5, 5, 5, 3]
    assert [p[1] for p in got] == [True] * 4 + [False]
    listed = [gid for p in got for gid in p[0]]
    assert listed == newest_first(engine, org.id) and sorted(listed) == sorted(ids)
    assert get(client, org.key).get_json()["data"][0]["id"] == listed[0]  # default page: 50
    assert [i["id"] for i in get(client, org.key, limit=500).get_json()["data"]] == listed


def test_an_item_says_what_the_usage_event_holds(client, engine):
    org = factories.org(engine)
    gid, = insert(engine, factories.event_values(
        org.id, key_id(engine, org.key), T0, endpoint="messages", stream=True,
        status="upstream_error", error_code="upstream_error", http_status=502,
        cost_nanos=1_234_567_891, estimated=True, ended_at=T0 + timedelta(seconds=2),
        first_token_at=T0 + timedelta(milliseconds=250)))
    pending, = insert(engine, factories.event_values(
        org.id, key_id(engine, org.key), T0 + timedelta(seconds=5), status="pending",
        cost_nanos=0, ended_at=None, http_status=None))
    items = get(client, org.key).get_json()["data"]
    assert [i["id"] for i in items] == [pending, gid]
    assert items[1] == {
        "id": gid, "object": "generation", "created_at": "2026-11-20T12:00:00+00:00",
        "first_token_at": "2026-11-20T12:00:00.250000+00:00",
        "ended_at": "2026-11-20T12:00:02+00:00", "model": "fake-model",
        "endpoint": "messages", "stream": True, "status": "upstream_error",
        "http_status": 502, "error_code": "upstream_error", "prompt_tokens": 10,
        "cached_tokens": 2, "completion_tokens": 5, "total_tokens": 15,
        "cost_usd": "1.234567891", "estimated": True, "key_prefix": org.key[:12],
        "key_label": "test"}
    assert (items[0]["status"], items[0]["cost_usd"], items[0]["ended_at"]) == \
        ("pending", None, None)


def test_each_filter_and_the_time_bounds(client, engine):
    org = factories.org(engine)
    with engine.begin() as conn:
        other_key = auth.create_key(conn, org.id, name="other")
    mine, other = key_id(engine, org.key), key_id(engine, other_key)
    at = [T0 + timedelta(hours=h) for h in range(4)]
    ids = insert(engine,
                 factories.event_values(org.id, mine, at[0]),
                 factories.event_values(org.id, mine, at[1], model="fake-vision"),
                 factories.event_values(org.id, other, at[2], status="timeout"),
                 factories.event_values(org.id, mine, at[3], endpoint="embeddings"))

    def listed(**params):
        answer = get(client, org.key, **params)
        assert answer.status_code == 200, answer.get_json()
        return [i["id"] for i in answer.get_json()["data"]]
    assert listed() == ids[::-1]
    assert listed(model="fake-vision") == [ids[1]]
    assert listed(status="timeout") == [ids[2]]
    assert listed(endpoint="embeddings") == [ids[3]]
    assert listed(key=other_key[:12]) == [ids[2]]
    assert listed(key=org.key[:12], model="fake-model") == [ids[3], ids[0]]
    # ``from`` is inclusive and ``to`` exclusive, in any offset: 22:00+09:00 is 13:00Z
    assert listed(**{"from": "2026-11-20T22:00:00+09:00"}) == [ids[3], ids[2], ids[1]]
    assert listed(to="2026-11-20T14:00:00Z") == [ids[1], ids[0]]
    assert listed(**{"from": "2026-11-20T13:00:00Z", "to": "2026-11-20T09:00:00-05:00"}) == \
        [ids[1]]
    assert listed(model="no-such-model") == []


BAD = [
    ({"from": "2026-11-20"}, "from", "invalid_value"),            # no time, no offset
    ({"from": "2026-11-20T12:00:00"}, "from", "invalid_value"),   # no offset
    ({"to": "yesterday"}, "to", "invalid_value"),
    ({"to": "2026-02-30T00:00:00Z"}, "to", "invalid_value"),
    ({"to": "\uff12\uff10\uff12\uff16-01-01T00:00:00Z"}, "to", "invalid_value"),
    ({"from": "0001-01-01T00:00:00+01:00"}, "from", "invalid_value"),  # before year 1 in UTC
    ({"from": "x" * 500}, "from", "invalid_value"),
    ({"from": "2026-11-20T12:00:00Z", "to": "2026-11-20T12:00:00Z"}, "to", "invalid_value"),
    ({"limit": "0"}, "limit", "invalid_value"),
    ({"limit": "501"}, "limit", "invalid_value"),
    ({"limit": "-1"}, "limit", "invalid_value"),
    ({"limit": "5.0"}, "limit", "invalid_value"),
    ({"limit": "\u0665"}, "limit", "invalid_value"),   # an Arabic-Indic five
    ({"status": "done"}, "status", "invalid_value"),
    ({"endpoint": "images"}, "endpoint", "invalid_value"),
    ({"model": ""}, "model", "invalid_value"),
    ({"model": "a\x00b"}, "model", "invalid_value"),
    ({"model": "m" * 201}, "model", "invalid_value"),
    ({"key": "kiln-nosuchk"}, "key", "invalid_value"),
    ({"cursor": "abc"}, "cursor", "invalid_value"),
    ({"cursor": "WyJ4IiwieSJd"}, "cursor", "invalid_value"),  # ["x","y"]: no time in it
    ({"cursor": "W1td"}, "cursor", "invalid_value"),          # []
    ({"cursor": "WyIyMDI2LTExLTIwVDEyOjAwOjAwIiwiZyJd"}, "cursor", "invalid_value"),  # naive
    ({"format": "xml"}, "format", "invalid_value"),
    ({"format": "csv", "limit": "10"}, "limit", "invalid_value"),
    ({"since": "2026-11-20T12:00:00Z"}, "since", "unknown_parameter"),
    ({"status": ["completed", "timeout"]}, "status", "invalid_value"),  # given twice
]


@pytest.mark.parametrize("params,param,code", BAD, ids=[str(b[0])[:60] for b in BAD])
def test_a_bad_parameter_is_a_400_naming_it(client, org, params, param, code):
    answer = get(client, org.key, **params)
    assert answer.status_code == 400 and answer.mimetype == "application/json"
    error = answer.get_json()["error"]
    assert (error["param"], error["code"], error["type"]) == \
        (param, code, "invalid_request_error")
    assert error["message"]


def test_a_key_without_org_read_sees_its_own_generations(client, engine):
    org = factories.org(engine)
    with engine.begin() as conn:
        bot = auth.create_key(conn, org.id, name="bot", allowed_models=["fake-model"])
    bot_id = key_id(engine, bot)
    mine = insert(engine, factories.event_values(org.id, key_id(engine, org.key), T0))
    its = insert(engine, factories.event_values(org.id, bot_id, T0 + timedelta(seconds=1)))
    body = get(client, bot).get_json()
    assert (body["scope"], [i["id"] for i in body["data"]]) == ("key", its)
    assert [i["id"] for i in get(client, bot, key=bot[:12]).get_json()["data"]] == its
    refused = get(client, bot, key=org.key[:12])
    assert (refused.status_code, refused.get_json()["error"]["param"]) == (400, "key")
    rows = list(csv.reader(io.StringIO(get(client, bot, format="csv").get_data(as_text=True))))
    assert [r[0] for r in rows[1:]] == its
    body = get(client, org.key).get_json()
    assert (body["scope"], [i["id"] for i in body["data"]]) == ("org", its + mine)


def test_another_org_sees_none_of_it(client, engine, seeded):
    org, second, ids = seeded
    other = factories.org(engine)
    theirs = insert(engine, factories.event_values(other.id, key_id(engine, other.key), T0))
    assert [i["id"] for i in get(client, other.key).get_json()["data"]] == theirs
    cursor = get(client, org.key, limit=2).get_json()["next_cursor"]
    # a cursor is a position, not a permission: the other org's key still sees its own
    assert [i["id"] for i in get(client, other.key, cursor=cursor).get_json()["data"]] == theirs
    for prefix in (org.key[:12], second[:12]):
        assert get(client, other.key, key=prefix).status_code == 400
    rows = list(csv.reader(io.StringIO(
        get(client, other.key, format="csv").get_data(as_text=True))))
    assert [r[0] for r in rows[1:]] == theirs and not set(ids) & {r[0] for r in rows}


def read_csv(answer):
    assert answer.status_code == 200, answer.get_data(as_text=True)
    assert answer.mimetype == "text/csv"
    assert answer.headers["Content-Disposition"].startswith("attachment; filename=")
    return list(csv.DictReader(io.StringIO(answer.get_data(as_text=True))))


def test_the_csv_holds_every_item_as_json_shows_it_in_several_batches(client, engine, seeded,
                                                                       monkeypatch):
    org, _second, _ids = seeded
    monkeypatch.setattr(export, "BATCH_ROWS", 4)  # 23 rows: six batches
    with engine.begin() as conn:
        conn.execute(api_keys.update().where(api_keys.c.prefix == org.key[:12])
                     .values(name="=HYPERLINK(\"x\")"))
    items = get(client, org.key, limit=500).get_json()["data"]
    by_format = read_csv(get(client, org.key, format="csv"))
    by_accept = read_csv(client.get("/v1/generations", headers={
        **org.headers, "Accept": "text/csv"}))
    assert by_format == by_accept and len(by_format) == 23
    for row, item in zip(by_format, items, strict=True):
        expected = {k: ("" if v is None else str(v).lower() if isinstance(v, bool) else str(v))
                    for k, v in item.items() if k != "object"}
        if item["key_label"].startswith("="):  # a spreadsheet formula is written as text
            expected["key_label"] = "'" + item["key_label"]
        assert row == expected
    assert sum(Decimal(r["cost_usd"]) for r in by_format) == \
        sum(Decimal(i["cost_usd"]) for i in items)
    later = read_csv(get(client, org.key, format="csv",
                         cursor=get(client, org.key, limit=20).get_json()["next_cursor"]))
    assert [r["id"] for r in later] == [i["id"] for i in items[20:]]
    json_wins = client.get("/v1/generations", headers={**org.headers, "Accept": "*/*"})
    assert json_wins.mimetype == "application/json"
    assert get(client, org.key, format="json").mimetype == "application/json"


def test_an_export_ends_where_it_began(client, engine, seeded, monkeypatch):
    """Events that start after an export began, before or while its batches are read, are not
    in it: it holds what the filters matched when it started (and its bound was counted)."""
    monkeypatch.setattr(export, "BATCH_ROWS", 5)
    org, _second, ids = seeded
    answer = client.get("/v1/generations?format=csv", headers=org.headers, buffered=False)
    chunks = iter(answer.response)
    header = next(chunks)  # the view has run; no batch is read yet
    later = insert(engine, factories.event_values(org.id, key_id(engine, org.key),
                                                  datetime.now(timezone.utc)))
    text = (header + b"".join(chunks)).decode()
    answer.close()
    exported = [r["id"] for r in csv.DictReader(io.StringIO(text))]
    assert exported == newest_first(engine, org.id)[1:] and later[0] not in exported
    assert sorted(exported) == sorted(ids)


def test_an_export_over_the_row_bound_is_refused_until_narrowed(tmp_path):
    app, engine = factories.sqlite_app(
        tmp_path, factories.CATALOG.format(url=factories.UNREACHABLE_BACKEND),
        probe_interval_s=0, export_max_rows=3)
    org = factories.org(engine)
    insert(engine, *(factories.event_values(org.id, key_id(engine, org.key),
                                            T0 + timedelta(minutes=i)) for i in range(5)))
    client = app.test_client()
    refused = get(client, org.key, format="csv")
    error = refused.get_json()["error"]
    assert (refused.status_code, error["code"], error["param"]) == \
        (400, "export_too_large", "from")
    assert len(read_csv(get(client, org.key, format="csv",
                            **{"from": "2026-11-20T12:02:00Z"}))) == 3
    assert get(client, org.key, limit=5).get_json()["has_more"] is False  # pages are not bound
    engine.dispose()


def test_activity_as_csv_in_several_batches(client, engine, monkeypatch):
    monkeypatch.setattr(export, "BATCH_ROWS", 3)
    org = factories.org(engine)
    with engine.begin() as conn:
        second = auth.create_key(conn, org.id, name="+cmd")
    keys = [key_id(engine, org.key), key_id(engine, second)]
    today = datetime.now(timezone.utc).date()
    rows = [dict(org_id=org.id, day=today - timedelta(days=age), model=model,
                 api_key_id=key, endpoint=endpoint, requests=2, errors=1, prompt_tokens=7,
                 cached_tokens=3, completion_tokens=5, cost_nanos=1_000_000_001 * (age + 1))
            for age in (0, 3, 30) for model in ("fake-model", "fake-vision") for key in keys
            for endpoint in ("chat", "messages")]
    with engine.begin() as conn:
        conn.execute(usage_daily.insert(), rows)
    headers = {"Authorization": f"Bearer {org.key}"}
    as_json = client.get("/v1/activity", headers=headers).get_json()["data"]
    exported = read_csv(client.get("/v1/activity?format=csv", headers=headers))
    assert len(exported) == len(as_json) == 16  # the 30-day window leaves day 30 out
    expected = [{**{k: str(v) for k, v in r.items()},
                 "key_label": "'+cmd" if r["key_label"] == "+cmd" else r["key_label"]}
                for r in as_json]  # a label a spreadsheet would run is written as text
    assert sorted(exported, key=lambda r: sorted(r.items())) == \
        sorted(expected, key=lambda r: sorted(r.items()))
    assert [(r["date"], r["model"]) for r in exported] == \
        sorted((r["date"], r["model"]) for r in exported)
    # 8 rows of today at 1.000000001 and 8 of three days ago at 4.000000004
    assert sum(Decimal(r["cost_usd"]) for r in exported) == Decimal("40.000000040")
    old = (today - timedelta(days=30)).isoformat()
    one_day = read_csv(client.get(f"/v1/activity?date={old}&format=csv", headers=headers))
    assert {r["date"] for r in one_day} == {old} and len(one_day) == 8
    assert client.get("/v1/activity?format=pdf", headers=headers).status_code == 400


def test_the_listing_needs_a_key(client):
    answer = client.get("/v1/generations")
    assert (answer.status_code, answer.get_json()["error"]["code"]) == (401, "invalid_api_key")
    assert client.get("/v1/generations?format=csv").status_code == 401


def test_the_document_lists_the_parameters_and_values_the_endpoint_takes():
    from gateway.api.openapi import build_document
    operation = build_document(1024, export_max_rows=77)["paths"]["/v1/generations"]["get"]
    schemas = {p["name"]: p["schema"] for p in operation["parameters"]}
    assert tuple(schemas) == generations.PARAMS
    assert tuple(schemas["status"]["enum"]) == generations.STATUSES
    assert set(schemas["endpoint"]["enum"]) == {"chat", "messages", "responses", "completions",
                                                "embeddings"}
    assert schemas["limit"]["maximum"] == generations.PAGE_MAX
    assert "at most 77 rows" in operation["responses"]["200"]["description"]
    assert set(operation["responses"]["200"]["content"]) == {"application/json", "text/csv"}
