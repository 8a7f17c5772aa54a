"""A cost above its hold is debited only as far as the key's spend limit allows, as the org's
balance already bounded it: a key's limit is a cap (README "Administration", docs/METERING.md).

Postgres: installs the new ``kiln_settle`` (``gateway/ledger/postgres.py``); SQLite's ledger is
Python. Downgrade puts back the installed function without this change.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""
import sqlalchemy as sa
from alembic import op

from gateway.ledger.postgres import SETTLE

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

# The function before this revision differed by this hunk (new, old).
CHANGE = ("""  d AS (SELECT j.*, CAST(LEAST(j.cost, j.base + GREATEST(0, LEAST(
                   b.balance_nanos - b.held_nanos
                   - (SUM(GREATEST(j.cost - j.base, 0)) OVER w - GREATEST(j.cost - j.base, 0)),
                   -- and what the key's spend limit leaves (NULL, so ignored, with no limit)
                   CAST(ROUND(k.limit_usd * 1000000000) AS bigint) - k.held_nanos
                   - CASE WHEN k.period_start IS DISTINCT FROM
                               kiln_period_start(k.limit_reset, v_now)
                          THEN 0 ELSE k.period_spent_nanos END
                   - (SUM(GREATEST(j.cost - j.base, 0)) OVER wk
                      - GREATEST(j.cost - j.base, 0))))) AS bigint) AS debit
          FROM j JOIN credit_balances b ON b.org_id = j.org_id
          LEFT JOIN api_keys k ON k.id = j.api_key_id
        WINDOW w AS (PARTITION BY j.org_id ORDER BY j.gid),
               wk AS (PARTITION BY j.api_key_id ORDER BY j.gid)),
""", """  d AS (SELECT j.*, CAST(LEAST(j.cost, j.base + GREATEST(0, b.balance_nanos - b.held_nanos
                   - (SUM(GREATEST(j.cost - j.base, 0)) OVER w
                      - GREATEST(j.cost - j.base, 0)))) AS bigint) AS debit
          FROM j JOIN credit_balances b ON b.org_id = j.org_id
        WINDOW w AS (PARTITION BY j.org_id ORDER BY j.gid)),
""")


def upgrade():
    if op.get_bind().dialect.name == "postgresql":
        op.execute(SETTLE)


def downgrade():
    if op.get_bind().dialect.name == "postgresql":
        installed = op.get_bind().execute(sa.text(
            "SELECT pg_get_functiondef('kiln_settle(jsonb)'::regprocedure)")).scalar_one()
        new, old = CHANGE
        if installed.count(new) != 1:
            raise RuntimeError("kiln_settle changed since 0007: write this downgrade again")
        op.execute(installed.replace(new, old))
