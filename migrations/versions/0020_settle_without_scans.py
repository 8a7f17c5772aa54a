"""``kiln_settle`` reaches every row through its key with ``= ANY(an array)`` (the batch's events,
their leases, the orgs' balance rows and the keys), and never by a sequential scan
(``SET enable_seqscan = off`` on the function: where an index serves, a scan is priced out).

0019 plans each statement once per session. A plan made while a table looked small to the
planner (a database just restored, statistics not yet gathered, a table that grows later) kept
a sequential scan of it for the session's whole life: a settlement of one generation scanned
all of ``usage_events`` to match the batch's events (1.6 ms of its 2.5 ms on a benchmark
database of a few thousand events), and scanned the leases, balances and keys it updates; planned
on empty tables, every statement did. An index condition on each, and no scan where an index
serves, make the plan's cost independent of the tables' sizes. Same results
(bench/RESULTS.md, "Settlement without scans"). Postgres only: SQLite settles in Python.

Downgrade puts back the function of 0019: the installed text with each hunk of this revision
replaced by what it was.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07
"""
import re

import sqlalchemy as sa
from alembic import op

from gateway.ledger.postgres import SETTLE

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

NO_SCANS = re.compile(r"^ SET enable_seqscan TO '?off'?\n", re.MULTILINE)
# The hunks of this revision in the function's body (new, old).
HUNKS = (
    ("""  PERFORM 1 FROM credit_balances b
   WHERE b.org_id = ANY(ARRAY(SELECT e.org_id FROM usage_events e WHERE e.id = ANY(v_ids)))
   ORDER BY b.org_id FOR UPDATE;""",
     """  PERFORM 1 FROM credit_balances b
   WHERE b.org_id IN (SELECT e.org_id FROM usage_events e WHERE e.id = ANY(v_ids))
   ORDER BY b.org_id FOR UPDATE;"""),
    ("""   WHERE s.gid = ANY(v_ids) AND e.id = ANY(v_ids)
     AND CASE""",
     """   WHERE s.gid = ANY(v_ids)
     AND CASE"""),
    ("""  lease AS (DELETE FROM in_flight f USING s WHERE f.generation_id = s.gid
                                              AND f.generation_id = ANY(v_ids)
""",
     """  lease AS (DELETE FROM in_flight f USING s WHERE f.generation_id = s.gid
"""),
    ("""           WHERE b.org_id = t.org_id AND b.org_id = ANY(ARRAY(SELECT d.org_id FROM d))
          RETURNING b.org_id),""",
     """           WHERE b.org_id = t.org_id RETURNING b.org_id),"""),
    ("""            WHERE k.id = t.api_key_id AND k.id = ANY(ARRAY(SELECT d.api_key_id FROM d))
           RETURNING k.id),""",
     """            WHERE k.id = t.api_key_id RETURNING k.id),"""),
)


def upgrade():
    if op.get_bind().dialect.name == "postgresql":
        op.execute(SETTLE)


def downgrade():
    if op.get_bind().dialect.name != "postgresql":
        return
    installed = op.get_bind().execute(sa.text(
        "SELECT pg_get_functiondef('kiln_settle(jsonb)'::regprocedure)")).scalar_one()
    old, found = NO_SCANS.subn("", installed)
    for new, was in HUNKS:
        if new not in old or found != 1:
            raise RuntimeError("kiln_settle changed since 0020: write this downgrade again")
        old = old.replace(new, was)
    op.execute(old)
