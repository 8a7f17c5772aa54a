"""Stored responses on both dialects: per org (another org's id is a 404, as is an unknown or
expired one), the chain of ``previous_response_id`` in order, input items paged as OpenAI pages
them, exact costs, deletion, and the sweep of expired rows. SQLite in process (``unit``); the
same tests on a Postgres database of their own (``postgres``)."""
import json
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest
import sqlalchemy as sa

from gateway.db import utcnow
from gateway.errors import InvalidRequest, NotFound
from gateway.ledger import responses as store
from gateway.ledger.history import HistoryCache
from gateway_proc import create_database, drop_database, migrate


@pytest.fixture(params=[pytest.param("sqlite", marks=pytest.mark.unit),
                        pytest.param("postgres", marks=pytest.mark.postgres)])
def engine(request, tmp_path):
    if request.param == "postgres":
        name = f"kiln_responses_{uuid.uuid4().hex[:10]}"
        url = create_database(name)
    else:
        url = f"sqlite:///{tmp_path / 'kiln.db'}"
    migrate(url)
    eng = sa.create_engine(url)
    yield eng
    eng.dispose()
    if request.param == "postgres":
        drop_database(name)


@pytest.fixture
def orgs(engine):
    with engine.begin() as conn:
        return [conn.execute(sa.text("INSERT INTO orgs (name) VALUES (:n) RETURNING id"),
                             {"n": f"org-{uuid.uuid4().hex[:8]}"}).scalar_one()
                for _ in range(2)]


def _item(text, item_id=None, role="user"):
    return {"type": "message", "role": role, "id": item_id or f"msg_{uuid.uuid4().hex}",
            "content": [{"type": "input_text", "text": text}]}


def _response(rid, previous=None, reply="ok", cost=Decimal("0.000000123")):
    return {"id": rid, "object": "response", "model": "m", "previous_response_id": previous,
            "status": "completed",
            "output": [{"type": "message", "role": "assistant", "id": f"msg_{rid}",
                        "status": "completed",
                        "content": [{"type": "output_text", "text": reply,
                                     "annotations": []}]}],
            "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2, "cost": cost}}


def test_save_get_delete_per_org(engine, orgs):
    mine, theirs = orgs
    store.save(engine, mine, _response("resp_1"), [_item("hi")], generation_id="gen-1")
    got = store.get(engine, mine, "resp_1")
    assert got["usage"]["cost"] == Decimal("0.000000123")  # exact, not a float
    assert isinstance(got["usage"]["cost"], Decimal)
    with engine.connect() as conn:
        raw = conn.execute(sa.text("SELECT response, generation_id FROM stored_responses")).one()
    assert '"cost":0.000000123' in raw.response and raw.generation_id == "gen-1"
    for call in (lambda: store.get(engine, theirs, "resp_1"),
                 lambda: store.get(engine, mine, "resp_nope"),
                 lambda: store.delete(engine, theirs, "resp_1"),
                 lambda: store.load_chain(engine, theirs, "resp_1"),
                 lambda: store.input_items(engine, theirs, "resp_1")):
        with pytest.raises(NotFound) as err:
            call()
        assert err.value.status == 404
    assert store.delete(engine, mine, "resp_1") == {"id": "resp_1", "object": "response",
                                                     "deleted": True}
    with pytest.raises(NotFound):
        store.get(engine, mine, "resp_1")
    with pytest.raises(NotFound):
        store.delete(engine, mine, "resp_1")


def test_load_chain_oldest_first_with_inputs_and_outputs(engine, orgs):
    org = orgs[0]
    previous = None
    for turn in range(20):
        store.save(engine, org, _response(f"resp_{turn}", previous, reply=f"a{turn}"),
                   [_item(f"q{turn}")])
        previous = f"resp_{turn}"
    history = store.load_chain(engine, org, "resp_19")
    texts = [i["content"][0]["text"] for i in history]
    assert texts == [x for turn in range(20) for x in (f"q{turn}", f"a{turn}")]
    assert [i["content"][0]["text"] for i in store.load_chain(engine, org, "resp_1")] == [
        "q0", "a0", "q1", "a1"]


def test_a_missing_link_is_a_404_not_a_shorter_history(engine, orgs):
    org, other = orgs
    store.save(engine, org, _response("resp_a"), [_item("1")])
    store.save(engine, org, _response("resp_b", "resp_a"), [_item("2")])
    store.save(engine, other, _response("resp_x"), [_item("x")])
    store.save(engine, org, _response("resp_c", "resp_x"), [_item("3")])  # names another org's
    store.delete(engine, org, "resp_a")
    for head, missing in (("resp_b", "resp_a"), ("resp_c", "resp_x")):
        with pytest.raises(NotFound) as err:
            store.load_chain(engine, org, head)
        assert err.value.param == "previous_response_id" and missing in err.value.message


def test_expired_is_gone_and_swept(engine, orgs):
    org = orgs[0]
    now = utcnow()
    store.save(engine, org, _response("resp_old"), [_item("x")], retention=timedelta(days=30),
               now=now - timedelta(days=31))
    store.save(engine, org, _response("resp_new"), [_item("y")], now=now)
    with pytest.raises(NotFound):
        store.get(engine, org, "resp_old", now=now)
    with pytest.raises(NotFound):
        store.load_chain(engine, org, "resp_old", now=now)
    assert store.sweep_expired(engine, now, batch=1) == 1
    assert store.sweep_expired(engine, now) == 0
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT id FROM stored_responses")).scalars().all() == [
            "resp_new"]
    assert store.get(engine, org, "resp_new")["id"] == "resp_new"


