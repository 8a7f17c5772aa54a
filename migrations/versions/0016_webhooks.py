"""Webhooks: per org, a URL, its secret and the events it wants; the outbox the events are
written to in the transaction of what caused them; the log of each delivery attempt
(docs/WEBHOOKS.md).

Postgres: the functions and triggers of ``gateway/ledger/outbox.py`` (``balance.low`` on
``credit_balances``, ``key.limit_reached`` on ``api_keys``; both fire only on the row updates
they watch and write nothing when no webhook wants the event) and a generated secret for an
``INSERT`` that gives none. SQLite: the tables alone (webhooks need Postgres).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-02
"""
import sqlalchemy as sa
from alembic import op

from gateway.ledger import outbox

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
BIG_ID = sa.BigInteger().with_variant(sa.Integer, "sqlite")


def upgrade():
    postgres = op.get_bind().dialect.name == "postgresql"
    op.create_table(
        "webhooks",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("org_id", sa.Integer, sa.ForeignKey("orgs.id"), nullable=False, index=True),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("secret", sa.String(120), nullable=False),
        sa.Column("events", sa.Text, nullable=False),
        sa.Column("balance_below_usd", sa.Numeric(20, 9, asdecimal=True), nullable=True),
        sa.Column("allow_private", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("created_at", TS, nullable=False,
                  server_default=sa.func.current_timestamp()),
        sa.CheckConstraint("balance_below_usd >= 0", name="threshold_not_negative"))
    op.create_table(
        "webhook_outbox",
        sa.Column("id", BIG_ID, primary_key=True),
        sa.Column("webhook_id", sa.Integer, sa.ForeignKey("webhooks.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("event_type", sa.String(40), nullable=False),
        sa.Column("dedup_key", sa.String(200), nullable=True),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("status", sa.String(16), nullable=False, server_default="pending"),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("next_attempt_at", TS, nullable=False,
                  server_default=sa.func.current_timestamp()),
        sa.Column("created_at", TS, nullable=False,
                  server_default=sa.func.current_timestamp()),
        sa.Column("finished_at", TS, nullable=True),
        sa.CheckConstraint("status IN ('pending', 'delivered', 'failed')", name="status"),
        sa.UniqueConstraint("webhook_id", "dedup_key", name="uq_webhook_outbox_dedup"),
        sa.Index("ix_webhook_outbox_due", "status", "next_attempt_at"))
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", BIG_ID, primary_key=True),
        sa.Column("outbox_id", sa.BigInteger,
                  sa.ForeignKey("webhook_outbox.id", ondelete="CASCADE"), nullable=False,
                  index=True),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("at", TS, nullable=False, server_default=sa.func.current_timestamp()),
        sa.Column("status_code", sa.Integer, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("duration_ms", sa.Integer, nullable=True),
        sa.Column("deliverer", sa.String(200), nullable=True))
    if postgres:
        for statement in outbox.FUNCTIONS + outbox.TRIGGERS:
            op.execute(statement)
        op.execute("ALTER TABLE webhooks ALTER COLUMN secret SET DEFAULT kiln_webhook_secret()")


def downgrade():
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE webhooks ALTER COLUMN secret DROP DEFAULT")
        for statement in outbox.DROP:
            op.execute(statement)
    op.drop_table("webhook_deliveries")
    op.drop_table("webhook_outbox")
    op.drop_table("webhooks")
