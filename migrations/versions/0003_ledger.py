"""The ledger's functions; key limits and request rates; the daily activity rollup.

- Postgres: ``kiln_admit``, ``kiln_settle``, ``kiln_renew`` and ``kiln_period_start``
  (``gateway/ledger/postgres.py`` holds their text; a later change to them comes with a
  migration that installs them again).
- ``api_keys``: optional spend limit (USD) with its reset period, request rate per minute, and
  the current period's spend and holds; ``in_flight.key_hold_nanos``.
- ``usage_events``: ``error_code``, ``attempts`` (backends tried), ``anomaly``.
- ``usage_daily``: per org, UTC day, model and key; backfilled from the settled events, and each
  key's spend from its events, so that reconciliation holds on an existing database.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""
import sqlalchemy as sa
from alembic import op

from gateway.ledger.postgres import DROP, FUNCTIONS, SETTLEMENT_TYPE

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
KEY_CHECKS = {"limit_reset": "limit_reset IN ('daily', 'weekly', 'monthly')",
              "limit_not_negative": "limit_usd >= 0", "rpm_positive": "rpm_limit > 0"}
BACKFILL_DAILY = """INSERT INTO usage_daily (org_id, day, model, api_key_id, requests, errors,
                                         prompt_tokens, cached_tokens, completion_tokens,
                                         cost_nanos)
SELECT org_id, {day}, model, api_key_id, COUNT(*),
       SUM(CASE WHEN status <> 'completed' THEN 1 ELSE 0 END), SUM(prompt_tokens),
       SUM(cached_tokens), SUM(completion_tokens), SUM(cost_nanos)
  FROM usage_events WHERE status <> 'pending'
 GROUP BY org_id, {day}, model, api_key_id"""
BACKFILL_KEYS = """UPDATE api_keys SET period_spent_nanos = COALESCE((
  SELECT SUM(cost_nanos) FROM usage_events e
   WHERE e.api_key_id = api_keys.id AND e.status <> 'pending'), 0)"""


def upgrade():
    postgres = op.get_bind().dialect.name == "postgresql"
    for column in (sa.Column("limit_usd", sa.Numeric(20, 9), nullable=True),
                   sa.Column("limit_reset", sa.String(8), nullable=True),
                   sa.Column("period_start", TS, nullable=True),
                   sa.Column("period_spent_nanos", sa.BigInteger, nullable=False,
                             server_default="0"),
                   sa.Column("held_nanos", sa.BigInteger, nullable=False, server_default="0"),
                   sa.Column("rpm_limit", sa.Integer, nullable=True),
                   sa.Column("rate_window", TS, nullable=True),
                   sa.Column("rate_count", sa.Integer, nullable=False, server_default="0")):
        op.add_column("api_keys", column)
    op.add_column("in_flight", sa.Column("key_hold_nanos", sa.BigInteger, nullable=False,
                                         server_default="0"))
    for column in (sa.Column("error_code", sa.String(64), nullable=True),
                   sa.Column("attempts", sa.Text, nullable=True),
                   sa.Column("anomaly", sa.Boolean, nullable=False, server_default=sa.false())):
        op.add_column("usage_events", column)
    op.create_table(
        "usage_daily",
        sa.Column("org_id", sa.Integer,
                  sa.ForeignKey("orgs.id", name="fk_usage_daily_org_id_orgs"), nullable=False),
        sa.Column("day", sa.Date, nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("api_key_id", sa.Integer,
                  sa.ForeignKey("api_keys.id", name="fk_usage_daily_api_key_id_api_keys"),
                  nullable=False),
        *(sa.Column(name, sa.BigInteger, nullable=False, server_default="0")
          for name in ("requests", "errors", "prompt_tokens", "cached_tokens",
                       "completion_tokens", "cost_nanos")),
        sa.PrimaryKeyConstraint("org_id", "day", "model", "api_key_id", name="pk_usage_daily"),
    )
    # SQLite keeps dates as text; a CAST to DATE there makes a number of one (0008 repairs it).
    op.execute(BACKFILL_DAILY.format(day="CAST(started_at AT TIME ZONE 'UTC' AS DATE)"
                                     if postgres else "substr(started_at, 1, 10)"))
    op.execute(BACKFILL_KEYS)
    if postgres:
        for name, condition in KEY_CHECKS.items():
            op.create_check_constraint(op.f(f"ck_api_keys_{name}"), "api_keys", condition)
        op.execute(SETTLEMENT_TYPE)
        for statement in FUNCTIONS:
            op.execute(statement)


def downgrade():
    if op.get_bind().dialect.name == "postgresql":
        for statement in DROP:
            op.execute(statement)
        for name in KEY_CHECKS:
            op.drop_constraint(op.f(f"ck_api_keys_{name}"), "api_keys", type_="check")
    op.drop_table("usage_daily")
    for table, columns in (("usage_events", ("anomaly", "attempts", "error_code")),
                           ("in_flight", ("key_hold_nanos",)),
                           ("api_keys", ("rate_count", "rate_window", "rpm_limit", "held_nanos",
                                         "period_spent_nanos", "period_start", "limit_reset",
                                         "limit_usd"))):
        with op.batch_alter_table(table) as batch:
            for column in columns:
                batch.drop_column(column)
