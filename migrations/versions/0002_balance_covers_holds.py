"""Credits: a balance never goes below the holds of requests in flight.

A negative grant (a correction typed in psql) larger than the available credits would leave
``balance_nanos < held_nanos``: the running requests' settlements would then take the balance
below zero, fail the ``balance_not_negative`` check, and leave their leases to the sweeper,
which would fail the same way. Such a grant is refused instead, with a message that says why.

Postgres: a CHECK on ``credit_balances`` and a grant trigger function that checks first (under
the row lock) for a clear message. SQLite: the same two rules as triggers (adding a CHECK there
means rebuilding the table).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

PG_APPLY_GRANT = """CREATE OR REPLACE FUNCTION kiln_apply_grant() RETURNS trigger AS $$
  DECLARE
    amount BIGINT := CAST(ROUND(NEW.amount_usd * 1000000000) AS BIGINT);
    balance BIGINT;
    held BIGINT;
  BEGIN
    SELECT balance_nanos, held_nanos INTO balance, held
      FROM credit_balances WHERE org_id = NEW.org_id FOR UPDATE;
    IF balance + amount < held THEN
      RAISE EXCEPTION 'credit grant of % USD refused: org % has % USD available '
                      '(balance % USD minus % USD held by requests in flight)',
            trim_scale(NEW.amount_usd), NEW.org_id, trim_scale((balance - held) / 1e9::numeric),
            trim_scale(balance / 1e9::numeric), trim_scale(held / 1e9::numeric)
            USING ERRCODE = 'check_violation';
    END IF;
    UPDATE credit_balances SET balance_nanos = balance_nanos + amount
     WHERE org_id = NEW.org_id;
    RETURN NEW;
  END $$ LANGUAGE plpgsql"""
# 0001's function, restored on downgrade.
PG_APPLY_GRANT_0001 = """CREATE OR REPLACE FUNCTION kiln_apply_grant() RETURNS trigger AS $$
       BEGIN
         UPDATE credit_balances
            SET balance_nanos = balance_nanos + CAST(ROUND(NEW.amount_usd * 1000000000) AS BIGINT)
          WHERE org_id = NEW.org_id;
         RETURN NEW;
       END $$ LANGUAGE plpgsql"""
PG_CHECK = ("ALTER TABLE credit_balances ADD CONSTRAINT ck_credit_balances_balance_covers_holds "
            "CHECK (balance_nanos >= held_nanos)")
PG_UNCHECK = ("ALTER TABLE credit_balances "
              "DROP CONSTRAINT IF EXISTS ck_credit_balances_balance_covers_holds")

GRANT_REFUSED = "credit grant refused: the balance would fall below the holds in flight"
BALANCE_REFUSED = "credit_balances: the balance may not fall below the open holds"
SQLITE_TRIGGERS = [
    f"""CREATE TRIGGER credit_grants_cover_holds BEFORE INSERT ON credit_grants
       WHEN (SELECT balance_nanos - held_nanos FROM credit_balances WHERE org_id = NEW.org_id)
            + CAST(ROUND(NEW.amount_usd * 1000000000) AS INTEGER) < 0
       BEGIN SELECT RAISE(ABORT, '{GRANT_REFUSED}'); END""",
    f"""CREATE TRIGGER credit_balances_cover_holds BEFORE UPDATE ON credit_balances
       WHEN NEW.balance_nanos < NEW.held_nanos
       BEGIN SELECT RAISE(ABORT, '{BALANCE_REFUSED}'); END""",
]
SQLITE_DROP = ["DROP TRIGGER IF EXISTS credit_balances_cover_holds",
               "DROP TRIGGER IF EXISTS credit_grants_cover_holds"]


def upgrade():
    if op.get_bind().dialect.name == "postgresql":
        statements = [PG_CHECK, PG_APPLY_GRANT]
    else:
        statements = SQLITE_TRIGGERS
    for statement in statements:
        op.execute(statement)


def downgrade():
    if op.get_bind().dialect.name == "postgresql":
        statements = [PG_APPLY_GRANT_0001, PG_UNCHECK]
    else:
        statements = SQLITE_DROP
    for statement in statements:
        op.execute(statement)
