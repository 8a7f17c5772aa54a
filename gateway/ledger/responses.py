"""Stored responses: what ``POST /v1/responses`` keeps when ``store`` is true, per org, until it
expires (docs/RESPONSES.md, "Stored responses").

Each row holds one response object and the input items of its own request (JSON text), and
names the response it continued (``previous_response_id``). :func:`load_chain` walks that chain
in one recursive statement, so a continued conversation costs one round trip whatever its
length; the items of links a worker already holds (:mod:`gateway.ledger.history`) are not read
again.
Every read and delete is scoped to the org: another org's id, an unknown id and an expired one
are the same 404. Stored content is the customer's data: nothing here logs it.

May import only ``gateway.ledger`` and the shared modules (models, db, errors, config).
"""
import json
import logging
import re
import time
from datetime import timedelta
from decimal import Decimal

import gevent
import orjson
import sqlalchemy as sa
from gevent import Timeout
from gevent.event import AsyncResult
from gevent.queue import Queue

from ..background import Background
from ..db import iso_utc, utcnow
from ..errors import InvalidRequest, NotFound
from ..models import response_id_created_at, stored_responses as t
from .history import history_items
from .worker import AdmissionTurn, refused_for_its_data, take_batch

log = logging.getLogger(__name__)

DEFAULT_RETENTION = timedelta(days=30)
WRITE_WINDOW_S = 10.0  # a response's row is looked for again until this long after its id
RECHECK_S = 0.02       # ... this often (a row another worker or host writes)
MAX_CHAIN = 10_000  # links followed at most (a chain is acyclic by construction; a guard)
LIST_LIMITS = (1, 100)
_DECIMAL = re.compile(r'"\\u0000dec:([0-9eE+.\-]+)\\u0000"')


def dumps(obj):
    """JSON text of ``obj`` with each Decimal (the response's ``usage.cost``) written as its
    exact literal, never through a float (a number, as the answer told it; never a string).
    orjson writes it; what orjson refuses (a lone surrogate, an integer past 64 bits) the
    standard library does, as :func:`gateway.backends.sse.dumps` does."""
    try:
        return orjson.dumps(obj, default=_decimal_fragment).decode()
    except TypeError:  # orjson.JSONEncodeError is one
        pass

    def mark(value):
        if isinstance(value, Decimal):
            return f"\x00dec:{format(value, 'f')}\x00"
        raise TypeError(f"cannot store a {type(value).__name__}")
    return _DECIMAL.sub(r"\1", json.dumps(obj, default=mark, separators=(",", ":")))


def _decimal_fragment(value):
    if isinstance(value, Decimal):
        return orjson.Fragment(format(value, "f").encode())
    raise TypeError(f"cannot store a {type(value).__name__}")


def _loads(text):
    return json.loads(text, parse_float=Decimal)


# Every digit read as 0, so that a run of 20 digits is a substring search: 2.5 times faster than
# the regular expression [0-9]{20} over a 20-turn history (the search was 3.5 times orjson's
# whole parse of it).
_DIGITS_AS_ZERO = str.maketrans("123456789", "000000000")
_LONG_INTEGER = "0" * 20


def _items(text):
    """The JSON of a stored row, read for a history (whose items carry no cost): orjson reads
    it, several times faster than the standard library; what orjson refuses (a lone surrogate's
    escape) or would read as a float (an integer of 20 digits or more) the standard library
    reads, as :func:`_loads` does."""
    if _LONG_INTEGER not in text.translate(_DIGITS_AS_ZERO):
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    return _loads(text)


def save(engine, org_id, response, input_items, retention=DEFAULT_RETENTION,
         generation_id=None, now=None, writer=None, cache=None):
    """Store ``response`` (a Response object, dict) and its request's ``input_items``.

    With the worker's ``writer`` (:class:`ResponseWriter`, Postgres) the row is queued and this
    returns at once: the answer's last bytes do not wait for it (bench/RESULTS.md, "Stored
    responses off the answer's clock"); a request that names the response before its row is
    committed waits for it (:func:`written`). The writer commits without waiting for the WAL
    flush (``synchronous_commit = off`` for its transaction): the row is visible to every
    session at once, and a database crash, like a worker's, can lose the last fraction of a
    second of stored responses (never money: the usage event is the settlement's, committed
    durably). Without a writer (SQLite) the row is committed before this returns.

    :param retention: a ``timedelta``: the row expires that long after now.
    :param cache: the worker's :class:`~gateway.ledger.history.HistoryCache`, given the row's
        items once its JSON is made (Postgres, with a writer).
    """
    now = now or utcnow()
    if engine.dialect.name != "postgresql":
        cache = None  # SQLite reads every chain whole (load_chain)

    def values():
        row = {"id": response["id"], "org_id": org_id, "generation_id": generation_id,
               "created_at": now, "expires_at": now + retention,
               "model": response.get("model") or "",
               "previous_response_id": response.get("previous_response_id"),
               "response": dumps(response), "input_items": dumps(input_items)}
        if cache is not None:
            cache.put(row["id"], row["previous_response_id"],
                      history_items(input_items, response),
                      len(row["response"]) + len(row["input_items"]))
        return row
    if engine.dialect.name != "postgresql":
        with engine.begin() as conn:
            conn.execute(t.insert().values(**values()))
    elif writer is not None:
        writer.queue(response["id"], values)
    else:
        _insert(engine, [values()])


