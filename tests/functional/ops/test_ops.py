"""Operations through the real programs: gunicorn's effective settings from
``deploy/gunicorn.conf.py``, a cooperative database driver under that exact config, the health
and readiness probes, and maintenance mode switched with the ``kiln`` command."""
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import sqlalchemy as sa

from factories import CATALOG, MESSAGES
from gateway_proc import MAINTENANCE_POLL_S, ROOT, balance_nanos, free_port, wait_until

pytestmark = pytest.mark.postgres

GUNICORN_CONF = ROOT / "deploy" / "gunicorn.conf.py"
UNIT = ROOT / "deploy" / "kiln-gateway.service"
NGINX_SITE = ROOT / "deploy" / "nginx" / "kiln.conf"
# An idle keep-alive connection holds a stopping gevent worker for up to gunicorn's `keepalive`.
CLOSE = {"Connection": "close"}


# -- gunicorn settings ---------------------------------------------------------------------------

def effective_config(**env):
    """Return gunicorn's effective settings (``--print-config``) as ``{name: text value}``."""
    out = subprocess.run(
        [sys.executable, "-m", "gunicorn", "-c", str(GUNICORN_CONF), "--print-config",
         "gateway.wsgi:app"], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
        text=True, timeout=60, check=True).stdout  # exits 1 if the app fails to import
    return dict(re.findall(r"^(\w+)\s+= (.*)$", out, flags=re.M))


def unit_seconds(name):
    """Return a ``NameSec=N`` setting of the systemd unit, in seconds."""
    return int(re.search(rf"^{name}=(\d+)$", UNIT.read_text(), flags=re.M).group(1))


def test_gunicorn_config_is_right_for_long_streams_under_gevent():
    cfg = effective_config()
    assert cfg["worker_class"] == "gevent"
    assert cfg["preload_app"] == "False"  # the app is imported after gevent patched the worker
    assert int(cfg["worker_connections"]) >= 5000  # one greenlet per open stream
    # A stream holds two descriptors (client and backend); the unit's limit must cover them.
    limit_nofile = int(re.search(r"^LimitNOFILE=(\d+)$", UNIT.read_text(), flags=re.M).group(1))
    assert 2 * int(cfg["worker_connections"]) < limit_nofile
    assert int(cfg["max_requests"]) > 0 and int(cfg["max_requests_jitter"]) > 0
    # systemd must not SIGKILL the workers while they still finish streams.
    assert int(cfg["graceful_timeout"]) < unit_seconds("TimeoutStopSec")
    # gunicorn must outlive nginx's idle upstream connections, or a POST can meet a closed one.
    nginx_idle_s = int(re.search(r"keepalive_timeout (\d+)s;", NGINX_SITE.read_text()).group(1))
    assert int(cfg["keepalive"]) > nginx_idle_s
    assert cfg["errorlog"] == "-" and cfg["accesslog"] == "None"
    assert "'kiln.requests': {'handlers': ['requests', 'problems']" in cfg["logconfig_dict"]
    assert "'stream': 'ext://sys.stdout'" in cfg["logconfig_dict"]


ACCESS_PROBE = """
import runpy, sys
from gunicorn.config import Config
conf = runpy.run_path(sys.argv[1])
cfg = Config()
cfg.set("logconfig_dict", conf["logconfig_dict"])
class Untouchable:
    def __getattr__(self, name):
        raise LookupError(name)
for cls in (conf["NoAccessLog"], conf["Logger"]):
    try:
        cls(cfg).access(Untouchable(), Untouchable(), {}, Untouchable())
        print(cls.__name__, "untouched")
    except LookupError:
        print(cls.__name__, "touched")
"""


