"""``kiln webhook``: an org's webhooks, added, listed and removed as an operator does in SQL
(docs/WEBHOOKS.md). Webhooks need Postgres: on SQLite the commands say so and write nothing.
"""
from decimal import Decimal

import click
import sqlalchemy as sa

from ..config import Config
from ..db import is_postgres
from ..ledger.outbox import EVENTS
from ..models import orgs, webhook_outbox, webhooks
from .cli_db import pass_ctx
from .cli_keys import MAX_LIMIT_USD, PLAIN_DECIMAL
from .webhooks import UnsafeURL, check_url, new_secret

MAX_URL_CHARS = 2000
LIST_COLUMNS = ("id", "org", "url", "events", "balance_below_usd", "allow_private", "pending",
                "delivered", "failed", "created_at")


class Webhooks(click.Group):
    """``kiln webhook``; ``find_org(engine, ref) -> org id`` resolves ORG_REF as every
    ``kiln`` command does."""

    def __init__(self, find_org):
        super().__init__("webhook", help="Webhooks: events of an org posted to a URL, signed "
                                         "(Standard Webhooks).")
        self.find_org = find_org
        for command in (webhook_add, webhook_list, webhook_remove):
            self.add_command(command)


def _find_org(ctx, ref):
    return click.get_current_context().parent.command.find_org(ctx.engine, ref)


def _postgres(ctx):
    if not is_postgres(ctx.engine):
        raise click.ClickException("webhooks need Postgres (KILN_DATABASE_URL): the outbox "
                                   "and its delivery are Postgres statements")


def parse_events(text):
    """Return the comma-separated event names of ``text`` as the column keeps them.

    :raises click.BadParameter: empty, or a name not in :data:`EVENTS`.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in EVENTS]
    if not names or unknown:
        raise click.BadParameter(f"{text!r}: events are a comma-separated list of "
                                 f"{', '.join(EVENTS)}", param_hint="--events")
    return ",".join(dict.fromkeys(names))


def parse_threshold(text):
    """Return ``text`` as the exact Decimal USD of a ``balance.low`` threshold.

    :raises click.BadParameter: not plain decimal notation, negative, finer than a nano-dollar
        or above the largest balance.
    """
    def refuse(why):
        return click.BadParameter(f"{text!r}: {why}", param_hint="--balance-below")
    if not PLAIN_DECIMAL.fullmatch(text):
        raise refuse("write the amount in plain decimal notation, e.g. 5.00")
    amount = Decimal(text)
    if amount < 0 or amount > MAX_LIMIT_USD[True]:
        raise refuse(f"a threshold is 0 to {MAX_LIMIT_USD[True]:f} USD")
    if amount != amount.quantize(Decimal("1e-9")):
        raise refuse("more than 9 decimal places (balances are kept in nano-dollars)")
    return amount


@click.command("add")
@click.argument("org_ref")
@click.argument("url")
@click.option("--events", "events_text", required=True,
              help=f"Comma-separated: {', '.join(EVENTS)}.")
@click.option("--balance-below", "threshold", default=None,
              help="balance.low: the balance in USD (exact decimal) that it goes below.")
@click.option("--allow-private", is_flag=True,
              help="Take a URL whose host is a private or loopback address.")
@pass_ctx
def webhook_add(ctx, org_ref, url, events_text, threshold, allow_private):
    """Add a webhook of ORG_REF posting to URL; print its id, then its secret as the last line
    (shown only this once)."""
    _postgres(ctx)
    events = parse_events(events_text)
    below = None if threshold is None else parse_threshold(threshold)
    if "balance.low" in events.split(",") and below is None:
        raise click.BadParameter("balance.low needs the threshold", param_hint="--balance-below")
    if len(url) > MAX_URL_CHARS:
        raise click.BadParameter(f"at most {MAX_URL_CHARS} characters", param_hint="URL")
    allow_private = allow_private or Config.from_mapping().webhook_allow_private
    try:
        check_url(url, allow_private)
    except UnsafeURL as err:
        raise click.BadParameter(str(err), param_hint="URL") from err
    org_id, secret = _find_org(ctx, org_ref), new_secret()
    with ctx.engine.begin() as conn:
        webhook_id = conn.execute(webhooks.insert().values(
            org_id=org_id, url=url, secret=secret, events=events, balance_below_usd=below,
            allow_private=allow_private).returning(webhooks.c.id)).scalar_one()
    click.echo(f"# webhook {webhook_id}; store the secret now, it is not shown again",
               err=True)
    click.echo(webhook_id)
    click.echo(secret)


@click.command("list")
@click.argument("org_ref", required=False)
@pass_ctx
def webhook_list(ctx, org_ref):
    """List the webhooks (of ORG_REF, or all) with their events' counts by status; never a
    secret."""
    _postgres(ctx)
    counts = {status: sa.func.count().filter(webhook_outbox.c.status == status)
              for status in ("pending", "delivered", "failed")}
    query = (sa.select(webhooks.c.id, orgs.c.name.label("org"), webhooks.c.url,
                       webhooks.c.events, webhooks.c.balance_below_usd,
                       webhooks.c.allow_private,
                       *(c.label(s) for s, c in counts.items()), webhooks.c.created_at)
             .join(orgs, orgs.c.id == webhooks.c.org_id)
             .outerjoin(webhook_outbox, webhook_outbox.c.webhook_id == webhooks.c.id)
             .group_by(webhooks.c.id, orgs.c.name).order_by(webhooks.c.id))
    if org_ref is not None:
        query = query.where(webhooks.c.org_id == _find_org(ctx, org_ref))
    with ctx.engine.connect() as conn:
        rows = conn.execute(query).mappings().all()
    lines = ["\t".join(LIST_COLUMNS)]
    lines += ["\t".join("-" if row[c] is None else str(row[c]) for c in LIST_COLUMNS)
              for row in rows]
    click.echo("\n".join(lines))


@click.command("remove")
@click.argument("webhook_id", type=click.IntRange(1, 2**31 - 1))
@pass_ctx
def webhook_remove(ctx, webhook_id):
    """Remove webhook WEBHOOK_ID, with its undelivered events and its delivery log."""
    _postgres(ctx)
    with ctx.engine.begin() as conn:
        if not conn.execute(webhooks.delete().where(webhooks.c.id == webhook_id)).rowcount:
            raise click.ClickException(f"no webhook with id {webhook_id}")
    click.echo(f"removed webhook {webhook_id}")
