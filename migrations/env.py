"""Alembic environment: the URL comes from the gateway's Config (``kiln db upgrade``).

On Postgres each revision commits on its own (``transaction_per_migration``), so that the locks
one takes are held only while it runs, not until the last revision of an upgrade is done:
traffic waits on a migration for a moment, not for the whole upgrade (docs/RELIABILITY.md,
"Migrations that do not stop traffic"). Every lock a revision asks for is waited for at most
:data:`LOCK_TIMEOUT`: a statement waiting for a lock makes every later request for a
conflicting one (a key check reading ``api_keys``) queue behind it, so a revision that cannot
have its locks at once (a long transaction holds the table) gives up, rolls back whole, lets
the queue through and is tried again after :data:`LOCK_PAUSE_S`, up to
:data:`LOCK_ATTEMPTS` times. SQLite, the embedded demo's database, keeps one transaction (its
table rebuilds need it)."""
import sys
import time

import sqlalchemy as sa
from alembic import context

from gateway.config import Config
from gateway.db import create_engine
from gateway.models import metadata

config = context.config

LOCK_TIMEOUT = "500ms"     # the longest a request queued behind a migration's lock waits for it
LOCK_PAUSE_S = 0.5         # between a revision that gave up and its next try
LOCK_ATTEMPTS = 240        # about four minutes of trying, then the upgrade fails
LOCK_NOT_AVAILABLE = "55P03"  # SQLSTATE of lock_timeout (PostgreSQL manual, Appendix A)


def run_migrations_online():
    url = config.get_main_option("sqlalchemy.url")
    engine = create_engine(Config.from_mapping({"database_url": url} if url else None))
    with engine.connect() as connection:
        postgres = connection.dialect.name == "postgresql"
        if postgres:
            connection.exec_driver_sql(f"SET lock_timeout = '{LOCK_TIMEOUT}'")
            connection.commit()
        context.configure(connection=connection, target_metadata=metadata,
                          render_as_batch=not postgres, compare_type=True,
                          transaction_per_migration=postgres)
        for attempt in range(1, LOCK_ATTEMPTS + 1):
            try:
                with context.begin_transaction():
                    context.run_migrations()
                break
            except sa.exc.OperationalError as err:
                if not postgres or attempt == LOCK_ATTEMPTS or \
                        getattr(err.orig, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                    raise
                connection.rollback()
                # On stderr as is: `kiln db upgrade` configures no logging, and the operator
                # should see why the upgrade takes longer.
                print(f"a migration's lock was not granted within {LOCK_TIMEOUT} (try {attempt} "
                      f"of {LOCK_ATTEMPTS}); its revision was rolled back and is tried again",
                      file=sys.stderr, flush=True)
                time.sleep(LOCK_PAUSE_S)
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline migrations are not supported; run `kiln db upgrade`")
run_migrations_online()
