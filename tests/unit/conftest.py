"""The unit layer: in process, no gunicorn, no model server, no Postgres (``make check``).

Every test here is marked ``unit``. The fixtures give an in-process Kiln (``create_app``) on a
migrated SQLite file, with the functional layer's catalog on a port where nothing listens:
``app``, its ``engine``, Flask's test ``client``, and a funded ``org``.
"""
from pathlib import Path

import pytest

import factories

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.unit)


@pytest.fixture(scope="module")
def kiln(tmp_path_factory):
    """``(app, engine)``: one in-process Kiln per test module (the sweeper and probe off)."""
    app, engine = factories.sqlite_app(tmp_path_factory.mktemp("kiln"),
                                       factories.CATALOG.format(url=factories.UNREACHABLE_BACKEND),
                                       probe_interval_s=0)  # a valid body finds its backend
    yield app, engine
    body_process = app.extensions.get("kiln.body_process")
    if body_process is not None:
        body_process.stop()
    engine.dispose()


@pytest.fixture(scope="module")
def app(kiln):
    """The module's in-process Kiln (a Flask app)."""
    return kiln[0]


@pytest.fixture(scope="module")
def engine(kiln):
    """The engine of ``app``'s SQLite database."""
    return kiln[1]


@pytest.fixture
def client(app):
    """Flask's test client on ``app``."""
    return app.test_client()


@pytest.fixture(scope="module")
def org(engine):
    """An org of the module's Kiln with $10 of credits and one key."""
    return factories.org(engine)
