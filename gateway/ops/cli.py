"""The ``kiln`` command: migrations, orgs, keys, credits, maintenance, sweeping.

Reads the same ``KILN_*`` settings as the gateway. ``kiln key create`` prints the new key as the
last line of stdout, so scripts can take it with ``tail -n 1``.

An org is named by its name (``acme``, also ``7``); by id only as ``id:7``, so that the org
named ``7`` and the org with id 7 are never confused. Names cannot begin with ``id:``.
"""
import re
import sys
from decimal import Decimal

import click
import sqlalchemy as sa

from . import lifecycle as ops
from ..contract.catalog import load_catalog
from .cli_catalog import catalog
from .cli_db import db, pass_ctx
from .cli_webhooks import Webhooks
from .cli_keys import (LIST_COLUMNS, POSITIVE_INTEGER, limit_changes, limit_options, list_line,
                       parse_limit_usd)
from ..config import Config
from ..db import create_engine, is_postgres, storable_text, utcnow
from ..ledger import Ledger
from ..ledger import keys
from ..ledger import responses as stored_responses
from ..ledger.operator import GRANT, org_credits
from ..ledger import key_admin
from ..ledger.key_admin import set_limits
from ..ledger.keys import org_keys
from ..models import api_keys, credit_balances, orgs
from ..ledger.reconcile import format_table, reconcile


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


# -- orgs and keys -------------------------------------------------------------------------------

ID_PREFIX = "id:"
ORG_NAME_MAX = orgs.c.name.type.length


def find_org(engine, ref):
    """Return the id of the org ``ref`` names: a name, or ``id:N`` for the org with id N.

    A bare number is a name like any other: ``7`` is the org named "7", never the org with id 7.

    :raises click.ClickException: no such org (with a hint when ``ref`` is an id written bare).
    """
    if ref.startswith(ID_PREFIX):
        org_id = _org_id(ref[len(ID_PREFIX):])
        if org_id is None:
            raise click.ClickException(f"no org {ref!r}: an org id is written id:N, N a number")
        if (found := _select_org(engine, orgs.c.id == org_id)) is None:
            raise click.ClickException(f"no org with id {org_id}")
        return found
    found = _select_org(engine, orgs.c.name == ref) if storable_text(ref, ORG_NAME_MAX) else None
    if found is None:
        raise click.ClickException(f"no org named {ref!r}{_id_hint(engine, ref)}")
    return found


def _select_org(engine, where):
    with engine.connect() as conn:
        return conn.execute(sa.select(orgs.c.id).where(where)).scalar()


def _id_hint(engine, ref):
    """When ``ref`` is the id of an org written bare, say how to write it."""
    org_id = _org_id(ref)
    if org_id is not None and _select_org(engine, orgs.c.id == org_id) is not None:
        return f" (the org with id {org_id} is {ID_PREFIX}{org_id})"
    return ""


def _org_id(text):
    """Return ``text`` as an org id (ASCII digits, within an INTEGER), or None."""
    if text.isascii() and text.isdigit() and len(text) <= 9:
        return int(text)
    return None


def check_org_name(name):
    """Refuse a name that is not 1-200 printable characters without surrounding spaces, or that
    begins with ``id:`` (it would read as an org id).

    :raises click.BadParameter: the name, and why.
    """
    if not (name and storable_text(name, ORG_NAME_MAX) and name.isprintable()
            and name == name.strip()):
        raise click.BadParameter(f"an org name is 1 to {ORG_NAME_MAX} printable characters, "
                                 f"without leading or trailing spaces: {name!r}",
                                 param_hint="NAME")
    if name.lower().startswith(ID_PREFIX):
        raise click.BadParameter(f"an org name cannot begin with {ID_PREFIX!r} (that is how "
                                 f"org ids are written): {name!r}", param_hint="NAME")


class Text(click.ParamType):
    """One line of text the database stores as given: no control characters, valid Unicode
    (argv may carry undecodable bytes), at most ``max_chars`` characters."""

    name = "text"

    def __init__(self, max_chars):
        self.max_chars = max_chars

    def convert(self, value, param, ctx):
        if not storable_text(value, self.max_chars):
            self.fail(f"at most {self.max_chars} characters, no control characters, valid "
                      f"UTF-8: {value!r}", param, ctx)
        return value


@main.group()
def org():
    """Organizations."""


@org.command("create")
@click.argument("name")
@click.option("--limit", type=POSITIVE_INTEGER, default=None,
              help="In-flight limit (default: KILN_DEFAULT_IN_FLIGHT_LIMIT).")
