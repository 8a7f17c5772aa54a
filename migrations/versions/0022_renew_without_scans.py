"""``kiln_renew`` reaches every event through its id, never by a sequential scan (``SET
enable_seqscan = off`` on the function, and an index condition on its last statement's join).

PL/pgSQL keeps a statement's plan for the connection's life, and after five calls may keep a
generic one. A renewer whose connection planned while ``usage_events`` was small (a new
deployment, a restored database before its analyze) went on scanning the whole table on every
renewal as the table grew, in three of its statements, until the table's next analyze
replanned them. The same measure as 0020's for ``kiln_settle``. Same results. Postgres only:
SQLite renews in Python.

Downgrade puts back the function of 0021: the installed text with each hunk of this revision
replaced by what it was.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-07
"""
import re

import sqlalchemy as sa
from alembic import op

from gateway.ledger.postgres import RENEW

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

NO_SCANS = re.compile(r"^ SET enable_seqscan TO '?off'?\n", re.MULTILINE)
# The hunk of this revision in the function's body (new, old); the setting is the other.
HUNKS = (
    ("""      FROM unnest(p_ids) AS i(id)
      LEFT JOIN usage_events e ON e.id = i.id AND e.id = ANY(p_ids);""",
     """      FROM unnest(p_ids) AS i(id) LEFT JOIN usage_events e ON e.id = i.id;"""),
)
SIGNATURE = "kiln_renew(text[], integer[], integer[], integer[], double precision)"


def upgrade():
    if op.get_bind().dialect.name == "postgresql":
        op.execute(RENEW)


def downgrade():
    if op.get_bind().dialect.name != "postgresql":
        return
    installed = op.get_bind().execute(sa.text(
        f"SELECT pg_get_functiondef('{SIGNATURE}'::regprocedure)")).scalar_one()
    old, found = NO_SCANS.subn("", installed)
    for new, was in HUNKS:
        if old.count(new) != 1 or found != 1:
            raise RuntimeError("kiln_renew changed since 0022: write this downgrade again")
        old = old.replace(new, was)
    op.execute(old)
