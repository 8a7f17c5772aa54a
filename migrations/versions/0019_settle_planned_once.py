"""``kiln_settle`` parses its batch once, looks the batch's events up through their primary key,
and plans its statements once per session (``SET plan_cache_mode = force_generic_plan``).

Until now each call planned every statement again for the batch at hand (a custom plan: the
batch is a parameter), which cost more than running them, and the first statement found the
batch's events by scanning ``usage_events`` whenever the planner took the table for small
(``jsonb_populate_recordset`` is estimated at 100 rows). Same results, a fifth of the database
time per settlement (bench/RESULTS.md, "Settlement planned once"). Postgres only: SQLite settles
in Python (``gateway/ledger/sqlite.py``).

Downgrade puts back the function of 0018: the installed text with each hunk of this revision
replaced by what it was.

Revision ID: 0019
Revises: 0016
Create Date: 2026-12-07
"""
import re

import sqlalchemy as sa
from alembic import op

from gateway.ledger.postgres import SETTLE

revision = "0019"
down_revision = "0016"
branch_labels = None
depends_on = None

PARSED = "jsonb_populate_recordset(NULL::kiln_settlement, p_batch)"
# The hunks of this revision in the function's body (new, old).
HUNKS = (
    ("""  -- The batch, parsed once.
  v_rows kiln_settlement[] := ARRAY(SELECT x FROM jsonb_populate_recordset(
                                      NULL::kiln_settlement, p_batch) x);
  v_gids text[] := ARRAY(SELECT r.gid FROM unnest(v_rows) r);
""", ""),
    ("""     WHERE e.id = ANY(v_gids)
""", """     WHERE e.id IN (SELECT s.gid FROM jsonb_populate_recordset(NULL::kiln_settlement,
                                                                p_batch) s)
"""),
    ("unnest(v_rows)", PARSED),
)
GENERIC = re.compile(r"^ SET plan_cache_mode TO '?force_generic_plan'?\n", re.MULTILINE)


def upgrade():
    if op.get_bind().dialect.name == "postgresql":
        op.execute(SETTLE)


def downgrade():
    if op.get_bind().dialect.name != "postgresql":
        return
    installed = op.get_bind().execute(sa.text(
        "SELECT pg_get_functiondef('kiln_settle(jsonb)'::regprocedure)")).scalar_one()
    old, found = GENERIC.subn("", installed)
    for new, was in HUNKS:
        if new not in old or found != 1:
            raise RuntimeError("kiln_settle changed since 0019: write this downgrade again")
        old = old.replace(new, was)
    op.execute(old)
    op.execute("ALTER FUNCTION kiln_settle(jsonb) RESET plan_cache_mode")
