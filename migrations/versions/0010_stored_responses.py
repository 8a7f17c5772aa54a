"""Stored responses: ``POST /v1/responses`` with ``store`` keeps the response and its input
items per org until they expire (docs/RESPONSES.md, "Stored responses").

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""
import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade():
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("org_id", sa.Integer, nullable=False),
        sa.Column("generation_id", sa.String(40), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("previous_response_id", sa.String(64), nullable=True),
        sa.Column("response", sa.Text, nullable=False),
        sa.Column("input_items", sa.Text, nullable=False),
        sa.ForeignKeyConstraint(["org_id"], ["orgs.id"],
                                name=op.f("fk_stored_responses_org_id_orgs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_stored_responses")),
    )
    op.create_index("ix_stored_responses_org_created", "stored_responses",
                    ["org_id", "created_at"])
    op.create_index("ix_stored_responses_expires", "stored_responses", ["expires_at"])


def downgrade():
    op.drop_index("ix_stored_responses_expires", table_name="stored_responses")
    op.drop_index("ix_stored_responses_org_created", table_name="stored_responses")
    op.drop_table("stored_responses")
