"""What ``kiln key`` (:mod:`gateway.ops.cli`) needs beyond the other commands: spend-limit amounts,
the limit options, what ``kiln key set`` changes, and the lines of ``kiln key list``.

A key's spend limit is an exact decimal of USD (like credit amounts: plain notation, at most 9
decimal places; 0 allowed, which stops the key from spending), optionally reset each UTC day,
ISO week or month; its rate is requests per UTC minute. Changes reach every gateway worker
within ``KILN_KEY_CACHE_TTL_S``.
"""
import re
from decimal import Decimal

import click

from ..ledger.keys import RESETS, key_view

# Admission compares the limit in BIGINT nano-dollars; SQLite's NUMERIC is a binary float,
# exact to 15 significant digits (see ``kiln credits grant``).
MAX_LIMIT_USD = {True: Decimal(2**63 - 1).scaleb(-9), False: Decimal("999999.999999999")}
# A count or a number of seconds the CLI writes to an INTEGER column (Postgres: 32 bits):
# a larger value is refused with the range, not stored out of range or crashed on.
POSITIVE_INTEGER = click.IntRange(1, 2**31 - 1)
# Plain decimal notation, as ``kiln credits grant`` takes it: no exponent, NaN or Infinity.
PLAIN_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
LIST_COLUMNS = ("prefix", "label", "limit_usd", "limit_reset", "usage_usd", "remaining_usd",
                "rpm", "created_at", "last_used_at", "status")


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
            click.option("--rpm", type=POSITIVE_INTEGER, default=None,
                         help="Requests per minute."))):
        command = option(command)
    return command


def limit_changes(limit_text, reset, rpm, no_limit, no_rpm, postgres, org_read=None,
                  in_flight=None, no_in_flight=False):
    """Return the ``api_keys`` values ``kiln key set`` changes (None clears one; ``org_read``
    None leaves it).

    :raises click.UsageError: nothing to change, or a value given with its ``--no-`` flag.
    """
    if limit_text is not None and no_limit or rpm is not None and no_rpm \
            or in_flight is not None and no_in_flight:
        raise click.UsageError("give either a value or its --no- flag, not both")
    changes = {}
    if limit_text is not None or no_limit:
        changes["limit_usd"] = None if no_limit else parse_limit_usd(limit_text, postgres)
    if reset is not None:
        changes["limit_reset"] = None if reset == "never" else reset
    if rpm is not None or no_rpm:
        changes["rpm_limit"] = None if no_rpm else rpm
    if in_flight is not None or no_in_flight:
        changes["in_flight_limit"] = None if no_in_flight else in_flight
    if org_read is not None:
        changes["org_read"] = org_read
    if not changes:
        raise click.UsageError("nothing to change: give --limit, --reset, --rpm, --in-flight, "
                               "--no-limit, --no-rpm, --no-in-flight or "
                               "--org-read/--no-org-read")
    return changes


def list_line(row, now):
    """Return the ``kiln key list`` line of an ``api_keys`` row (tab-separated, '-' for none)."""
    view = {**key_view(row, now), "rpm": row.rpm_limit,
            "status": "revoked" if row.revoked_at is not None else "active"}
    return "\t".join("-" if view[c] is None else str(view[c]) for c in LIST_COLUMNS)