def test_gunicorn_builds_no_access_log_line():
    # With logconfig_dict set, gunicorn's own logger builds every request's access-log atoms
    # (reading the request and response) for a logger with no handler; Kiln's does not.
    assert "NoAccessLog" in effective_config()["logger_class"]
    out = subprocess.run([sys.executable, "-c", ACCESS_PROBE, str(GUNICORN_CONF)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split("\n")[:2] == ["NoAccessLog untouched", "Logger touched"]


def test_gunicorn_config_follows_the_environment():
    cfg = effective_config(KILN_WORKERS="3", KILN_GRACEFUL_TIMEOUT="7", KILN_WORKER_TIMEOUT="9",
                           KILN_MAX_REQUESTS="1000", KILN_WORKER_CONNECTIONS="321",
                           KILN_BIND="127.0.0.1:9999")
    assert (cfg["workers"], cfg["graceful_timeout"], cfg["timeout"]) == ("3", "7", "9")
    assert (cfg["max_requests"], cfg["max_requests_jitter"]) == ("1000", "100")
    assert cfg["worker_connections"] == "321" and cfg["bind"] == "['127.0.0.1:9999']"


def test_log_level_and_streams_as_the_workers_apply_them(tmp_path):
    """The logging config as gunicorn applies it (after its own ``loglevel``): request lines,
    and only they, on stdout; the request log's warnings and the rest on stderr at
    KILN_LOG_LEVEL."""
    script = (
        "import logging, logging.config, runpy, sys\n"
        "cfg = runpy.run_path(sys.argv[1])\n"
        "logging.config.dictConfig(cfg['logconfig_dict'])\n"
        "requests = logging.getLogger('kiln.requests')\n"
        "requests.info('{\"event\": \"generation\"}')\n"
        "requests.warning('lease renewal failed')\n"
        "logging.getLogger('gunicorn.error').info('Booting worker')\n"
        "logging.getLogger('gateway.api.health').warning('readiness: database unreachable')\n")
    env = {**os.environ, "KILN_LOG_LEVEL": "warning",
           "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "metrics")}
    out = subprocess.run([sys.executable, "-c", script, str(GUNICORN_CONF)], env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout == '{"event": "generation"}\n'
    assert "lease renewal failed" in out.stderr and "kiln.requests" in out.stderr
    assert "gateway.api.health: readiness: database unreachable" in out.stderr
    assert "Booting worker" not in out.stderr  # info, below KILN_LOG_LEVEL


# -- the database driver waits cooperatively ------------------------------------------------------

class SlowQueryServer:
    """gunicorn, ONE gevent worker, deploy/gunicorn.conf.py, serving
    tests/support/slow_query_app.py."""

    def __init__(self, pg_url, log_path):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "KILN_DATABASE_URL": pg_url, "KILN_WORKERS": "1",
               "KILN_BIND": f"127.0.0.1:{self.port}",
               "PROMETHEUS_MULTIPROC_DIR": str(log_path.parent / "metrics")}
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", str(GUNICORN_CONF),
             "--pythonpath", str(ROOT / "tests" / "support"), "slow_query_app:app"],
            cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self):
        def up():
            assert self.proc.poll() is None, "gunicorn exited"
            try:
                resp = requests.get(self.base_url + "/fast", headers=CLOSE, timeout=2)
                return resp.status_code == 200
            except requests.RequestException:
                return False
        wait_until(up, timeout_s=60, interval_s=0.2)
        return self

    def workers(self):
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return out.stdout.split()

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def sleeping_queries(engine):
    with engine.connect() as conn:
        return conn.execute(sa.text(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'kiln-gateway' "
            "AND state = 'active' AND query LIKE 'SELECT pg_sleep%'")).scalar_one()


def test_one_worker_serves_others_while_a_query_sleeps_in_postgres(pg_url, engine, tmp_path):
    """psycopg 3 through SQLAlchemy waits cooperatively: with ONE gevent worker, requests keep
    being served (each running its own query) while another request sits in ``pg_sleep``.
    A driver that blocked the worker would answer them only after the sleep ended."""
    server = SlowQueryServer(pg_url, tmp_path / "gunicorn.log").wait_ready()
    try:
        assert len(server.workers()) == 1
        slow = {}
        sleeper = threading.Thread(target=lambda: slow.setdefault(
            "resp", requests.get(server.base_url + "/sleep?s=3", headers=CLOSE,
                                     timeout=60)))
        sleeper.start()
        wait_until(lambda: sleeping_queries(engine) == 1, timeout_s=20)
        fast = [requests.get(server.base_url + "/fast", headers=CLOSE, timeout=60)
                for _ in range(5)]
        # Ordering, not timing: all five were answered while the slow query still ran.
        still_sleeping = sleeping_queries(engine) == 1 and sleeper.is_alive()
        sleeper.join(60)
        assert [r.text for r in fast] == ["fast"] * 5
        assert still_sleeping, "the fast requests waited for pg_sleep: the worker was blocked"
        assert slow["resp"].status_code == 200 and slow["resp"].text == "slept"
    finally:
        server.stop()


# -- health and readiness ------------------------------------------------------------------------

def test_healthz_and_readyz_with_the_database_up(gateway):
    health = requests.get(gateway.base_url + "/healthz", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    ready = requests.get(gateway.base_url + "/readyz", timeout=10)
    assert ready.status_code == 200
    assert ready.json() == {"status": "ok", "models": CATALOG.count("[[models]]")}


def test_readyz_is_503_when_the_database_is_unreachable(start_gateway):
    closed = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/kiln"
    gw = start_gateway(database_url=closed)
    assert requests.get(gw.base_url + "/healthz", headers=CLOSE, timeout=10).status_code == 200
    ready = requests.get(gw.base_url + "/readyz", headers=CLOSE, timeout=30)
    assert ready.status_code == 503
    assert ready.json() == {"status": "unavailable", "database": "unreachable"}
    assert "readiness: database unreachable" in gw.log()


# -- maintenance mode ----------------------------------------------------------------------------

def kiln(pg_url, *args):
    """Run the ``kiln`` console script against the test database; return its stdout."""
    env = {**os.environ, "KILN_DATABASE_URL": pg_url}
    command = [str(Path(sys.executable).with_name("kiln")), *args]  # the venv's console script
    return subprocess.run(command, env=env, check=True, capture_output=True, text=True,
                          timeout=60).stdout


def test_maintenance_mode_switched_by_the_kiln_command(gateway, fake, org, engine, pg_url):
    url = gateway.base_url + "/v1/chat/completions"
    body = {"model": "fake-model", "messages": MESSAGES}
    try:
        out = kiln(pg_url, "maintenance", "on", "--retry-after", "120", "--message", "Upgrade.")
        assert out.strip() == "maintenance=on retry_after_s=120 message=Upgrade."
        switched = time.monotonic()
        # Every worker re-reads the switch within KILN_MAINTENANCE_POLL_S (0.5 s here).
        wait_until(lambda: requests.post(url, json=body, headers=org.headers,
                                         timeout=30).status_code == 503)
        # That 503 came from one worker; the other may keep the state it read before the
        # switch until its poll interval has passed (the same monotonic clock): wait it out.
        time.sleep(max(0.0, switched + MAINTENANCE_POLL_S - time.monotonic()))
        before, upstream_calls = balance_nanos(engine, org.id), len(fake.requests)
        resp = requests.post(url, json=body, headers=org.headers, timeout=30)
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "120"
        assert resp.json()["error"]["code"] == "maintenance"
        assert resp.json()["error"]["message"] == "Upgrade."
        # Refused before admission: no charge, no hold, no slot, no backend call.
        assert balance_nanos(engine, org.id) == before and before[1:] == (0, 0)
        assert len(fake.requests) == upstream_calls
        assert requests.get(gateway.base_url + "/healthz", timeout=10).status_code == 200
    finally:
        kiln(pg_url, "maintenance", "off")
    wait_until(lambda: requests.post(url, json=body, headers=org.headers,
                                     timeout=30).status_code == 200)
    assert kiln(pg_url, "maintenance", "status").startswith("maintenance=off")
    time.sleep(1.0)  # past every other gateway's cached switch (0.5 s) before the next test
