"""The org_credits view in exact USD on SQLite too.

SQLite divides two integers as integers: ``CAST(n AS NUMERIC(20, 9)) / 1000000000`` showed
whole dollars there (4 for 4.9985115). On SQLite the view now writes each amount as exact
decimal text from the integer nano-dollars; on Postgres it is unchanged (NUMERIC division).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def _usd(nanos):
    """SQLite: exact decimal text of an integer nano-dollar expression (at most 9 places)."""
    return (f"printf('%s%d.%09d', CASE WHEN {nanos} < 0 THEN '-' ELSE '' END, "
            f"abs({nanos}) / 1000000000, abs({nanos}) % 1000000000)")


EXACT_VIEW = f"""CREATE VIEW org_credits AS
  SELECT o.id AS org_id, o.name, o.status,
         {_usd("b.balance_nanos")} AS balance_usd,
         {_usd("b.held_nanos")} AS held_usd,
         {_usd("(b.balance_nanos - b.held_nanos)")} AS available_usd,
         b.in_flight
    FROM orgs o JOIN credit_balances b ON b.org_id = o.id"""


def upgrade():
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP VIEW IF EXISTS org_credits")
        op.execute(EXACT_VIEW)


def downgrade():
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP VIEW IF EXISTS org_credits")
        op.execute(_INITIAL_VIEW)


# The view as migration 0001 created it (restored on downgrade).
_INITIAL_VIEW = """CREATE VIEW org_credits AS
  SELECT o.id AS org_id, o.name, o.status,
         CAST(b.balance_nanos AS NUMERIC(20, 9)) / 1000000000 AS balance_usd,
         CAST(b.held_nanos AS NUMERIC(20, 9)) / 1000000000 AS held_usd,
         CAST(b.balance_nanos - b.held_nanos AS NUMERIC(20, 9)) / 1000000000 AS available_usd,
         b.in_flight
    FROM orgs o JOIN credit_balances b ON b.org_id = o.id"""
