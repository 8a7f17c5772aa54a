"""``kiln`` command plumbing: the context every command gets (settings, a lazily created
engine) and ``kiln db``, the alembic migrations of this package."""
from pathlib import Path

import click

from ..config import Config
from ..db import create_engine

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


class Context:
    def __init__(self):
        self.config = Config.from_mapping()
        self._engine = None

    @property
    def engine(self):
        if self._engine is None:
            self._engine = create_engine(self.config)
        return self._engine


pass_ctx = click.make_pass_decorator(Context, ensure=True)


@click.group()
def db():
    """Database migrations (alembic)."""


def alembic_config(url):
    """Return an alembic Config for ``url`` and this package's migrations."""
    from alembic.config import Config as AlembicConfig
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


@db.command("upgrade")
@click.argument("revision", default="head")
@pass_ctx
def db_upgrade(ctx, revision):
    """Apply migrations up to REVISION (default head)."""
    from alembic import command
    command.upgrade(alembic_config(ctx.config.database_url), revision)


@db.command("downgrade")
@click.argument("revision")
@pass_ctx
def db_downgrade(ctx, revision):
    """Revert migrations down to REVISION (``base`` for none)."""
    from alembic import command
    command.downgrade(alembic_config(ctx.config.database_url), revision)


@db.command("check")
@pass_ctx
def db_check(ctx):
    """Fail if the tables differ from the models (``alembic check``)."""
    from alembic import command
    command.check(alembic_config(ctx.config.database_url))
