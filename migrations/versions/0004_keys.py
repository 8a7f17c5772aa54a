"""Key limits within what admission compares: at most 9,223,372,036.854775807 USD.

Admission converts a key's spend limit to BIGINT nano-dollars; a larger limit set by SQL would
make every request of that key fail in the database. On Postgres the table refuses it (SQLite's
tables keep the checks of the models only when created; its ledger compares in Python).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

NAME = "ck_api_keys_limit_in_range"
CONDITION = "limit_usd <= 9223372036.854775807"


def upgrade():
    if op.get_bind().dialect.name == "postgresql":
        op.create_check_constraint(op.f(NAME), "api_keys", CONDITION)


def downgrade():
    if op.get_bind().dialect.name == "postgresql":
        op.drop_constraint(op.f(NAME), "api_keys", type_="check")
