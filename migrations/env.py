"""Alembic environment: the URL comes from the gateway's Config (``kiln db upgrade``).

On Postgres each revision commits on its own (``transaction_per_migration``), so that the locks
one takes are held only while it runs, not until the last revision of an upgrade is done:
traffic waits on a migration for a moment, not for the whole upgrade (docs/RELIABILITY.md).
SQLite, the embedded demo's database, keeps one transaction (its table rebuilds need it)."""
from alembic import context

from gateway.config import Config
from gateway.db import create_engine
from gateway.models import metadata

config = context.config


def run_migrations_online():
    url = config.get_main_option("sqlalchemy.url")
    engine = create_engine(Config.from_mapping({"database_url": url} if url else None))
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=metadata,
                          render_as_batch=connection.dialect.name == "sqlite",
                          compare_type=True,
                          transaction_per_migration=connection.dialect.name == "postgresql")
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline migrations are not supported; run `kiln db upgrade`")
run_migrations_online()
