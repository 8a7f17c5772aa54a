"""``GET /v1/generations`` and the CSV exports through the real gateway on Postgres: the listing
against the usage events that real requests left, CSV sums equal to the ledger's (the balance's
change, the events, the activity rollup), pages that neither repeat nor skip while new
requests arrive, one org blind to another's, an export of 100,000 rows streamed by a worker
whose memory does not grow with it, and one the database fails under ending broken.
"""
import csv
import http.client
import socket
import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pytest
import requests
import sqlalchemy as sa

from fake_upstream import Hang, Status, chat_completion, error_reply, json_reply, make_usage
from factories import event_values
from gateway.api import auth, export
from gateway.models import usage_events
from gateway_proc import (PG_ADMIN_URL, Gateway, balance_nanos, create_database, drop_database,
                          gateway_env, make_org, migrate, wait_until)

pytestmark = pytest.mark.postgres

BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "Say hello"}]}


def chat(gateway, key, model="fake-model"):
    return requests.post(gateway.base_url + "/v1/chat/completions", timeout=30,
                         json={**BODY, "model": model}, headers={"Authorization": f"Bearer {key}"})


def listing(gateway, secret, path="/v1/generations", **params):
    return requests.get(gateway.base_url + path, params=params, timeout=60,
                        headers={"Authorization": f"Bearer {secret}"})


def csv_rows(answer):
    assert answer.status_code == 200, answer.text
    assert answer.headers["Content-Type"] == "text/csv; charset=utf-8"
    return list(csv.DictReader(answer.text.splitlines()))


def usd(nanos):
    return Decimal(nanos).scaleb(-9)


def event_sums(engine, org_id):
    """``(count, prompt, cached, completion, cost nanos)`` of the org's usage events."""
    with engine.connect() as conn:
        return tuple(conn.execute(sa.text(
            "SELECT count(*), sum(prompt_tokens), sum(cached_tokens), sum(completion_tokens), "
            "sum(cost_nanos) FROM usage_events WHERE org_id = :o"), {"o": org_id}).one())


def sums(rows, count):
    """The same sums from CSV rows; ``count`` is the column of requests, or None (one each)."""
    return (sum(int(r[count]) for r in rows) if count else len(rows),
            sum(int(r["prompt_tokens"]) for r in rows), sum(int(r["cached_tokens"]) for r in rows),
            sum(int(r["completion_tokens"]) for r in rows),
            sum(Decimal(r["cost_usd"]) for r in rows) * 10**9)


def test_the_listing_and_its_csv_sum_to_the_ledger(gateway, fake, engine):
    """Two keys, two models, cached tokens, a backend failure and a cancelled stream: the
    listing has each usage event as it was settled; the CSV parses with the csv module and its
    tokens and cost sum to the events, to the balance's change and to the activity CSV."""
    org = make_org(engine, f"gens-{uuid.uuid4().hex[:8]}", usd="10")
    with engine.begin() as conn:
        second = auth.create_key(conn, org.id, name="ci-bot")
    start = balance_nanos(engine, org.id)[0]
    for key, model, cached in ((org.key, "fake-model", 4), (org.key, "fake-vision", 0),
                               (second, "fake-model", 6)):
        usage = {**make_usage(10, 5), "prompt_tokens_details": {"cached_tokens": cached}}
        fake.enqueue(json_reply(chat_completion("Hello", usage=usage)))
        assert chat(gateway, key, model).status_code == 200
    fake.enqueue(error_reply(500, "backend down"))
    failed = chat(gateway, second)
    assert failed.status_code == 502
    fake.enqueue([Status(200, {"Content-Type": "text/event-stream"}), Hang()])
    with requests.post(gateway.base_url + "/v1/chat/completions", stream=True, timeout=30,
                       json={**BODY, "stream": True},
                       headers={"Authorization": f"Bearer {second}"}) as cancelled:
        assert cancelled.status_code == 200
        wait_until(lambda: fake.active == 1)
    spent = start - balance_nanos(engine, org.id)[0]  # waits for every settlement

    body = listing(gateway, org.key).json()
    with engine.connect() as conn:
        events = {r.id: r for r in conn.execute(sa.select(usage_events).where(
            usage_events.c.org_id == org.id))}
    assert (body["object"], body["scope"], body["has_more"], body["next_cursor"]) == \
        ("list", "org", False, None)
    assert sorted(i["id"] for i in body["data"]) == sorted(events)
    for item in body["data"]:
        event = events[item["id"]]
        assert (item["status"], item["model"], item["stream"], item["prompt_tokens"],
                item["cached_tokens"], item["completion_tokens"], item["estimated"],
                Decimal(item["cost_usd"]), item["error_code"], item["http_status"]) == \
            (event.status, event.model, event.stream, event.prompt_tokens,
             event.cached_tokens, event.completion_tokens, event.estimated,
             usd(event.cost_nanos), event.error_code, event.http_status)
        assert datetime.fromisoformat(item["created_at"]) == event.started_at
        assert item["created_at"].endswith("+00:00")
    assert failed.headers["X-Neocloud-Generation-Id"] in \
        {i["id"] for i in listing(gateway, org.key, status="upstream_error").json()["data"]}
    assert {i["key_label"] for i in listing(gateway, org.key, key=second[:12]).json()["data"]} \
        == {"ci-bot"}

    exported = csv_rows(listing(gateway, org.key, format="csv"))
    assert [r["id"] for r in exported] == [i["id"] for i in body["data"]]
    assert sorted(r["status"] for r in exported) == \
        ["client_cancelled"] + ["completed"] * 3 + ["upstream_error"]
    assert sums(exported, None) == event_sums(engine, org.id)
    assert sums(exported, None)[4] == spent and spent > 0
    daily = csv_rows(listing(gateway, org.key, path="/v1/activity", format="csv"))
    assert sums(daily, "requests") == event_sums(engine, org.id)


