"""Shared fixtures: a real Postgres database, the scripted fake upstream, the real gateway
(gunicorn + gevent workers), orgs with keys and credits, and the official ``openai`` client."""
import os
import uuid

import openai
import pytest
import sqlalchemy as sa

from fake_upstream import FakeUpstream, default_script
from gateway_proc import Gateway, create_database, drop_database, make_org, migrate

CATALOG = """
[[models]]
id = "fake-model"
context_window = 8192
max_output_tokens = 1024
input = ["text"]
pricing = {{ input = "0.10", cached_input = "0.05", output = "0.30" }}
backends = [{{ url = "{url}", model = "upstream-fake" }}]

[[models]]
id = "fake-vision"
context_window = 32768
max_output_tokens = 4096
input = ["text", "image"]
parallel_tool_calls = true
forced_tool_choice = true
response_format = true
pricing = {{ input = "1.25", cached_input = "0.125", output = "10" }}
backends = [{{ url = "{url}", model = "upstream-vision" }}]

[[models]]
id = "gpt-oss-fake"
family = "gpt-oss"
context_window = 131072
max_output_tokens = 32768
input = ["text"]
pricing = {{ input = "0.05", cached_input = "0.025", output = "0.25" }}
backends = [{{ url = "{url}", model = "openai/gpt-oss-120b" }}]
"""


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


def fail_on_fake_errors(fake, since=0):
    """Fail the test if ``fake`` recorded errors past the first ``since``."""
    if len(fake.errors) > since:
        pytest.fail("the fake upstream failed:\n" + "\n".join(fake.errors[since:]),
                    pytrace=False)


@pytest.fixture(scope="session")
def catalog_path(tmp_path_factory, fake_upstream):
    path = tmp_path_factory.mktemp("catalog") / "models.toml"
    path.write_text(CATALOG.format(url=fake_upstream.base_url))
    return path


# How long a worker keeps the maintenance switch it read (KILN_MAINTENANCE_POLL_S): a request
# that reaches a worker this long after a switch has committed sees it.
MAINTENANCE_POLL_S = 0.5


def gateway_env(pg_url, catalog_path, **overrides):
    # No active probe unless a test asks (tests/test_fleet.py): its GETs would be among the
    # requests a test reads back from the fake upstream.
    env = {"KILN_DATABASE_URL": pg_url, "KILN_MODELS": str(catalog_path),
           "KILN_KEY_CACHE_TTL_S": "1", "KILN_MAINTENANCE_POLL_S": str(MAINTENANCE_POLL_S),
           "KILN_PROBE_INTERVAL_S": "0"}
    env.update({f"KILN_{k.upper()}": str(v) for k, v in overrides.items()})
    return env


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
