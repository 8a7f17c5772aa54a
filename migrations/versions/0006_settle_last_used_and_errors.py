"""``kiln_settle`` no longer writes ``api_keys.last_used_at``; a client's cancellation is not an
error in the activity rollup.

- ``last_used_at``: the key check writes it now (``gateway/auth.py``), at most once per key per
  minute in each worker, also for requests refused at admission and for calls other than chat
  completions; the settlement's write was redundant.
- ``usage_daily.errors`` counts the generations that failed (docs/ACTIVITY.md, "What a row
  counts"), no longer those the client cancelled: each row loses the ``client_cancelled``
  events it counted.

Postgres: installs the new ``kiln_settle`` (``gateway/ledger/postgres.py``); SQLite's ledger is
Python. Downgrade installs the previous function again and counts the cancellations back.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""
import sqlalchemy as sa
from alembic import op

from gateway.ledger.postgres import SETTLE

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# The previous kiln_settle differed by these two hunks.
CHANGES = (("                  held_nanos = k.held_nanos - t.key_hold\n",
            """                  held_nanos = k.held_nanos - t.key_hold,
                  last_used_at = CASE WHEN k.last_used_at IS NULL
                                        OR k.last_used_at < v_now - interval '1 minute'
                                      THEN v_now ELSE k.last_used_at END
"""),
           ("""                   SUM(CASE WHEN d.status NOT IN ('completed', 'client_cancelled')
                            THEN 1 ELSE 0 END
""", "                   SUM(CASE WHEN d.status <> 'completed' THEN 1 ELSE 0 END\n"))
CANCELLED = """UPDATE usage_daily SET errors = errors {sign} (
  SELECT count(*) FROM usage_events e
   WHERE e.status = 'client_cancelled' AND e.org_id = usage_daily.org_id
     AND e.model = usage_daily.model AND e.api_key_id = usage_daily.api_key_id
     AND {day} = usage_daily.day)"""


def _day():
    """The UTC day of ``e.started_at``, as settlement writes ``usage_daily.day`` (SQLite keeps
    both as text; a CAST to DATE there would make a number of it)."""
    if op.get_bind().dialect.name == "postgresql":
        return "CAST(e.started_at AT TIME ZONE 'UTC' AS DATE)"
    return "substr(e.started_at, 1, 10)"


def upgrade():
    if op.get_bind().dialect.name == "postgresql":
        op.execute(SETTLE)
    op.execute(CANCELLED.format(sign="-", day=_day()))


def downgrade():
    if op.get_bind().dialect.name == "postgresql":
        # The installed function, as later revisions' downgrades left it, not this code's.
        previous = op.get_bind().execute(sa.text(
            "SELECT pg_get_functiondef('kiln_settle(jsonb)'::regprocedure)")).scalar_one()
        for new, old in CHANGES:
            if previous.count(new) != 1:
                raise RuntimeError("kiln_settle changed since 0006: write this downgrade again")
            previous = previous.replace(new, old)
        op.execute(previous)
    op.execute(CANCELLED.format(sign="+", day=_day()))
