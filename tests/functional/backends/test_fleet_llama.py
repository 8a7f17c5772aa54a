"""Two real llama.cpp servers (SmolLM2-135M) behind one model id: one is killed mid-run and
restarted, through the gateway and the official openai SDK (docs/ROUTING.md)."""
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai
import pytest
import requests
import sqlalchemy as sa

from gateway_proc import Gateway, free_port, make_org, metric, wait_until
from model_server import start_model_server, stop, wait_ready

pytestmark = pytest.mark.llama

CATALOG = """
[[models]]
id = "smollm2-135m"
context_window = 4096
max_output_tokens = 256
routing = "least-outstanding"
pricing = {{ input = "0.10", cached_input = "0.05", output = "0.30" }}
backends = [{backends}]
"""
PROBE_INTERVAL_S = 1


def backend_line(port):
    base = f"http://127.0.0.1:{port}"
    return (f'{{ url = "{base}/v1", model = "smollm2-135m", server = "llama-cpp-python", '
            f'tokenize_url = "{base}/extras/tokenize/count" }}')


class Server:
    """One llama.cpp server on a fixed port, which can be killed and started again."""

    def __init__(self):
        self.port, self.proc = free_port(), None
        self.log = Path(tempfile.mkdtemp()) / "llama.log"

    def start(self):
        self.launch()
        wait_ready(f"http://127.0.0.1:{self.port}", timeout_s=180, proc=self.proc)

    def launch(self):
        self.proc = start_model_server(sys.executable, self.port, self.log)

    def answering(self, timeout_s=180):
        """Wait for the server's first 200 on ``GET /v1/models`` (the gateway's probe path);
        return its ``time.monotonic()``, polled every 50 ms."""
        url = f"http://127.0.0.1:{self.port}/v1/models"

        def answered():
            try:
                with requests.get(url, timeout=2) as r:
                    return time.monotonic() if r.status_code == 200 else None
            except requests.ConnectionError:
                return None
        return wait_until(answered, timeout_s=timeout_s)

    def kill(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def pair():
    servers = [Server(), Server()]
    for server in servers:
        server.start()
    yield servers
    for server in servers:
        if server.proc.poll() is None:
            stop(server.proc)


class Traffic:
    """Clients sending requests (every other one a stream) until stopped; each outcome kept:
    ``ok``, ``failed_before_relay`` (no answer had begun), ``failed_mid_stream``."""

    def __init__(self, base_url, key, clients=3):
        self.base_url, self.key = base_url, key
        self.outcomes, self.backends_seen = [], []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self, i):
        with openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.key, max_retries=0,
                           timeout=120) as client:
            n = 0
            while not self.stop.is_set():
                self.outcomes.append(self._one(client, (n + i) % 2 == 0))
                n += 1

    def _one(self, client, stream):
        began = False
        try:
            kwargs = {"model": "smollm2-135m", "max_tokens": 12,
                      "messages": [{"role": "user", "content": "Count to five."}]}
            if not stream:
                client.chat.completions.create(**kwargs)
                return "ok"
            with client.chat.completions.create(stream=True, **kwargs) as chunks:
                began = True
                for _ in chunks:
                    pass
            return "ok"
        except openai.APIError:
            return "failed_mid_stream" if began else "failed_before_relay"

    def count(self, outcome):
        return self.outcomes.count(outcome)

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=180)


def served_by(backends, port):
    return any(f":{port}/" in (backend or "") for backend in backends)


def test_a_killed_backend_costs_no_request_and_comes_back(pair, pg_url, engine, tmp_path):
    victim, steady = pair
    catalog = tmp_path / "models.toml"
    catalog.write_text(CATALOG.format(backends=", ".join(backend_line(s.port) for s in pair)))
    # A long breaker cool-down: only the probe can bring the restarted server back this soon.
    gw = Gateway({"KILN_DATABASE_URL": pg_url, "KILN_MODELS": str(catalog),
                  "KILN_PROBE_INTERVAL_S": str(PROBE_INTERVAL_S),
                  "KILN_BREAKER_COOLDOWN_S": "600", "KILN_BREAKER_MAX_COOLDOWN_S": "600"},
                 workers=2).start()
    org = make_org(engine, "fleet-llama", usd="10", limit=16)
    traffic = None
    try:
        traffic = Traffic(gw.base_url, org.key)
        wait_until(lambda: traffic.count("ok") >= 6, timeout_s=180)
        victim.kill()
        settled = len(traffic.outcomes)
        wait_until(lambda: len(traffic.outcomes) >= settled + 12, timeout_s=300)
        tries_before = tries_on(gw, victim)
        victim.launch()
        answering = victim.answering()  # the long wait is the model's loading only
        wait_until(lambda: tries_on(gw, victim) > tries_before,
                   timeout_s=PROBE_INTERVAL_S + 1)
        routed = time.monotonic()
        since = backends_since(engine, org.id)
        wait_until(lambda: served_by(backends_after(engine, org.id, since), victim.port),
                   timeout_s=60)
    finally:
        if traffic is not None:
            traffic.finish()
        gw.stop()
    assert traffic.count("failed_before_relay") == 0, traffic.outcomes
    assert traffic.count("failed_mid_stream") <= 3  # at most the streams it was relaying
    assert traffic.count("ok") >= 18
    assert served_by(backends_after(engine, org.id, 0), steady.port)
    assert routed - answering <= PROBE_INTERVAL_S + 1  # back within one probe interval


def tries_on(gw, server):
    """The tries the gateway has sent ``server`` (``kiln_backend_requests_total``)."""
    return metric(gw.base_url, "kiln_backend_requests_total",
                  backend=f"http://127.0.0.1:{server.port}/v1") or 0


def backends_since(engine, org_id):
    """The number of the org's usage events so far (a marker)."""
    return len(backends_after(engine, org_id, 0))


def backends_after(engine, org_id, skip):
    """The backends of the org's usage events after the first ``skip`` (in start order)."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT backend FROM usage_events WHERE org_id = :o "
                                    "ORDER BY started_at"), {"o": org_id}).scalars().all()
    return rows[skip:]
