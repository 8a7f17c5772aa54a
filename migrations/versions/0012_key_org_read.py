"""A key reads its org's other keys and org-wide activity only with ``org_read``: on for the
keys the operator creates plainly, off for those created with a model allow-list or a spend
limit (restricted keys, given to an app or a bot), and settable (README "Administration").

The column's constant default is a change of the catalog only (Postgres 11 and later, SQLite);
the backfill touches only the restricted keys, in one short statement, after a moment's lock
(``lock_timeout``, migrations/env.py): a key check never waits on it for long.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""
import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade():
    # A plain ADD COLUMN on both (SQLite's batch mode would rebuild the table that
    # usage_events refers to).
    op.add_column("api_keys", sa.Column("org_read", sa.Boolean, nullable=False,
                                        server_default=sa.true()))
    op.execute("UPDATE api_keys SET org_read = false "
               "WHERE allowed_models IS NOT NULL OR limit_usd IS NOT NULL")


def downgrade():
    if op.get_bind().dialect.name == "postgresql":
        op.drop_column("api_keys", "org_read")
    else:  # SQLite 3.35 and later drop a column in place
        op.execute("ALTER TABLE api_keys DROP COLUMN org_read")
