"""SQLite: rebuild ``usage_daily`` when 0003's backfill stored a day as a number.

0003 as first released cast each backfilled day to DATE, which SQLite's affinity turns into a
number (``CAST('2026-11-30' AS DATE)`` is 2026), so a database with settled events before 0003
got rows the activity API and page cannot place, one per year instead of one per day. The rollup
is a sum over the settled usage events (docs/ACTIVITY.md, "What a row counts"), so it is rebuilt
from them, exactly as settlement writes it, where any such row exists; a database without one,
and Postgres, are left as they are.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""
import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

REBUILD = """INSERT INTO usage_daily (org_id, day, model, api_key_id, requests, errors,
                                   prompt_tokens, cached_tokens, completion_tokens, cost_nanos)
SELECT org_id, substr(started_at, 1, 10), model, api_key_id, COUNT(*),
       SUM(CASE WHEN status NOT IN ('completed', 'client_cancelled') THEN 1 ELSE 0 END),
       SUM(prompt_tokens), SUM(cached_tokens), SUM(completion_tokens), SUM(cost_nanos)
  FROM usage_events WHERE status <> 'pending'
 GROUP BY org_id, substr(started_at, 1, 10), model, api_key_id"""


def upgrade():
    conn = op.get_bind()
    if conn.dialect.name != "sqlite":
        return
    if conn.execute(sa.text("SELECT 1 FROM usage_daily WHERE typeof(day) <> 'text' LIMIT 1"))\
            .first() is None:
        return
    op.execute("DELETE FROM usage_daily")
    op.execute(REBUILD)


def downgrade():
    """Nothing to undo: the rebuilt rows are what settlement would have written."""
