"""The ``kiln`` command: migrations, orgs, keys, credits, maintenance, sweeping.

Reads the same ``KILN_*`` settings as the gateway. ``kiln key create`` prints the new key as the
last line of stdout, so scripts can take it with ``tail -n 1``.
"""
import sys
from decimal import Decimal, InvalidOperation
from pathlib import Path

import click
import sqlalchemy as sa

from . import auth, ops
from .account import org_credits
from .catalog import load_catalog
from .config import Config
from .db import create_engine
from .ledger import Ledger
from .ledger.operator import grant
from .models import orgs
from .reconcile import format_table, reconcile

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


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


class KilnGroup(click.Group):
    """Turns database failures into one readable line instead of a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except sa.exc.DBAPIError as err:
            url = Config.from_mapping().database_url
            hint = ("is it migrated? run `kiln db upgrade`" if "no such table" in str(err.orig)
                    or "does not exist" in str(err.orig) else "is it reachable?")
            raise click.ClickException(f"database {_safe_url(url)}: {hint} ({err.orig})") \
                from err


def _safe_url(url):
    return sa.engine.make_url(url).render_as_string(hide_password=True)


@click.group(cls=KilnGroup)
def main():
    """Kiln gateway administration."""


# -- db ----------------------------------------------------------------------------------------

@main.group()
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


# -- orgs and keys -------------------------------------------------------------------------------

def find_org(engine, ref):
    """Return the org id for a name or numeric id.

    :raises click.ClickException: no such org.
    """
    with engine.connect() as conn:
        row = conn.execute(sa.select(orgs.c.id).where(
            (orgs.c.name == ref) | (orgs.c.id == (int(ref) if ref.isdigit() else -1)))).first()
    if row is None:
        raise click.ClickException(f"no org {ref!r}")
    return row.id


@main.group()
def org():
    """Organizations."""


@org.command("create")
@click.argument("name")
@click.option("--limit", type=click.IntRange(1), default=None,
              help="In-flight limit (default: KILN_DEFAULT_IN_FLIGHT_LIMIT).")
@pass_ctx
def org_create(ctx, name, limit):
    """Create org NAME; print its id."""
    with ctx.engine.begin() as conn:
        if conn.execute(sa.select(orgs.c.id).where(orgs.c.name == name)).first():
            raise click.ClickException(f"org {name!r} exists")
        org_id = conn.execute(orgs.insert().values(name=name, in_flight_limit=limit)
                              .returning(orgs.c.id)).scalar_one()
    click.echo(org_id)


@org.command("set")
@click.argument("ref")
@click.option("--limit", type=click.IntRange(1), default=None, help="In-flight limit.")
@click.option("--status", type=click.Choice(["active", "suspended"]), default=None)
@pass_ctx
def org_set(ctx, ref, limit, status):
    """Change org REF's in-flight limit or status."""
    values = {k: v for k, v in (("in_flight_limit", limit), ("status", status)) if v is not None}
    if not values:
        raise click.UsageError("nothing to change: give --limit or --status")
    org_id = find_org(ctx.engine, ref)
    with ctx.engine.begin() as conn:
        conn.execute(orgs.update().where(orgs.c.id == org_id).values(**values))


@main.group()
def key():
    """API keys."""


@key.command("create")
@click.argument("org_ref")
@click.option("--name", default=None)
@click.option("--models", default=None, help="Comma-separated allow-list of model ids.")
@pass_ctx
def key_create(ctx, org_ref, name, models):
    """Create a key for ORG_REF; the key is the last line of stdout (shown only this once)."""
    org_id = find_org(ctx.engine, org_ref)
    allowed = [m.strip() for m in models.split(",") if m.strip()] if models else None
    with ctx.engine.begin() as conn:
        secret = auth.create_key(conn, org_id, name=name, allowed_models=allowed)
    click.echo(f"# key prefix {secret[:auth.PREFIX_LEN]}; store the key now, it is not kept",
               err=True)
    click.echo(secret)


@key.command("revoke")
@click.argument("prefix")
@pass_ctx
def key_revoke(ctx, prefix):
    """Revoke the key whose display prefix is PREFIX."""
    with ctx.engine.begin() as conn:
        if not auth.revoke_key(conn, prefix):
            raise click.ClickException(f"no active key with prefix {prefix!r}")
    click.echo(f"revoked {prefix}")


# -- credits -------------------------------------------------------------------------------------

@main.group()
def credits():
    """Prepaid credits."""


@credits.command("grant")
@click.argument("org_ref")
@click.argument("usd")
@click.option("--note", default=None)
@pass_ctx
def credits_grant(ctx, org_ref, usd, note):
    """Add USD (exact decimal, may be negative to correct) to ORG_REF's credits."""
    try:
        amount = Decimal(usd)
    except InvalidOperation as err:
        raise click.BadParameter(f"not a decimal amount: {usd!r}") from err
    org_id = find_org(ctx.engine, org_ref)
    try:
        grant(ctx.engine, org_id, amount, note)
    except sa.exc.IntegrityError as err:  # the grant trigger refused it (migration 0002)
        raise click.ClickException(str(err.orig).splitlines()[0]) from err
    _show(ctx.engine, org_id)


@credits.command("show")
@click.argument("org_ref")
@pass_ctx
def credits_show(ctx, org_ref):
    """Show ORG_REF's balance, open holds and available credits (USD)."""
    _show(ctx.engine, find_org(ctx.engine, org_ref))


def _show(engine, org_id):
    data = org_credits(engine, org_id)
    click.echo(" ".join(f"{k}={v}" for k, v in data.items()))


@credits.command("reconcile")
@pass_ctx
def credits_reconcile(ctx):
    """Check every org: balance = Σ grants − Σ usage costs, holds and leases consistent.

    Prints one line per org; exits 1 naming the orgs that are off (on stderr), else 0.
    """
    rows, off = reconcile(ctx.engine)
    click.echo(format_table(rows))
    if off:
        click.echo(f"OFF: {', '.join(off)}", err=True)
        sys.exit(1)


# -- operations ----------------------------------------------------------------------------------

@main.command()
@click.argument("state", type=click.Choice(["on", "off", "status"]))
@click.option("--retry-after", "retry_after_s", type=click.IntRange(1), default=300,
              help="Seconds sent in Retry-After.")
@click.option("--message", default=None)
@pass_ctx
def maintenance(ctx, state, retry_after_s, message):
    """Switch maintenance mode (every worker follows within seconds), or show it."""
    if state != "status":
        ops.set_maintenance(ctx.engine, state == "on", retry_after_s, message)
    enabled, retry, msg = ops.read_maintenance(ctx.engine)
    click.echo(f"maintenance={'on' if enabled else 'off'} retry_after_s={retry} "
               f"message={msg or ''}")


@main.command()
@pass_ctx
def sweep(ctx):
    """Close generations whose in-flight lease expired (their worker died)."""
    ledger = Ledger(create_engine(ctx.config, ledger=True), ctx.config,
                    load_catalog(ctx.config.models))
    closed = ledger.sweep()
    click.echo(f"closed {closed}")


if __name__ == "__main__":
    main()
