"""A credit grant is a number of at least one nano-dollar, whatever client inserts it: the
database refuses the rest (README "Administration"), as the ``kiln credits grant`` command does.

SQLite's NUMERIC affinity keeps text that is not a number as text (``'12abc'``), which the
balance trigger's CAST then read as 12; and on both databases an amount below half a
nano-dollar (``1e-10``) was a zero grant. Postgres: ``CHECK (amount_usd <> 0)`` on the column
rounded to 9 places (text that is not a number never reaches it); ``NOT VALID``, so that a
past zero grant does not stop the upgrade and no full scan holds the table. SQLite: a trigger
before each insert.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

REFUSED = "credit grant refused: amount_usd must be a number of at least one nano-dollar"
PG_CHECK = ("ALTER TABLE credit_grants ADD CONSTRAINT ck_credit_grants_amount_not_zero "
            "CHECK (amount_usd <> 0) NOT VALID")
PG_UNCHECK = "ALTER TABLE credit_grants DROP CONSTRAINT IF EXISTS ck_credit_grants_amount_not_zero"
SQLITE_TRIGGER = f"""CREATE TRIGGER credit_grants_are_amounts BEFORE INSERT ON credit_grants
       WHEN typeof(NEW.amount_usd) NOT IN ('integer', 'real')
            OR CAST(ROUND(NEW.amount_usd * 1000000000) AS INTEGER) = 0
       BEGIN SELECT RAISE(ABORT, '{REFUSED}'); END"""
SQLITE_DROP = "DROP TRIGGER IF EXISTS credit_grants_are_amounts"


def upgrade():
    if op.get_bind().dialect.name == "postgresql":
        op.execute(PG_CHECK)  # a moment's lock, or tried again (migrations/env.py)
    else:
        op.execute(SQLITE_TRIGGER)


def downgrade():
    op.execute(PG_UNCHECK if op.get_bind().dialect.name == "postgresql" else SQLITE_DROP)