@pass_ctx
def org_create(ctx, name, limit):
    """Create org NAME; print its id."""
    check_org_name(name)
    with ctx.engine.begin() as conn:
        if conn.execute(sa.select(orgs.c.id).where(orgs.c.name == name)).first():
            raise click.ClickException(f"org {name!r} exists")
        org_id = conn.execute(orgs.insert().values(name=name, in_flight_limit=limit)
                              .returning(orgs.c.id)).scalar_one()
    click.echo(org_id)


@org.command("set")
@click.argument("ref")
@click.option("--limit", type=POSITIVE_INTEGER, default=None, help="In-flight limit.")
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
    """API keys, with optional spend limits and request rates."""


@key.command("create")
@click.argument("org_ref")
@click.option("--name", "--label", "label", type=Text(api_keys.c.name.type.length))
@click.option("--models", type=Text(4000), help="Comma-separated allow-list of model ids.")
@limit_options
@click.option("--org-read/--no-org-read", "org_read", default=None,
              help="May read the org's other keys and org-wide activity (default: unless "
                   "--models or --limit restrict the key).")
@click.option("--in-flight", "in_flight", type=POSITIVE_INTEGER, default=None,
              help="The key's own cap of requests in flight (the org's applies too).")
@click.option("--manage", is_flag=True,
              help="A management key: manages the org's keys through the keys API "
                   "(docs/KEYS.md); it calls no model.")
@pass_ctx
def key_create(ctx, org_ref, label, models, limit_text, reset, rpm, org_read, in_flight,
               manage):
    """Create a key for ORG_REF; the key is the last line of stdout (shown only this once)."""
    limit = None if limit_text is None else parse_limit_usd(limit_text, is_postgres(ctx.engine))
    org_id = find_org(ctx.engine, org_ref)
    allowed = allow_list(ctx, models)
    values = {"name": label, "allowed_models": allowed, "limit_usd": limit,
              "limit_reset": None if reset == "never" else reset, "rpm_limit": rpm,
              "org_read": org_read, "in_flight_limit": in_flight, "manage": manage or None}
    _key_id, secret = key_admin.create(
        ctx.engine, org_id, {k: v for k, v in values.items() if v is not None},
        key_admin.OPERATOR)
    click.echo(f"# key prefix {secret[:keys.PREFIX_LEN]}; store the key now, it is not kept",
               err=True)
    click.echo(secret)


def allow_list(ctx, models):
    """Return the ``--models`` allow-list as ids (None: every model); an id that is not in the
    catalog (``KILN_MODELS``) is refused, since no request could ever use it."""
    if not models:
        return None
    allowed = [m.strip() for m in models.split(",") if m.strip()]
    known = load_catalog(ctx.config.models)
    unknown = sorted(set(allowed) - set(known))
    if unknown:
        raise click.BadParameter(f"not in the catalog: {', '.join(map(repr, unknown))} (its "
                                 f"models: {', '.join(sorted(known))})", param_hint="--models")
    return allowed


@key.command("set")
@click.argument("prefix", type=Text(api_keys.c.prefix.type.length))
@limit_options
@click.option("--no-limit", is_flag=True, help="Remove the spend limit.")
@click.option("--no-rpm", is_flag=True, help="Remove the request rate limit.")
@click.option("--org-read/--no-org-read", "org_read", default=None,
              help="Whether the key may read the org's other keys and org-wide activity.")
@click.option("--in-flight", "in_flight", type=POSITIVE_INTEGER, default=None,
              help="The key's own cap of requests in flight.")
@click.option("--no-in-flight", is_flag=True, help="Remove the key's own in-flight cap.")
@pass_ctx
def key_set(ctx, prefix, limit_text, reset, rpm, no_limit, no_rpm, org_read, in_flight,
            no_in_flight):
    """Change the limits of the key PREFIX; a new --reset starts a new period now (its spend
    counted again from the key's usage events since that period's start)."""
    changes = limit_changes(limit_text, reset, rpm, no_limit, no_rpm, is_postgres(ctx.engine),
                            org_read, in_flight, no_in_flight)
    if not set_limits(ctx.engine, prefix, changes):
        raise click.ClickException(f"no key with prefix {prefix!r}")
    click.echo(f"updated {prefix}")


@key.command("list")
@click.argument("org_ref")
@pass_ctx
def key_list(ctx, org_ref):
    """List ORG_REF's keys: label, prefix, limit, usage this period, remaining, rpm, created,
    last used (USD as exact decimals; '-' for none)."""
    now, rows = utcnow(), org_keys(ctx.engine, find_org(ctx.engine, org_ref))
    click.echo("\n".join(["\t".join(LIST_COLUMNS), *(list_line(row, now) for row in rows)]))