def _insert(engine, rows):
    """Write ``rows`` (column values) in one statement, its own transaction: one round trip,
    the setting local to it."""
    payload = orjson.dumps([{**row, "created_at": iso_utc(row["created_at"]),
                             "expires_at": iso_utc(row["expires_at"])} for row in rows]).decode()
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(_SAVE_ASYNC, {"rows": payload})


_SAVE_ASYNC = sa.text(
    "INSERT INTO stored_responses (id, org_id, generation_id, created_at, expires_at, model, "
    "previous_response_id, response, input_items) "
    "SELECT r.id, r.org_id, r.generation_id, r.created_at, r.expires_at, r.model, "
    "r.previous_response_id, r.response, r.input_items "
    "FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit "
    "CROSS JOIN json_populate_recordset(NULL::stored_responses, CAST(:rows AS json)) AS r")


class ResponseWriter:
    """Writes one worker's stored responses in batches (Postgres), off the answers' clock: the
    rows queued while one batch is written go together in the next, in one statement on one
    connection. At 64 connections a row each on its own connection took the read pool past its
    size, and every connection opened beyond it was closed after one statement
    (bench/RESULTS.md, "Stored responses in batches").

    A batch the database refuses for its values is written again row by row, so that one bad
    row is the only one lost (logged by its id and the error's class: a database error's text
    quotes the row, the customer's content; docs/RESPONSES.md).

    A batch first lets the worker's next admission reach the database (``turn``, as the
    settlement writer does: docs/METERING.md, "When the usage event is final"), unless a reader
    waits for one of its rows.

    :param engine: the engine of the worker's reads and writes outside the ledger.
    :param timeout_s: the longest a reader waits for a row this worker has queued.
    :param turn: the ledger's :class:`~gateway.ledger.worker.AdmissionTurn` for this writer
        (``Ledger.admission_turn``); by default each batch is written at once.
    """

    def __init__(self, engine, timeout_s, background=None, turn=None):
        self.engine, self.timeout_s = engine, timeout_s
        self.turn = turn or AdmissionTurn()
        self._queue = Queue()
        self._pending = {}  # response id -> AsyncResult, set once its row is written or lost
        self._background = background or Background()

    def queue(self, response_id, values):
        """Queue the row of ``response_id``, ``values() -> column values`` (the JSON text is
        made in the writer, not on the answer's clock); return at once."""
        self._background.spawn("responses.writer", self._run)
        done = self._pending[response_id] = AsyncResult()
        self._queue.put((response_id, values, done))

    def wait(self, response_id):
        """Wait (up to ``timeout_s``) for this worker's queued row of ``response_id``; return
        whether there was one."""
        done = self._pending.get(response_id)
        if done is None:
            return False
        self.turn.hurry()
        done.wait(self.timeout_s)
        return True

    def drain(self, timeout_s):
        """Wait up to ``timeout_s`` for every queued row (graceful shutdown); return whether
        none is left."""
        if self._pending:
            self.turn.hurry()
        with Timeout(timeout_s, False):
            while self._pending:
                next(iter(self._pending.values())).wait()
        return not self._pending

    def _run(self):
        while True:
            first = self._queue.get()
            self.turn.wait()
            batch = self._rows(take_batch(self._queue, first))
            try:
                if batch:
                    _insert(self.engine, [values for _, values, _ in batch])
            except Exception as err:  # noqa: BLE001 - logged per row below
                if len(batch) > 1 and refused_for_its_data(err):
                    self._one_by_one(batch)
                else:
                    for response_id, _, done in batch:
                        self._lost(response_id, done, err)
                continue
            for response_id, _, done in batch:
                self._written(response_id, done)

    def _rows(self, queued):
        """``(id, column values, done)`` of each queued row whose values could be made."""
        rows = []
        for response_id, values, done in queued:
            try:
                rows.append((response_id, values(), done))
            except Exception as err:  # noqa: BLE001 - that row only
                self._lost(response_id, done, err)
        return rows

    def _one_by_one(self, batch):
        for response_id, values, done in batch:
            try:
                _insert(self.engine, [values])
            except Exception as err:  # noqa: BLE001 - that row only
                self._lost(response_id, done, err)
            else:
                self._written(response_id, done)

    def _written(self, response_id, done):
        self._pending.pop(response_id, None)
        done.set(True)

    def _lost(self, response_id, done, err):
        log.error("stored response %s not saved: %s", response_id, type(err).__name__)
        self._pending.pop(response_id, None)
        done.set(False)


