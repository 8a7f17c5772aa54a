"""Stored responses written in batches, off the answers' clock (gateway/ledger/responses.py,
``ResponseWriter``, ``written``) on Postgres: a save returns before its row is written, the rows
of concurrent requests go in one statement, a row the database refuses is the only one lost, and
a read of a response whose row is not written yet waits for it, in this worker or another."""
import logging
import time
import uuid
from datetime import timedelta

import gevent
import pytest
import sqlalchemy as sa

from gateway.db import utcnow
from gateway.errors import NotFound
from gateway.ledger import responses as stored
from gateway.ledger.worker import AdmissionTurn
from gateway.models import new_response_id
from gateway_proc import make_org

pytestmark = pytest.mark.postgres


def save(engine, writer, org_id, model="m", response_id=None):
    response_id = response_id or new_response_id()
    stored.save(engine, org_id, {"id": response_id, "object": "response", "model": model},
                [{"role": "user", "content": "hi"}], timedelta(days=1), writer=writer)
    return response_id


def live_rows(engine, org_id):
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT count(*) FROM stored_responses WHERE org_id = :o "
                                    "AND expires_at > :now"),
                            {"o": org_id, "now": utcnow()}).scalar_one()


def test_saves_return_at_once_and_concurrent_rows_go_in_one_statement(engine):
    org = make_org(engine, f"writer-{uuid.uuid4().hex[:8]}")
    writer = stored.ResponseWriter(engine, timeout_s=30)
    inserts = []

    def count(_conn, _cursor, statement, *_args):
        if statement.startswith("INSERT INTO stored_responses"):
            inserts.append(statement)
    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        ids = [save(engine, writer, org.id) for _ in range(20)]
        assert live_rows(engine, org.id) == 0  # queued: no answer waited for its row
        assert writer.drain(30)
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)
    assert len(inserts) <= 2  # the first row may go alone, the others queue behind it
    for response_id in ids:
        assert stored.get(engine, org.id, response_id)["id"] == response_id


def test_a_row_the_database_refuses_is_the_only_one_lost_and_logged_without_content(
        engine, caplog):
    org = make_org(engine, f"writer-bad-{uuid.uuid4().hex[:8]}")
    writer = stored.ResponseWriter(engine, timeout_s=30)
    models = ["m", "m", "x" * 5000, "m"]  # past the model column's length: a data error
    with caplog.at_level(logging.ERROR, logger="gateway.ledger.responses"):
        ids = [save(engine, writer, org.id, model) for model in models]
        assert writer.drain(30)
    assert live_rows(engine, org.id) == 3
    lost = [r.getMessage() for r in caplog.records if "not saved" in r.getMessage()]
    assert lost == [f"stored response {ids[2]} not saved: DataError"]


class Reads:
    """``get`` of one response, counting the tries."""

    def __init__(self, engine, org_id, response_id):
        self.engine, self.org_id, self.response_id, self.tries = engine, org_id, response_id, 0

    def __call__(self):
        self.tries += 1
        return stored.get(self.engine, self.org_id, self.response_id)

    def written(self, writer=None):
        return stored.written(self, self.engine, self.response_id, writer)


def test_a_read_waits_for_this_workers_queued_row(engine):
    org = make_org(engine, f"writer-wait-{uuid.uuid4().hex[:8]}")
    writer = stored.ResponseWriter(engine, timeout_s=30)
    response_id = save(engine, writer, org.id)
    reads = Reads(engine, org.id, response_id)
    assert reads.written(writer)["id"] == response_id
    assert reads.tries == 2  # not there, then there once the writer said so