def test_input_items_paged_as_openai_pages_them(engine, orgs):
    org = orgs[0]
    items = [_item(str(i), f"msg_{i}") for i in range(5)]
    store.save(engine, org, _response("resp_p"), items)
    page = store.input_items(engine, org, "resp_p", limit=2)
    assert [i["id"] for i in page["data"]] == ["msg_4", "msg_3"] and page["has_more"]
    assert (page["object"], page["first_id"], page["last_id"]) == ("list", "msg_4", "msg_3")
    page = store.input_items(engine, org, "resp_p", after="msg_3", limit=10)
    assert [i["id"] for i in page["data"]] == ["msg_2", "msg_1", "msg_0"]
    assert not page["has_more"]
    page = store.input_items(engine, org, "resp_p", order="asc", after="msg_3")
    assert [i["id"] for i in page["data"]] == ["msg_4"]
    for kwargs, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                          ({"order": "up"}, "order"), ({"after": "msg_9"}, "after")):
        with pytest.raises(InvalidRequest) as err:
            store.input_items(engine, org, "resp_p", **kwargs)
        assert err.value.param == param


def test_purge_an_org_by_sql_as_the_docs_say(engine, orgs):
    org, other = orgs
    store.save(engine, org, _response("resp_1"), [_item("a")])
    store.save(engine, other, _response("resp_2"), [_item("b")])
    with engine.begin() as conn:  # docs/RESPONSES.md, "Purging an org's stored responses"
        conn.execute(sa.text("DELETE FROM stored_responses WHERE org_id = "
                             "(SELECT id FROM orgs WHERE name = :n)"),
                     {"n": conn.execute(sa.text("SELECT name FROM orgs WHERE id = :i"),
                                        {"i": org}).scalar_one()})
    with pytest.raises(NotFound):
        store.get(engine, org, "resp_1")
    assert store.get(engine, other, "resp_2")["id"] == "resp_2"


def test_a_deletion_takes_the_content_at_once_and_the_id_at_the_sweep(engine, orgs):
    mine = orgs[0]
    store.save(engine, mine, _response("resp_gone", reply="secret reply"), [_item("secret in")])
    store.delete(engine, mine, "resp_gone")
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT response, input_items FROM stored_responses "
                                   "WHERE id = 'resp_gone'")).one()
    assert (row.response, row.input_items) == ("{}", "[]")
    with pytest.raises(NotFound):
        store.get(engine, mine, "resp_gone")
    assert store.sweep_expired(engine) == 1
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM stored_responses "
                                    "WHERE id = 'resp_gone'")).scalar_one() == 0