def written(read, engine, response_id, writer=None, now=None):
    """Return ``read()``; when it raises :class:`NotFound` for a response created moments ago
    (its id tells when: :func:`gateway.models.response_id_created_at`) whose row is not there,
    wait for its row and read again. A response's row is written after its answer has left
    (:class:`ResponseWriter`), by whichever worker or host served it: this worker's queued rows
    are waited for directly, another's looked for every :data:`RECHECK_S` until
    :data:`WRITE_WINDOW_S` after the id's creation. Once the row is there the read says what it
    is (expired, deleted, another org's: a 404); an older or unknown id is a 404 at once.

    :param read: ``() -> value``, raising :class:`NotFound` when the row is not there.
    """
    try:
        return read()
    except NotFound as err:
        missing = err
    created = response_id_created_at(response_id)
    now = now or time.time()
    if created is None or not created - 2 <= now <= created + WRITE_WINDOW_S:
        raise missing
    if writer is not None and writer.wait(response_id):
        return read()
    deadline = created + WRITE_WINDOW_S
    while not _row_exists(engine, response_id):  # written meanwhile: read it (again)
        if time.time() >= deadline:
            raise missing
        gevent.sleep(RECHECK_S)
    return read()


def _row_exists(engine, response_id):
    with _reading(engine) as conn:
        return conn.execute(sa.select(t.c.id).where(t.c.id == response_id)).first() is not None


# The chain, newest first found, oldest first returned: one statement, compiled once.
_CHAIN = sa.text("""
WITH RECURSIVE chain AS (
  SELECT id, previous_response_id, response, input_items, 0 AS depth
    FROM stored_responses
   WHERE id = :id AND org_id = :org_id AND expires_at > :now
  UNION ALL
  SELECT r.id, r.previous_response_id, r.response, r.input_items, c.depth + 1
    FROM stored_responses r JOIN chain c ON r.id = c.previous_response_id
   WHERE r.org_id = :org_id AND r.expires_at > :now AND c.depth < :max)
SELECT id, previous_response_id, response, input_items FROM chain ORDER BY depth DESC"""
                 ).bindparams(sa.bindparam("now", type_=t.c.expires_at.type))


# The same walk, on Postgres, without the content of the links the worker holds (``:known``,
# an array of their ids): what is read again of a cached chain is its ids and that each link
# is live and the org's.
_CHAIN_KNOWN = sa.text("""
WITH RECURSIVE chain AS (
  SELECT id, previous_response_id,
         CASE WHEN id = ANY(:known) THEN NULL ELSE response END AS response,
         CASE WHEN id = ANY(:known) THEN NULL ELSE input_items END AS input_items, 0 AS depth
    FROM stored_responses
   WHERE id = :id AND org_id = :org_id AND expires_at > :now
  UNION ALL
  SELECT r.id, r.previous_response_id,
         CASE WHEN r.id = ANY(:known) THEN NULL ELSE r.response END,
         CASE WHEN r.id = ANY(:known) THEN NULL ELSE r.input_items END, c.depth + 1
    FROM stored_responses r JOIN chain c ON r.id = c.previous_response_id
   WHERE r.org_id = :org_id AND r.expires_at > :now AND c.depth < :max)
SELECT id, previous_response_id, response, input_items FROM chain ORDER BY depth DESC"""
                       ).bindparams(sa.bindparam("now", type_=t.c.expires_at.type))


def _reading(engine):
    """A connection for one read: on Postgres in autocommit (no BEGIN and ROLLBACK around the
    statement: one round trip)."""
    conn = engine.connect()
    if engine.dialect.name == "postgresql":
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
    return conn


def _not_found(response_id, param=None):
    return NotFound(f"Response with id '{str(response_id)[:80]}' not found.", param=param)


