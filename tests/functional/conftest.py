"""Fixtures of the functional layer: a real Postgres database, the scripted fake upstream, the
real gateway (gunicorn + gevent workers), orgs with keys and credits, and the official ``openai``
client."""
import os
import uuid

import openai
import pytest
import sqlalchemy as sa

from factories import CATALOG
from fake_upstream import FakeUpstream, default_script, fail_on_fake_errors
from gateway_proc import Gateway, create_database, drop_database, gateway_env, make_org, migrate


@pytest.fixture(scope="session")
def pg_url():
    """A fresh Postgres database for this test session, migrated to head."""
    name = f"kiln_test_{os.getpid()}"
    url = create_database(name)
    migrate(url)
    yield url
    drop_database(name)


@pytest.fixture(scope="session")
def engine(pg_url):
    eng = sa.create_engine(pg_url)
    yield eng
    eng.dispose()


@pytest.fixture(scope="session")
def fake_upstream():
    with FakeUpstream() as fake:
        yield fake


@pytest.fixture
def fake(fake_upstream):
    """The fake upstream, with no queued scripts, no records and the default responder.

    A failure inside the fake (a responder that raised) fails the test at teardown: the gateway
    would have told the client a 502, which a test may well expect.
    """
    fake_upstream.clear()
    fake_upstream.reset_stats()
    fake_upstream.default = default_script
    errors_before = len(fake_upstream.errors)
    yield fake_upstream
    fake_upstream.clear()
    fake_upstream.default = default_script
    fail_on_fake_errors(fake_upstream, errors_before)


@pytest.fixture(scope="session")
def catalog_path(tmp_path_factory, fake_upstream):
    path = tmp_path_factory.mktemp("catalog") / "models.toml"
    path.write_text(CATALOG.format(url=fake_upstream.base_url))
    return path


@pytest.fixture(scope="session")
def gateway(pg_url, catalog_path):
    """The shared gateway: gunicorn, two gevent workers, on the session's Postgres."""
    gw = Gateway(gateway_env(pg_url, catalog_path), workers=2).start()
    yield gw
    gw.stop()


@pytest.fixture
def start_gateway(pg_url, catalog_path):
    """Factory: start a gateway with KILN_* overrides (``keepalive_s=1``, ...); stopped after."""
    started = []

    def start(workers=1, **overrides):
        gw = Gateway(gateway_env(pg_url, catalog_path, **overrides), workers=workers).start()
        started.append(gw)
        return gw
    yield start
    for gw in started:
        gw.stop()


@pytest.fixture
def org(engine):
    """A fresh org with $10 of credits and one key."""
    return make_org(engine, f"org-{uuid.uuid4().hex[:10]}")


@pytest.fixture
def client(gateway, org):
    """The official openai SDK pointed at the shared gateway with the org's key."""
    with openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=org.key,
                       max_retries=0, timeout=30) as c:
        yield c
