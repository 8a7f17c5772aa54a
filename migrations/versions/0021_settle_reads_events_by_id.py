"""``kiln_settle`` reads the batch's events through their key in a query of their own
(``MATERIALIZED``, with ``e.id = ANY(v_ids)``), apart from the balance and key rows.

In 0020 the events were joined in one query with the orgs' balance rows, and the plan made for it
(once per session, 0019) could reach them through the org: ``ix_usage_events_org_started_id``,
every event the org ever had, filtered down to the batch's. The planner chose that path whenever
``credit_balances``' statistics were fresher than ``usage_events``' (a vacuum of the balance
table, which autovacuum runs often on so hot a table, while the events table had grown since its
last analyze): a settlement then read thousands of rows for one (7 ms instead of 0.8 on a
benchmark database of 4,500 events of one org), and more with every event the org made. Same
results. Postgres only: SQLite settles in Python.

Downgrade puts back the function of 0020: the installed text with each hunk of this revision
replaced by what it was.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-07
"""
import sqlalchemy as sa
from alembic import op

from gateway.ledger.postgres import SETTLE

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

# The hunks of this revision in the function's body (new, old).
HUNKS = (
    ("""  -- The events, read apart (MATERIALIZED) through their key: joined in one query with the
  -- balance rows, a plan could reach them through the org (every event the org ever had) once
  -- the balance table's statistics were fresher than usage_events' (migration 0021).
  j AS MATERIALIZED (
        SELECT s.*,""",
     """  j AS (SELECT s.*,"""),
    ("""          FROM s JOIN usage_events e ON e.id = s.gid AND e.id = ANY(v_ids)
          LEFT JOIN lease l""",
     """          FROM s JOIN usage_events e ON e.id = s.gid
          LEFT JOIN lease l"""),
)


def upgrade():
    if op.get_bind().dialect.name == "postgresql":
        op.execute(SETTLE)


def downgrade():
    if op.get_bind().dialect.name != "postgresql":
        return
    old = op.get_bind().execute(sa.text(
        "SELECT pg_get_functiondef('kiln_settle(jsonb)'::regprocedure)")).scalar_one()
    for new, was in HUNKS:
        if old.count(new) != 1:
            raise RuntimeError("kiln_settle changed since 0021: write this downgrade again")
        old = old.replace(new, was)
    op.execute(old)
