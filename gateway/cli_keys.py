"""``kiln key``: create, change, list and revoke API keys (part of :mod:`gateway.cli`).

A key's spend limit is an exact decimal of USD (like credit amounts: plain notation, at most 9
decimal places; 0 allowed, which stops the key from spending), optionally reset each UTC day,
ISO week or month; its rate is requests per UTC minute. Changes reach every gateway worker
within ``KILN_KEY_CACHE_TTL_S``.
"""
from decimal import Decimal

import click

from . import auth
from .cli import PLAIN_DECIMAL, Text, find_org, pass_ctx
from .db import is_postgres, utcnow
from .keys import RESETS, key_view, org_keys, set_limits
from .models import api_keys

# Admission compares the limit in BIGINT nano-dollars; SQLite's NUMERIC is a binary float,
# exact to 15 significant digits (see ``kiln credits grant``).
MAX_LIMIT_USD = {True: Decimal(2**63 - 1).scaleb(-9), False: Decimal("999999.999999999")}
RPM = click.IntRange(1, 2**31 - 1)


def parse_limit_usd(text, postgres):
    """Return ``text`` as the exact Decimal USD of a spend limit.

    :raises click.BadParameter: not plain decimal notation, negative, finer than a nano-dollar,
        or above what admission compares exactly.
    """
    def refuse(why):
        return click.BadParameter(f"{text!r}: {why}", param_hint="--limit")
    if not PLAIN_DECIMAL.fullmatch(text):
        raise refuse("write the limit in plain decimal notation, e.g. 10.00")
    amount = Decimal(text)
    if amount < 0:
        raise refuse("a spend limit cannot be negative")
    if amount != amount.quantize(Decimal("1e-9")):
        raise refuse("more than 9 decimal places (spend is counted in nano-dollars)")
    if amount > MAX_LIMIT_USD[postgres]:
        raise refuse(f"above the largest limit Kiln compares exactly "
                     f"({MAX_LIMIT_USD[postgres]:f} USD)")
    return amount


def limit_options(command):
    """Add ``--limit``, ``--reset`` and ``--rpm`` to ``command``."""
    for option in reversed((
            click.option("--limit", "limit_text", default=None,
                         help="Spend limit in USD (exact decimal)."),
            click.option("--reset", type=click.Choice([*RESETS, "never"]), default=None,
                         help="When the spend limit starts again (UTC); default never."),
            click.option("--rpm", type=RPM, default=None, help="Requests per minute."))):
        command = option(command)
    return command


@click.group()
def key():
    """API keys."""


@key.command("create")
@click.argument("org_ref")
@click.option("--name", "--label", "label", type=Text(api_keys.c.name.type.length),
              default=None, help="What the key is for (shown in listings).")
@click.option("--models", type=Text(4000), default=None,
              help="Comma-separated allow-list of model ids.")
@limit_options
@pass_ctx
def key_create(ctx, org_ref, label, models, limit_text, reset, rpm):
    """Create a key for ORG_REF; the key is the last line of stdout (shown only this once)."""
    limit = None if limit_text is None else parse_limit_usd(limit_text,
                                                            is_postgres(ctx.engine))
    org_id = find_org(ctx.engine, org_ref)
    allowed = [m.strip() for m in models.split(",") if m.strip()] if models else None
    reset = None if reset == "never" else reset
    with ctx.engine.begin() as conn:
        secret = auth.create_key(conn, org_id, name=label, allowed_models=allowed,
                                 limit_usd=limit, limit_reset=reset, rpm_limit=rpm)
    click.echo(f"# key prefix {secret[:auth.PREFIX_LEN]}; store the key now, it is not kept",
               err=True)
    click.echo(secret)


@key.command("set")
@click.argument("prefix", type=Text(api_keys.c.prefix.type.length))
@limit_options
@click.option("--no-limit", is_flag=True, help="Remove the spend limit.")
@click.option("--no-rpm", is_flag=True, help="Remove the request rate limit.")
@pass_ctx
def key_set(ctx, prefix, limit_text, reset, rpm, no_limit, no_rpm):
    """Change the limits of the key whose display prefix is PREFIX.

    A new --reset starts a new period now: the key's spend is counted again from its usage
    events since that period's start.
    """
    changes = _changes(ctx, limit_text, reset, rpm, no_limit, no_rpm)
    if not set_limits(ctx.engine, prefix, changes):
        raise click.ClickException(f"no key with prefix {prefix!r}")
    click.echo(f"updated {prefix}")


def _changes(ctx, limit_text, reset, rpm, no_limit, no_rpm):
    if limit_text is not None and no_limit or rpm is not None and no_rpm:
        raise click.UsageError("give either a value or its --no- flag, not both")
    changes = {}
    if limit_text is not None or no_limit:
        changes["limit_usd"] = None if no_limit else parse_limit_usd(
            limit_text, is_postgres(ctx.engine))
    if reset is not None:
        changes["limit_reset"] = None if reset == "never" else reset
    if rpm is not None or no_rpm:
        changes["rpm_limit"] = None if no_rpm else rpm
    if not changes:
        raise click.UsageError("nothing to change: give --limit, --reset, --rpm, --no-limit "
                               "or --no-rpm")
    return changes


@key.command("list")
@click.argument("org_ref")
@pass_ctx
def key_list(ctx, org_ref):
    """List ORG_REF's keys: label, prefix, limit, usage this period, remaining, rpm, created,
    last used (USD as exact decimals; '-' for none)."""
    now = utcnow()
    columns = ("prefix", "label", "limit_usd", "limit_reset", "usage_usd", "remaining_usd",
               "rpm", "created_at", "last_used_at", "status")
    click.echo("\t".join(columns))
    for row in org_keys(ctx.engine, find_org(ctx.engine, org_ref)):
        view = key_view(row, now)
        view["rpm"] = row.rpm_limit
        view["status"] = "revoked" if view["revoked"] else "active"
        click.echo("\t".join("-" if view[c] is None else str(view[c]) for c in columns))


@key.command("revoke")
@click.argument("prefix", type=Text(api_keys.c.prefix.type.length))
@pass_ctx
def key_revoke(ctx, prefix):
    """Revoke the key whose display prefix is PREFIX."""
    with ctx.engine.begin() as conn:
        if not auth.revoke_key(conn, prefix):
            raise click.ClickException(f"no active key with prefix {prefix!r}")
    click.echo(f"revoked {prefix}")