def test_a_writer_after_admissions_waits_for_one_unless_a_reader_waits(engine):
    """With the ledger's turn (``Ledger.admission_turn``), a row is written once the worker's
    next admissions are answered; a read of a queued row does not wait for that."""
    org = make_org(engine, f"writer-turn-{uuid.uuid4().hex[:8]}")
    turn = AdmissionTurn(defer_s=60.0)
    writer = stored.ResponseWriter(engine, timeout_s=30, turn=turn)
    waited_for = save(engine, writer, org.id)
    gevent.sleep(0.05)
    assert live_rows(engine, org.id) == 0  # its turn has not come
    reads = Reads(engine, org.id, waited_for)
    assert reads.written(writer)["id"] == waited_for and reads.tries == 2
    later = save(engine, writer, org.id)
    gevent.sleep(0.05)
    assert live_rows(engine, org.id) == 1  # deferred again
    turn.answered()  # what the ledger's admitter does once it has answered admissions
    with gevent.Timeout(30):
        while later in writer._pending:  # written without anyone hurrying it
            gevent.sleep(0.01)
    assert stored.get(engine, org.id, later)["id"] == later


def test_a_row_written_between_the_read_and_the_look_is_read(engine):
    """The row of a young id may be committed between the read that missed it and the look for
    it: it is read again, never answered 404 (a 20-turn chain across two workers hit it)."""
    org = make_org(engine, f"writer-race-{uuid.uuid4().hex[:8]}")
    response_id = new_response_id()

    class WrittenJustAfter(Reads):
        def __call__(self):
            try:
                return super().__call__()
            finally:
                if self.tries == 1:
                    save(engine, None, org.id, response_id=response_id)
    reads = WrittenJustAfter(engine, org.id, response_id)
    assert reads.written()["id"] == response_id and reads.tries == 2


def test_a_read_looks_again_for_a_row_another_worker_writes(engine):
    org = make_org(engine, f"writer-other-{uuid.uuid4().hex[:8]}")
    response_id = new_response_id()
    gevent.spawn_later(0.2, save, engine, None, org.id, response_id=response_id)
    reads = Reads(engine, org.id, response_id)
    assert reads.written(stored.ResponseWriter(engine, timeout_s=30))["id"] == response_id
    assert reads.tries == 2  # looked for every RECHECK_S until it came, then read


def test_an_id_with_a_row_or_not_from_now_is_a_404_without_waiting(engine, monkeypatch):
    org = make_org(engine, f"writer-404-{uuid.uuid4().hex[:8]}")
    other = make_org(engine, f"writer-404b-{uuid.uuid4().hex[:8]}")
    deleted = save(engine, None, org.id)
    stored.delete(engine, org.id, deleted)
    theirs = save(engine, None, other.id)
    for response_id, tries in ((deleted, 2), (theirs, 2), (new_response_id(time.time() - 3600), 1),
                               ("resp_" + uuid.uuid4().hex, 1), ("resp_nope", 1)):
        reads = Reads(engine, org.id, response_id)  # a row there is read again, not waited for
        with pytest.raises(NotFound):
            reads.written()
        assert reads.tries == tries, response_id
    monkeypatch.setattr(stored, "WRITE_WINDOW_S", 1.5)  # ids tell whole seconds
    looks = []
    row_exists = stored._row_exists
    monkeypatch.setattr(stored, "_row_exists", lambda *a: looks.append(1) or row_exists(*a))
    never = Reads(engine, org.id, new_response_id())  # young, never written: looked for, 404
    with pytest.raises(NotFound):
        never.written()
    assert never.tries == 1 and len(looks) > 1


def test_a_graceful_stop_writes_what_is_queued(engine):
    from types import SimpleNamespace

    from gateway.ops import lifecycle
    org = make_org(engine, f"writer-stop-{uuid.uuid4().hex[:8]}")
    writer = stored.ResponseWriter(engine, timeout_s=30)
    ids = [save(engine, writer, org.id) for _ in range(5)]
    services = SimpleNamespace(ledger=SimpleNamespace(drain=lambda _s: True),
                               config=SimpleNamespace(settle_drain_s=30))
    app = SimpleNamespace(extensions={"kiln": services, "kiln.responses_writer": writer})
    assert lifecycle.drain(app)
    assert live_rows(engine, org.id) == len(ids)
