"""The org's usage events in the order ``GET /v1/generations`` lists and exports them: newest
first by ``(started_at, id)``. The index ``(org_id, started_at, id)`` gives each page (and each
batch of a CSV export) one index range scan from the cursor's position, ties of ``started_at``
included, and serves every query the old ``(org_id, started_at)`` index served, which it
replaces (one index less to write per admission).

Postgres: both indexes are built and dropped ``CONCURRENTLY``, outside the migration's
transaction (alembic's ``autocommit_block``), so that admissions and settlements keep writing
``usage_events`` while it runs; the build takes a while on a large table and waits for the
transactions open when it starts. A build that fails leaves an invalid index behind: it is
dropped first when the upgrade runs again. SQLite (the demo's file): plain statements.

Revision ID: 0017
Revises: 0018
Create Date: 2026-12-02
"""
from alembic import op

revision = "0017"
down_revision = "0018"
branch_labels = None
depends_on = None

NEW = ("ix_usage_events_org_started_id", ["org_id", "started_at", "id"])
OLD = ("ix_usage_events_org_started", ["org_id", "started_at"])


def upgrade():
    _swap(build=NEW, drop=OLD)


def downgrade():
    _swap(build=OLD, drop=NEW)


def _swap(build, drop):
    """Build the index ``build`` (name, columns), then drop the index named ``drop[0]``."""
    if op.get_bind().dialect.name != "postgresql":
        op.create_index(build[0], "usage_events", build[1])
        op.drop_index(drop[0], table_name="usage_events")
        return
    with op.get_context().autocommit_block():
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {build[0]}")  # a failed build's leftover
        op.create_index(build[0], "usage_events", build[1], postgresql_concurrently=True)
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {drop[0]}")
