"""psycopg waits on gevent's loop in a patched worker (gateway/db.py, ``_gevent_wait``).

Each case runs in a fresh interpreter that patches the standard library first, as a gunicorn
gevent worker does, then builds the ledger's engine with :func:`gateway.db.create_engine`.
"""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

PRELUDE = """
from gevent import monkey; monkey.patch_all()
import json, sys
import gevent, psycopg, sqlalchemy as sa
from psycopg import waiting
from gateway import db
from gateway.config import Config
from gateway.ledger.postgres import PostgresStore
engine = db.create_engine(Config.from_mapping({"database_url": sys.argv[1]}), ledger=True)
store = PostgresStore(engine)
out = {"installed": waiting.wait is db._gevent_wait}
"""


def run(pg_url, body):
    script = PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
    done = subprocess.run([sys.executable, "-c", script, pg_url], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out.pop("installed") is True
    return out


def test_a_statement_waiting_in_postgres_lets_the_other_greenlets_run(pg_url):
    out = run(pg_url, """
        ticks = []
        def tick():
            while True:
                ticks.append(1)
                gevent.sleep(0.01)
        ticker = gevent.spawn(tick)
        gevent.sleep(0)
        before = len(ticks)
        out["rows"] = store._call("SELECT pg_sleep(0.3), %s::text", ("done",))[0][1]
        out["ticks"] = len(ticks) - before
        ticker.kill()
    """)
    assert out["rows"] == "done"
    assert out["ticks"] >= 5  # 30 possible while the statement waited 0.3 s


def test_a_statement_larger_than_the_sockets_buffers_is_sent_and_answered(pg_url):
    # 8 MiB of parameter: libpq's send stops on a full socket, and the wait for writability
    # (psycopg's Wait.W) carries it on.
    out = run(pg_url, """
        text = "k" * (8 << 20)
        out["length"] = store._call("SELECT length(%s::text)", (text,))[0][0]
        out["echo"] = len(store._call("SELECT %s::text", (text,))[0][0])
    """)
    assert out == {"length": 8 << 20, "echo": 8 << 20}


def test_a_connection_killed_while_it_waits_raises_and_the_next_statement_runs(pg_url):
    out = run(pg_url, """
        def kill_it():
            gevent.sleep(0.3)
            with psycopg.connect(sys.argv[1].replace("+psycopg", ""), autocommit=True) as c:
                c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE query LIKE 'SELECT pg_sleep(30)%%' AND pid <> pg_backend_pid()")
        killer = gevent.spawn(kill_it)
        with gevent.Timeout(20):
            try:
                store._call("SELECT pg_sleep(30)", ())
                out["raised"] = None
            except psycopg.OperationalError as err:
                out["raised"] = type(err).__name__
        killer.join()
        out["after"] = store._call("SELECT 41 + 1", ())[0][0]
    """)
    assert out["raised"] is not None
    assert out["after"] == 42
