"""Database engine: Postgres through psycopg 3 (cooperative under gevent), or a SQLite file.

Units of work are short ``engine.begin()`` blocks; no connection is held while a response streams.
"""
import sys
import unicodedata
from datetime import datetime, timezone

import sqlalchemy as sa
from gevent.hub import Waiter, get_hub
from psycopg import OperationalError


def normalize_url(url):
    """Return ``url`` with Postgres URLs pinned to the psycopg 3 driver.

    psycopg2 blocks the whole gevent worker on every query; psycopg 3 waits cooperatively.
    """
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def create_engine(config, ledger=False):
    """Create the engine for ``config.database_url``.

    :param config: a :class:`gateway.config.Config`.
    :param ledger: the ledger's own pool (Postgres): autocommit connections, since each ledger
        call is one statement (no BEGIN and COMMIT round trips), sized by ``db_pool_size``; the
        other pool (reads, the CLI, migrations) is small and transactional.
    """
    url = normalize_url(config.database_url)
    if url.startswith("sqlite"):
        engine = sa.create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        sa.event.listen(engine, "begin", _sqlite_begin_immediate)
        return engine
    _wait_on_gevent()
    options = {"isolation_level": "AUTOCOMMIT",
               # Nothing to reset: an autocommit connection is never left in a transaction,
               # and the rollback SQLAlchemy calls on each return is Python on every statement.
               "pool_reset_on_return": None} if ledger else {}
    return sa.create_engine(
        url,
        pool_size=config.db_pool_size if ledger else 2,
        max_overflow=config.db_max_overflow if ledger else 4,
        pool_timeout=config.db_pool_timeout_s,
        # No ping on checkout (it would double the round trips of admission and settlement):
        # a connection found dead is dropped and the statement retried (gateway.ledger).
        pool_pre_ping=False,
        pool_recycle=1800,
        # Protocol-level prepared statements off: pgbouncer before 1.21 cannot keep them in
        # transaction mode. The ledger's statements are prepared server-side instead (its
        # PL/pgSQL functions cache their plans per connection).
        connect_args={"prepare_threshold": None, "application_name": "kiln-gateway",
                      "connect_timeout": 5},
        **options,
    )


def _wait_on_gevent():
    """Have psycopg wait for its socket with one gevent io watcher per wait, in a worker whose
    ``select`` gevent patched.

    psycopg then waits with ``select.poll`` (psycopg/waiting.py, ``_is_select_patched``), which
    gevent emulates with a poll object, a watcher per registered fd and a result object for
    each wait: about 20 µs of CPU per wait, each statement waiting at least once. Installed at
    module level, where psycopg's connections look it up at each wait (``waiting.wait``).
    """
    monkey = sys.modules.get("gevent.monkey")
    if monkey is None or not monkey.is_module_patched("select"):
        return
    from psycopg import waiting
    if waiting.wait is not _gevent_wait:
        _gevent_wait.fallback = waiting.wait
        waiting.wait = _gevent_wait


def _gevent_wait(gen, fileno, interval=0.0, timeout=None):
    """psycopg's wait function (``psycopg.waiting.wait``: drive ``gen`` with the socket's
    readiness until it returns) on gevent's loop. A wait with a deadline (``timeout``, which
    only ``Connection.notifies`` asks for) is left to psycopg's own. ``interval`` exists for
    signal checks between polls, which gevent's loop does itself."""
    if timeout is not None:
        return _gevent_wait.fallback(gen, fileno, interval, timeout)
    hub = get_hub()
    try:
        wanted = next(gen)
        while True:
            watcher = hub.loop.io(fileno, wanted)  # psycopg's Wait.R/W are libev's READ/WRITE
            waiter = Waiter(hub)
            watcher.start(waiter.switch, pass_events=True)
            try:
                ready = waiter.get() & 3
            finally:
                watcher.stop()
                watcher.close()
            if not ready:
                raise OperationalError("connection socket closed")
            wanted = gen.send(ready)
    except StopIteration as done:
        return done.value


def _sqlite_pragmas(dbapi_conn, _record):
    # pysqlite begins a transaction only before a write, so a read-then-write (a settlement,
    # a sweep, an admission) could act on rows another process changed meanwhile: two
    # workers' sweepers both closed one generation. Transactions begin here instead, with
    # BEGIN IMMEDIATE, which takes the database's write lock up front (SQLAlchemy's documented
    # recipe for pysqlite, "Serializable isolation / Savepoints / Transactional DDL").
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


def _sqlite_begin_immediate(conn):
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def utcnow():
    """Return the current time as an aware UTC datetime."""
    return datetime.now(timezone.utc)


def iso_utc(ts):
    """Return a stored timestamp as ISO 8601 with its offset (None stays None); SQLite hands
    timestamps back naive, and they are UTC."""
    if ts is None:
        return None
    return (ts if ts.tzinfo else ts.replace(tzinfo=timezone.utc)).isoformat()


def is_postgres(engine):
    """Tell whether ``engine`` talks to Postgres."""
    return engine.dialect.name == "postgresql"


def storable_text(value, max_chars):
    """Tell whether ``value`` is text both databases store as given: a str of at most
    ``max_chars`` characters, valid Unicode (no lone surrogates, which have no UTF-8 form) and
    free of control characters (Postgres refuses NUL in text; the others have no place in a
    name or an id).
    """
    if not isinstance(value, str) or len(value) > max_chars:
        return False
    return not any(unicodedata.category(ch) in ("Cc", "Cs") for ch in value)