def _live(org_id, now):
    return sa.and_(t.c.org_id == org_id, t.c.expires_at > now)


def get(engine, org_id, response_id, now=None):
    """Return the stored Response object of ``response_id``.

    :raises NotFound: 404, unknown, expired or another org's.
    """
    with engine.connect() as conn:
        text = conn.execute(sa.select(t.c.response).where(
            t.c.id == response_id, _live(org_id, now or utcnow()))).scalar()
    if text is None:
        raise _not_found(response_id)
    return _loads(text)


def delete(engine, org_id, response_id, now=None):
    """Delete one stored response; return OpenAI's deletion object. Its content goes at once;
    its id stays, expired, until the sweep (:func:`sweep_expired`), so that a read of it just
    after is a 404 at once rather than a wait for a row not written yet (:func:`written`).

    :raises NotFound: 404, unknown, expired or another org's.
    """
    now = now or utcnow()
    with engine.begin() as conn:
        gone = conn.execute(t.update().where(t.c.id == response_id, _live(org_id, now))
                            .values(response="{}", input_items="[]",
                                    expires_at=now - timedelta(seconds=1)))
    if gone.rowcount != 1:
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


def load_chain(engine, org_id, response_id, now=None, cache=None):
    """Return the history a request continuing ``response_id`` carries: the input items and
    output items of every response of the chain, oldest first. With the worker's ``cache``
    (:class:`~gateway.ledger.history.HistoryCache`; Postgres), the links it holds are read as
    ids only, and the others are added to it. The items may be shared with other requests:
    read them, never change them.

    :raises NotFound: 404 (``param`` ``previous_response_id``) when ``response_id`` or any
        response before it is unknown, expired, deleted or another org's: a conversation is
        never continued with part of its history missing.
    """
    if engine.dialect.name != "postgresql":
        cache = None
    known = cache.chain(response_id) if cache is not None else {}
    params = {"id": response_id, "org_id": org_id, "now": now or utcnow(), "max": MAX_CHAIN}
    with _reading(engine) as conn:
        rows = conn.execute(_CHAIN_KNOWN, {**params, "known": list(known)}).all() if known \
            else conn.execute(_CHAIN, params).all()
    if not rows:
        raise _not_found(response_id, "previous_response_id")
    if rows[0].previous_response_id is not None:  # the oldest found still names another
        raise _not_found(rows[0].previous_response_id, "previous_response_id")
    history = []
    for row in rows:
        items = known.get(row.id)
        if items is None:
            items = history_items(_items(row.input_items), _items(row.response))
            if cache is not None:
                cache.put(row.id, row.previous_response_id, items,
                          len(row.response) + len(row.input_items))
        history += items
    return history


def input_items(engine, org_id, response_id, after=None, limit=20, order="desc", now=None):
    """Return OpenAI's list object of the input items of ``response_id``'s own request.

    :param after: an item id: list the items after it, in ``order``.
    :param order: ``asc`` or ``desc`` (OpenAI's default).
    :raises InvalidRequest: 400, a bad ``limit``, ``order`` or ``after``.
    :raises NotFound: 404.
    """
    if order not in ("asc", "desc"):
        raise InvalidRequest("Invalid 'order': expected asc or desc.", param="order",
                             code="invalid_value")
    low, high = LIST_LIMITS
    if isinstance(limit, bool) or not isinstance(limit, int) or not low <= limit <= high:
        raise InvalidRequest(f"Invalid 'limit': expected an integer from {low} to {high}.",
                             param="limit", code="invalid_value")
    with engine.connect() as conn:
        text = conn.execute(sa.select(t.c.input_items).where(
            t.c.id == response_id, _live(org_id, now or utcnow()))).scalar()
    if text is None:
        raise _not_found(response_id)
    items = _loads(text)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise InvalidRequest(f"Invalid 'after': no input item '{str(after)[:80]}' in "
                                 f"this response.", param="after", code="invalid_value")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page,
            "first_id": page[0].get("id") if page else None,
            "last_id": page[-1].get("id") if page else None,
            "has_more": len(items) > limit}


def sweep_expired(engine, now=None, batch=1000):
    """Delete stored responses past their ``expires_at``, ``batch`` at a time; return how many
    were deleted."""
    now = now or utcnow()
    total = 0
    while True:
        ids = sa.select(t.c.id).where(t.c.expires_at <= now).limit(batch).scalar_subquery()
        with engine.begin() as conn:
            n = conn.execute(t.delete().where(t.c.id.in_(ids))).rowcount
        total += n
        if n < batch:
            return total