@key.command("revoke")
@click.argument("prefix", type=Text(api_keys.c.prefix.type.length))
@pass_ctx
def key_revoke(ctx, prefix):
    """Revoke the key whose display prefix is PREFIX."""
    if not key_admin.revoke_prefix(ctx.engine, prefix):
        raise click.ClickException(f"no active key with prefix {prefix!r}")
    click.echo(f"revoked {prefix}")


# -- credits -------------------------------------------------------------------------------------

@main.group()
def credits():
    """Prepaid credits."""


# The balance is kept in BIGINT nano-dollars; NUMERIC(20, 9) could hold 10 times more.
MAX_BALANCE_NANOS = 2**63 - 1
# SQLite keeps NUMERIC as a binary float, exact to 15 significant digits: below $1,000,000 an
# amount of nano-dollars has at most 15, and its trigger converts it exactly.
SQLITE_MAX_GRANT_USD = Decimal("999999.999999999")
PLAIN_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
NANO = Decimal("0.000000001")


def parse_grant_usd(text, postgres):
    """Return ``text`` as an exact, non-zero Decimal of USD that the grant trigger records as
    given: plain decimal notation (no exponent, NaN or Infinity), at most 9 decimal places,
    within the balance's range (below $1,000,000 per grant on SQLite).

    :param postgres: whether the database is Postgres.
    :raises click.BadParameter: the amount, and the rule it breaks.
    """
    def refuse(why):
        return click.BadParameter(f"{text!r}: {why}", param_hint="USD")
    if not PLAIN_DECIMAL.fullmatch(text):
        raise refuse("write the amount in plain decimal notation, e.g. 100.00 or -0.5")
    amount = Decimal(text)
    if amount == 0:
        raise refuse("a grant of zero changes nothing")
    limit = Decimal(MAX_BALANCE_NANOS) * NANO if postgres else SQLITE_MAX_GRANT_USD
    if abs(amount) > limit:
        raise refuse(f"more than the largest grant Kiln records exactly ({limit:f} USD on "
                     f"{'Postgres' if postgres else 'SQLite'})")
    if amount != amount.quantize(NANO):
        raise refuse("more than 9 decimal places (credits are kept in nano-dollars)")
    return amount


# A negative amount is an argument, as README "Administration" writes it (`... grant acme -0.5`),
# not an unknown option (click's ignore_unknown_options passes it through).
@credits.command("grant", context_settings={"ignore_unknown_options": True})
@click.argument("org_ref")
@click.argument("usd")
@click.option("--note", type=Text(1000), default=None)
@pass_ctx
def credits_grant(ctx, org_ref, usd, note):
    """Add USD (exact decimal, may be negative to correct) to ORG_REF's credits."""
    amount = parse_grant_usd(usd, is_postgres(ctx.engine))
    org_id = find_org(ctx.engine, org_ref)
    try:
        with ctx.engine.begin() as conn:
            _check_balance_range(conn, org_id, amount)
            # The same plain INSERT an operator runs in psql; the trigger moves the balance.
            conn.execute(GRANT, {"org": org_id, "amount": str(amount), "note": note})
    except sa.exc.IntegrityError as err:  # the grant trigger refused it (migration 0002)
        raise click.ClickException(str(err.orig).splitlines()[0]) from err
    except sa.exc.DataError as err:  # Postgres: a concurrent grant took the balance to the edge
        raise click.ClickException(f"credit grant refused: {str(err.orig).splitlines()[0]}") \
            from err
    _show(ctx.engine, org_id)


def _check_balance_range(conn, org_id, amount):
    balance = conn.execute(sa.select(credit_balances.c.balance_nanos)
                           .where(credit_balances.c.org_id == org_id)).scalar() or 0
    if balance + int(amount / NANO) > MAX_BALANCE_NANOS:
        raise click.ClickException(f"credit grant of {amount} USD refused: the balance would "
                                   f"exceed {Decimal(MAX_BALANCE_NANOS) * NANO} USD, the most "
                                   f"Kiln stores")


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
@click.option("--retry-after", "retry_after_s", type=POSITIVE_INTEGER, default=300,
              help="Seconds sent in Retry-After.")
@click.option("--message", type=Text(1000), default=None)
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
    """Close generations whose in-flight lease expired (their worker died), and delete stored
    responses past their retention."""
    ledger = Ledger(create_engine(ctx.config, ledger=True), ctx.config,
                    load_catalog(ctx.config.models))  # no backend is called: no key read
    closed = ledger.sweep()
    purged = stored_responses.sweep_expired(ctx.engine)  # past their retention
    click.echo(f"closed {closed}; stored responses past their retention deleted: {purged}")


main.add_command(db)
main.add_command(catalog)
main.add_command(Webhooks(find_org))

if __name__ == "__main__":
    main()