def test_pages_neither_repeat_nor_skip_while_requests_arrive(gateway, fake, engine):
    """40 events, some sharing a start time, read 7 at a time; before each next page, a real
    request and a new event arrive. Every event that existed when the first page was read is
    listed once, in order; what arrived later is not among them (it starts later: it is at the
    top of a new listing). The events written here directly (not through the ledger) are
    deleted at the end, so that the shared database's books balance for the tests that
    reconcile it."""
    org = make_org(engine, f"pages-{uuid.uuid4().hex[:8]}", usd="10")
    with engine.connect() as conn:
        key_id = conn.execute(sa.text("SELECT id FROM api_keys WHERE org_id = :o"),
                              {"o": org.id}).scalar_one()
    base = datetime.now(timezone.utc) - timedelta(hours=1)
    with engine.begin() as conn:
        written = list(conn.execute(usage_events.insert().returning(usage_events.c.id), [
            event_values(org.id, key_id, base + timedelta(seconds=i // 4))
            for i in range(40)]).scalars())
    try:
        _page_while_requests_arrive(gateway, fake, engine, org, key_id, written)
    finally:
        with engine.begin() as conn:
            conn.execute(usage_events.delete().where(usage_events.c.id.in_(written)))


def _page_while_requests_arrive(gateway, fake, engine, org, key_id, written):
    listed, arrived, cursor = [], [], None
    while True:
        page = listing(gateway, org.key, limit=7, **({"cursor": cursor} if cursor else {}))
        assert page.status_code == 200, page.text
        listed += [i["id"] for i in page.json()["data"]]
        cursor = page.json()["next_cursor"]
        if cursor is None:
            break
        fake.enqueue(json_reply(chat_completion("Hello", usage=make_usage(10, 5))))
        answer = chat(gateway, org.key)
        assert answer.status_code == 200
        arrived.append(answer.headers["X-Neocloud-Generation-Id"])
        with engine.begin() as conn:
            arrived.append(conn.execute(usage_events.insert().values(event_values(
                org.id, key_id, datetime.now(timezone.utc))).returning(usage_events.c.id))
                .scalar_one())
        written.append(arrived[-1])
    e = usage_events.c
    with engine.connect() as conn:
        everything = list(conn.execute(sa.select(e.id).where(e.org_id == org.id)
                                       .order_by(e.started_at.desc(), e.id.desc())).scalars())
    assert len(listed) == len(set(listed)) == 40
    assert listed == [gid for gid in everything if gid not in arrived]
    assert len(arrived) == 10 and not set(arrived) & set(listed)
    fresh = [i["id"] for i in listing(gateway, org.key, limit=10).json()["data"]]
    assert sorted(fresh) == sorted(arrived)  # the newest ten: everything that arrived


def test_an_org_sees_none_of_another_orgs_generations(gateway, fake, engine):
    first = make_org(engine, f"one-{uuid.uuid4().hex[:8]}")
    other = make_org(engine, f"two-{uuid.uuid4().hex[:8]}")
    fake.enqueue(json_reply(chat_completion("Hello", usage=make_usage(10, 5))))
    gid = chat(gateway, first.key).headers["X-Neocloud-Generation-Id"]
    balance_nanos(engine, first.id)  # settled
    assert [i["id"] for i in listing(gateway, first.key).json()["data"]] == [gid]
    assert listing(gateway, other.key).json()["data"] == []
    assert csv_rows(listing(gateway, other.key, format="csv")) == []
    refused = listing(gateway, other.key, key=first.key[:12])
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "key")
    assert csv_rows(listing(gateway, other.key, path="/v1/activity", format="csv")) == []


# -- a large export in bounded memory ------------------------------------------------------------

ROWS = 100_000
# What one row may take in the worker while its batch is in hand: the database row, its item
# dict, its CSV cells and text. Measured here: an export read in one batch of all 100,000
# rows grew the worker's peak RSS by 211 MiB, 2.2 KiB a row; twice that is allowed.
ROW_BYTES = 4 * 1024
# Besides two batches alive at once (the one being written, the next one read): the
# allocator's slack and the response's buffers.
FIXED_BYTES = 4 * 1024 * 1024


def status_kib(pid, field):
    """A ``VmRSS``/``VmHWM`` line of ``/proc/<pid>/status``, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.fixture(scope="module")
def big_export(catalog_path):
    """A scratch database with an org of :data:`ROWS` settled usage events (one a second,
    costs of 1 to 1000 nano-dollars), and a one-worker gateway on it: ``(gateway, org,
    engine)``."""
    name = f"kiln_export_{uuid.uuid4().hex[:10]}"
    url = create_database(name)
    migrate(url)
    engine = sa.create_engine(url)
    org = make_org(engine, "bulk")
    with engine.begin() as conn:
        conn.execute(sa.text("""
            INSERT INTO usage_events (id, org_id, api_key_id, model, stream, endpoint, status,
                prompt_tokens, cached_tokens, completion_tokens, cost_nanos, http_status,
                started_at, ended_at)
            SELECT 'gen-bulk-' || i, k.org_id, k.id, 'fake-model', i % 2 = 0, 'chat',
                   'completed', i % 50, i % 7, i % 30, 1 + i % 1000, 200,
                   timestamptz '2026-11-01 00:00:00+00' + i * interval '1 second',
                   timestamptz '2026-11-01 00:00:00+00' + i * interval '1 second'
              FROM generate_series(1, :rows) AS i, api_keys k WHERE k.org_id = :o"""),
                     {"rows": ROWS, "o": org.id})
    gw = Gateway(gateway_env(url, catalog_path), workers=1).start()
    yield gw, org, engine
    gw.stop()
    engine.dispose()
    drop_database(name)


def test_an_export_the_database_fails_under_ends_broken_not_short(big_export):
    """The gateway's database connections are cut while an export is under way (the client
    reads slowly, with a small receive buffer, so the worker is still writing): the download
    fails as a broken chunked body, never ending like a complete CSV."""
    gw, org, engine = big_export
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=120)
    conn.sock = socket.socket()
    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # no receive autotuning
    conn.sock.settimeout(120)
    conn.sock.connect(("127.0.0.1", gw.port))
    conn.request("GET", "/v1/generations?format=csv", headers=org.headers)
    answer = conn.getresponse()
    assert answer.status == 200
    got = answer.read(64 * 1024)  # the export began; most of its 14.5 MiB is still to come
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as pg:
        cut = pg.execute(sa.text(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = :db AND application_name = 'kiln-gateway'"),
            {"db": engine.url.database}).scalar_one()
    admin.dispose()
    assert cut >= 1
    with pytest.raises((http.client.IncompleteRead, http.client.HTTPException, OSError)):
        while chunk := answer.read(64 * 1024):
            got += chunk
    conn.close()
    assert got.count(b"\r\n") - 1 < ROWS  # short, and the client was told so


def test_a_csv_of_100k_rows_streams_in_bounded_memory(big_export):
    """The worker's peak RSS, reset just before the export (``/proc/<pid>/clear_refs``), grows
    by less than two batches' worth of rows plus a fixed slack (about 12 MiB) while it writes
    100,000 rows (14.5 MiB of CSV; about 211 MiB as the worker's objects, were they held at
    once): it holds a batch, never the export. The CSV is read as it arrives, and its count
    and sum are the events'."""
    gw, org, engine = big_export
    worker, = gw.worker_pids()
    warm = listing(gw, org.key, format="csv", **{"from": "2026-11-02T03:00:00Z"})
    assert len(csv_rows(warm)) > 2 * export.BATCH_ROWS  # every path of the export runs once
    Path(f"/proc/{worker}/clear_refs").write_text("5")  # peak RSS := current RSS
    before = status_kib(worker, "VmRSS")
    assert status_kib(worker, "VmHWM") <= before + 1024  # the reset took
    count, cost, size = 0, Decimal(0), 0
    with requests.get(gw.base_url + "/v1/generations", stream=True, timeout=300,
                      headers={**org.headers, "Accept": "text/csv"}) as answer:
        assert answer.status_code == 200
        header = None
        for line in answer.iter_lines(chunk_size=64 * 1024, decode_unicode=True):
            size += len(line) + 2  # and its \r\n
            if not line:
                continue  # a \r\n split between two chunks reads as an empty line
            row, = csv.reader([line])
            if header is None:
                header = row
                continue
            count += 1
            cost += Decimal(row[header.index("cost_usd")])
    growth = (status_kib(worker, "VmHWM") - before) * 1024
    bound = FIXED_BYTES + 2 * export.BATCH_ROWS * ROW_BYTES
    with engine.connect() as conn:
        total = conn.execute(sa.text("SELECT count(*), sum(cost_nanos) FROM usage_events "
                                     "WHERE org_id = :o"), {"o": org.id}).one()
    assert (count, cost * 10**9) == tuple(total) and count == ROWS
    assert size > bound  # the CSV alone, held as it left, would not fit in the bound
    assert growth < bound, f"peak RSS grew {growth} bytes for {size} bytes of CSV"
    print(f"peak RSS growth {growth / 2**20:.1f} MiB for {size / 2**20:.1f} MiB of CSV "
          f"(bound {bound / 2**20:.1f} MiB)")
