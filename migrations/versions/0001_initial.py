"""Initial schema: orgs, keys, credits (balance trigger), usage events, in-flight leases.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
NOW = sa.func.current_timestamp()

PG_TRIGGERS = [
    """CREATE FUNCTION kiln_open_balance() RETURNS trigger AS $$
       BEGIN INSERT INTO credit_balances (org_id) VALUES (NEW.id); RETURN NEW; END
       $$ LANGUAGE plpgsql""",
    """CREATE TRIGGER orgs_open_balance AFTER INSERT ON orgs
       FOR EACH ROW EXECUTE FUNCTION kiln_open_balance()""",
    """CREATE FUNCTION kiln_apply_grant() RETURNS trigger AS $$
       BEGIN
         UPDATE credit_balances
            SET balance_nanos = balance_nanos + CAST(ROUND(NEW.amount_usd * 1000000000) AS BIGINT)
          WHERE org_id = NEW.org_id;
         RETURN NEW;
       END $$ LANGUAGE plpgsql""",
    """CREATE TRIGGER credit_grants_apply AFTER INSERT ON credit_grants
       FOR EACH ROW EXECUTE FUNCTION kiln_apply_grant()""",
    """CREATE FUNCTION kiln_grants_append_only() RETURNS trigger AS $$
       BEGIN RAISE EXCEPTION 'credit_grants is append-only: insert a negative grant to correct';
       END $$ LANGUAGE plpgsql""",
    """CREATE TRIGGER credit_grants_append_only BEFORE UPDATE OR DELETE ON credit_grants
       FOR EACH ROW EXECUTE FUNCTION kiln_grants_append_only()""",
]
PG_DROP = [
    "DROP TRIGGER IF EXISTS credit_grants_append_only ON credit_grants",
    "DROP TRIGGER IF EXISTS credit_grants_apply ON credit_grants",
    "DROP TRIGGER IF EXISTS orgs_open_balance ON orgs",
    "DROP FUNCTION IF EXISTS kiln_grants_append_only()",
    "DROP FUNCTION IF EXISTS kiln_apply_grant()",
    "DROP FUNCTION IF EXISTS kiln_open_balance()",
]
SQLITE_TRIGGERS = [
    """CREATE TRIGGER orgs_open_balance AFTER INSERT ON orgs
       BEGIN INSERT INTO credit_balances (org_id) VALUES (NEW.id); END""",
    """CREATE TRIGGER credit_grants_apply AFTER INSERT ON credit_grants
       BEGIN
         UPDATE credit_balances
            SET balance_nanos = balance_nanos + CAST(ROUND(NEW.amount_usd * 1000000000) AS INTEGER)
          WHERE org_id = NEW.org_id;
       END""",
    """CREATE TRIGGER credit_grants_no_update BEFORE UPDATE ON credit_grants
       BEGIN SELECT RAISE(ABORT, 'credit_grants is append-only: insert a negative grant'); END""",
    """CREATE TRIGGER credit_grants_no_delete BEFORE DELETE ON credit_grants
       BEGIN SELECT RAISE(ABORT, 'credit_grants is append-only: insert a negative grant'); END""",
]
SQLITE_DROP = [
    "DROP TRIGGER IF EXISTS credit_grants_no_delete",
    "DROP TRIGGER IF EXISTS credit_grants_no_update",
    "DROP TRIGGER IF EXISTS credit_grants_apply",
    "DROP TRIGGER IF EXISTS orgs_open_balance",
]
# Read-only view in USD for operators' SQL.
CREDITS_VIEW = """CREATE VIEW org_credits AS
  SELECT o.id AS org_id, o.name, o.status,
         CAST(b.balance_nanos AS NUMERIC(20, 9)) / 1000000000 AS balance_usd,
         CAST(b.held_nanos AS NUMERIC(20, 9)) / 1000000000 AS held_usd,
         CAST(b.balance_nanos - b.held_nanos AS NUMERIC(20, 9)) / 1000000000 AS available_usd,
         b.in_flight
    FROM orgs o JOIN credit_balances b ON b.org_id = o.id"""


def upgrade():
    op.create_table(
        "orgs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("status", sa.String(16), nullable=False, server_default="active"),
        sa.Column("in_flight_limit", sa.Integer, nullable=True),
        sa.Column("created_at", TS, nullable=False, server_default=NOW),
        sa.CheckConstraint("status IN ('active', 'suspended')", name="ck_orgs_status"),
        sa.UniqueConstraint("name", name="uq_orgs_name"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("org_id", sa.Integer, sa.ForeignKey("orgs.id", name="fk_api_keys_org_id_orgs"),
                  nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=True),
        sa.Column("allowed_models", sa.Text, nullable=True),
        sa.Column("created_at", TS, nullable=False, server_default=NOW),
        sa.Column("revoked_at", TS, nullable=True),
        sa.Column("last_used_at", TS, nullable=True),
        sa.UniqueConstraint("prefix", name="uq_api_keys_prefix"),
        sa.UniqueConstraint("key_hash", name="uq_api_keys_key_hash"),
    )
    op.create_index("ix_api_keys_org_id", "api_keys", ["org_id"])
    op.create_table(
        "credit_balances",
        sa.Column("org_id", sa.Integer,
                  sa.ForeignKey("orgs.id", name="fk_credit_balances_org_id_orgs"),
                  primary_key=True),
        sa.Column("balance_nanos", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("held_nanos", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("in_flight", sa.Integer, nullable=False, server_default="0"),
        sa.CheckConstraint("balance_nanos >= 0", name="ck_credit_balances_balance_not_negative"),
    )
    op.create_table(
        "credit_grants",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("org_id", sa.Integer,
                  sa.ForeignKey("orgs.id", name="fk_credit_grants_org_id_orgs"), nullable=False),
        sa.Column("amount_usd", sa.Numeric(20, 9), nullable=False),
        sa.Column("note", sa.Text, nullable=True),
        sa.Column("created_at", TS, nullable=False, server_default=NOW),
    )
    op.create_index("ix_credit_grants_org_id", "credit_grants", ["org_id"])
    op.create_table(
        "usage_events",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("org_id", sa.Integer,
                  sa.ForeignKey("orgs.id", name="fk_usage_events_org_id_orgs"), nullable=False),
        sa.Column("api_key_id", sa.Integer,
                  sa.ForeignKey("api_keys.id", name="fk_usage_events_api_key_id_api_keys"),
                  nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("backend", sa.String(500), nullable=True),
        sa.Column("stream", sa.Boolean, nullable=False),
        sa.Column("status", sa.String(24), nullable=False, server_default="pending"),
        sa.Column("prompt_tokens", sa.Integer, nullable=False, server_default="0"),
        sa.Column("cached_tokens", sa.Integer, nullable=False, server_default="0"),
        sa.Column("completion_tokens", sa.Integer, nullable=False, server_default="0"),
        sa.Column("cost_nanos", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("hold_nanos", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("estimated", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("http_status", sa.Integer, nullable=True),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("first_token_at", TS, nullable=True),
        sa.Column("ended_at", TS, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
    )
    op.create_index("ix_usage_events_org_started", "usage_events", ["org_id", "started_at"])
    op.create_table(
        "in_flight",
        sa.Column("generation_id", sa.String(40),
                  sa.ForeignKey("usage_events.id", name="fk_in_flight_generation_id_usage_events"),
                  primary_key=True),
        sa.Column("org_id", sa.Integer,
                  sa.ForeignKey("orgs.id", name="fk_in_flight_org_id_orgs"), nullable=False),
        sa.Column("hold_nanos", sa.BigInteger, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
    )
    op.create_index("ix_in_flight_org_expires", "in_flight", ["org_id", "expires_at"])
    op.create_table(
        "maintenance",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("enabled", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("retry_after_s", sa.Integer, nullable=False, server_default="300"),
        sa.Column("message", sa.Text, nullable=True),
        sa.Column("updated_at", TS, nullable=False, server_default=NOW),
    )
    triggers = PG_TRIGGERS if op.get_bind().dialect.name == "postgresql" else SQLITE_TRIGGERS
    for statement in triggers + [CREDITS_VIEW]:
        op.execute(statement)


def downgrade():
    op.execute("DROP VIEW IF EXISTS org_credits")
    drops = PG_DROP if op.get_bind().dialect.name == "postgresql" else SQLITE_DROP
    for statement in drops:
        op.execute(statement)
    for table in ("maintenance", "in_flight", "usage_events", "credit_grants",
                  "credit_balances", "api_keys", "orgs"):
        op.drop_table(table)