def test_a_historys_items_are_read_as_the_standard_library_reads_them():
    from gateway.ledger.responses import _items
    for text in ('[{"type": "message", "content": "caf\\u00e9", "n": 1.5}]',
                 '[{"content": "lone \\ud800"}]',            # orjson refuses the escape
                 '[{"seed": 123456789012345678901234}]'):   # orjson would read a float
        assert _items(text) == json.loads(text)
    assert type(_items('[{"seed": 123456789012345678901234}]')[0]["seed"]) is int


def test_a_held_chain_is_read_as_ids_and_each_link_still_checked(engine, orgs):
    org, other = orgs
    cache = HistoryCache(1 << 20)
    previous = None
    for turn in range(5):
        store.save(engine, org, _response(f"resp_{turn}", previous, reply=f"a{turn}"),
                   [_item(f"q{turn}")], cache=cache)
        previous = f"resp_{turn}"
    postgres = engine.dialect.name == "postgresql"
    assert len(cache) == (5 if postgres else 0)  # rows go to the cache as they are written
    first = store.load_chain(engine, org, "resp_4", cache=cache)
    assert [i["content"][0]["text"] for i in first] == [
        x for turn in range(5) for x in (f"q{turn}", f"a{turn}")]
    with engine.begin() as conn:  # a row's content changed behind the cache's back
        conn.execute(sa.text("UPDATE stored_responses SET input_items = :v WHERE id = 'resp_2'"),
                     {"v": json.dumps([_item("changed")])})
    again = store.load_chain(engine, org, "resp_4", cache=cache)
    assert (again[4]["content"][0]["text"] == "q2") is postgres  # held: its content not read
    assert store.load_chain(engine, org, "resp_4")[4]["content"][0]["text"] == "changed"
    with pytest.raises(NotFound):  # another org's view of the held chain
        store.load_chain(engine, other, "resp_4", cache=cache)
    store.delete(engine, org, "resp_1")
    with pytest.raises(NotFound) as err:  # a link gone is read from the database, held or not
        store.load_chain(engine, org, "resp_4", cache=cache)
    assert "resp_1" in err.value.message


def test_a_chain_read_fills_the_cache_for_the_next_read(engine, orgs):
    org = orgs[0]
    for turn, previous in enumerate((None, "resp_0", "resp_1")):
        store.save(engine, org, _response(f"resp_{turn}", previous), [_item(f"q{turn}")])
    cache = HistoryCache(1 << 20)
    first = store.load_chain(engine, org, "resp_2", cache=cache)
    assert len(cache) == (3 if engine.dialect.name == "postgresql" else 0)
    assert store.load_chain(engine, org, "resp_2", cache=cache) == first
    assert store.load_chain(engine, org, "resp_1", cache=cache) == first[:4]


@pytest.mark.unit
def test_the_history_cache_keeps_the_least_recently_used_within_its_bytes():
    cache = HistoryCache(25)
    cache.put("r1", None, [{"n": 1}], 10)
    cache.put("r2", "r1", [{"n": 2}], 10)
    assert cache.chain("r2") == {"r2": ({"n": 2},), "r1": ({"n": 1},)}
    cache.chain("r1")  # r1 used last: r2 goes first
    cache.put("r3", "r2", [{"n": 3}], 10)
    assert cache.chain("r3") == {"r3": ({"n": 3},)} and len(cache) == 2 and cache.size == 20
    cache.put("big", None, [{}], 26)  # larger than the whole cache: not held
    assert cache.chain("big") == {} and cache.size == 20
    cache.put("a", "b", [], 1)
    cache.put("b", "a", [], 1)  # a cycle (never written so) ends the walk
    assert set(cache.chain("a")) == {"a", "b"}
    assert HistoryCache(0).chain("r1") == {}
