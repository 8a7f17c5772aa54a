"""A tiny WSGI app for ``tests/functional/ops/test_ops.py``: the gateway's own engine, a slow
and a fast route.

Served by gunicorn from ``deploy/gunicorn.conf.py`` (gevent worker, no preloading), it shows
whether a query waiting inside Postgres stops the worker from serving anything else:

    GET /sleep?s=SECONDS   runs ``SELECT pg_sleep(SECONDS)``; answers ``slept``
    GET /fast              runs ``SELECT 1``; answers ``fast``

The engine comes from :func:`gateway.db.create_engine` with ``KILN_DATABASE_URL``, so the
driver, pool and connect arguments are exactly the gateway's (psycopg 3 through SQLAlchemy).
The gateway has no route that sleeps in the database; this app exists only for that test.
"""
from urllib.parse import parse_qs

import sqlalchemy as sa

from gateway.config import Config
from gateway.db import create_engine

# Imported by the worker after gevent has patched the standard library (preload_app is off).
engine = create_engine(Config.from_mapping())


def app(environ, start_response):
    """Serve ``/sleep`` and ``/fast`` (text/plain); anything else is 404."""
    path = environ.get("PATH_INFO", "")
    if path == "/sleep":
        seconds = float(parse_qs(environ.get("QUERY_STRING", "")).get("s", ["2"])[0])
        body = _query("SELECT pg_sleep(:s)", s=seconds) and b"slept"
    elif path == "/fast":
        body = _query("SELECT 1") and b"fast"
    else:
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found"]
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]


def _query(sql, **params):
    with engine.connect() as conn:
        conn.execute(sa.text(sql), params)
    return True
