"""Stored responses written in batches (gateway/ledger/responses.py, ``ResponseWriter``) on
Postgres: the rows of concurrent requests go in one statement, each caller returns once its row
is committed, and a row the database refuses is the only one lost."""
import uuid
from datetime import timedelta

import gevent
import pytest
import sqlalchemy as sa

from gateway.db import utcnow
from gateway.ledger import responses as stored
from gateway_proc import make_org

pytestmark = pytest.mark.postgres


def save(engine, writer, org_id, model="m"):
    response_id = f"resp_{uuid.uuid4().hex}"
    stored.save(engine, org_id, {"id": response_id, "object": "response", "model": model},
                [{"role": "user", "content": "hi"}], timedelta(days=1), writer=writer)
    return response_id


def test_concurrent_rows_go_in_one_statement_and_each_waits_for_its_own(engine):
    org = make_org(engine, f"writer-{uuid.uuid4().hex[:8]}")
    writer = stored.ResponseWriter(engine, timeout_s=30)
    inserts = []

    def count(_conn, _cursor, statement, *_args):
        if statement.startswith("INSERT INTO stored_responses"):
            inserts.append(statement)
    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        saves = [gevent.spawn(save, engine, writer, org.id) for _ in range(20)]
        gevent.joinall(saves, raise_error=True)
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)
    ids = [g.value for g in saves]
    assert len(inserts) <= 2  # the first row may go alone, the others queue behind it
    for response_id in ids:  # each is readable once its save returned
        assert stored.get(engine, org.id, response_id)["id"] == response_id


def test_a_row_the_database_refuses_is_the_only_one_lost(engine):
    org = make_org(engine, f"writer-bad-{uuid.uuid4().hex[:8]}")
    writer = stored.ResponseWriter(engine, timeout_s=30)
    models = ["m", "m", "x" * 5000, "m"]  # past the model column's length: a data error
    saves = [gevent.spawn(save, engine, writer, org.id, model) for model in models]
    gevent.joinall(saves)
    assert [g.successful() for g in saves] == [True, True, False, True]
    assert isinstance(saves[2].exception, sa.exc.DBAPIError)
    with engine.connect() as conn:
        count = conn.execute(sa.text("SELECT count(*) FROM stored_responses WHERE org_id = :o "
                                     "AND expires_at > :now"),
                             {"o": org.id, "now": utcnow()}).scalar_one()
    assert count == 3
