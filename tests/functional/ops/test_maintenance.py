"""503s: maintenance mode switched by an operator without a restart, and no backend available
(endpoint reference, "Errors"). Both answer in the JSON envelope and charge nothing."""
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import requests
import sqlalchemy as sa

from factories import MESSAGES
from fake_upstream import FakeUpstream, error_reply
from gateway_proc import MAINTENANCE_POLL_S, balance_nanos, free_port, usage_event, wait_until

BODY = {"model": "fake-model", "messages": MESSAGES}
START = (10 * 10**9, 0, 0)
KILN = Path(sys.executable).with_name("kiln")


def kiln(pg_url, *args):
    """Run the ``kiln`` command as an operator would; return its stdout."""
    env = {**os.environ, "KILN_DATABASE_URL": pg_url}
    out = subprocess.run([str(KILN), *args], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    return out.stdout


def counts(engine, org_id):
    """Return ``(usage events, in-flight rows)`` of an org."""
    with engine.connect() as conn:
        return tuple(conn.execute(sa.text(f"SELECT count(*) FROM {table} WHERE org_id = :o"),
                                  {"o": org_id}).scalar_one()
                     for table in ("usage_events", "in_flight"))


def headers(org):
    """The org's key, and no keep-alive: an idle connection left open would hold up the
    gateway's graceful stop."""
    return {**org.headers, "Connection": "close"}


def statuses(gateway, org, n=12, body=BODY):
    """Status codes of ``n`` requests, each on a new connection (so spread over the workers)."""
    return [requests.post(gateway.base_url + "/v1/chat/completions", json=body,
                          headers=headers(org), timeout=30).status_code for _ in range(n)]


@pytest.fixture
def maintenance_switch(pg_url, engine, gateway, org):
    """Yield the ``kiln maintenance`` runner; leave maintenance off and every worker serving."""
    yield lambda *args: kiln(pg_url, "maintenance", *args)
    from gateway.ops.lifecycle import set_maintenance
    set_maintenance(engine, False)
    off = time.monotonic()
    wait_until(lambda: statuses(gateway, org, n=4) == [200] * 4, timeout_s=20, interval_s=0.2)
    # Those four may all have gone to one worker: past the poll interval every worker has
    # dropped a switch read before, so the next test's requests find none in maintenance.
    time.sleep(max(0.0, off + MAINTENANCE_POLL_S - time.monotonic()))


def test_maintenance_on_then_off_without_restart(gateway, fake, org, engine, client,
                                                 maintenance_switch):
    out = maintenance_switch("on", "--retry-after", "120", "--message", "Upgrading Kiln.")
    assert "maintenance=on retry_after_s=120" in out
    switched = time.monotonic()
    # Every worker re-reads the switch within seconds (KILN_MAINTENANCE_POLL_S).
    wait_until(lambda: statuses(gateway, org) == [503] * 12, timeout_s=15, interval_s=0.2)
    # Twelve new connections may all have reached one worker; the other drops the state it
    # read before the switch once its poll interval has passed (the same monotonic clock).
    time.sleep(max(0.0, switched + MAINTENANCE_POLL_S - time.monotonic()))
    with requests.post(gateway.base_url + "/v1/chat/completions", json=BODY,
                       headers=headers(org), timeout=30) as r:
        assert r.status_code == 503 and r.headers["Retry-After"] == "120"
        assert r.headers["Content-Type"].startswith("application/json")
        assert r.json() == {"error": {"message": "Upgrading Kiln.", "type":
                                      "service_unavailable", "param": None,
                                      "code": "maintenance"}}
    with pytest.raises(openai.APIStatusError) as err:  # a stream asked for: still JSON
        client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=True)
    assert err.value.status_code == 503 and err.value.body["code"] == "maintenance"
    assert err.value.response.headers["retry-after"] == "120"
    del err  # its traceback holds the test frame: a cycle that would keep the connection open
    assert fake.requests == []
    assert counts(engine, org.id) == (0, 0)
    assert balance_nanos(engine, org.id) == START

    assert "maintenance=off" in maintenance_switch("off")
    wait_until(lambda: statuses(gateway, org) == [200] * 12, timeout_s=15, interval_s=0.2)
    assert fake.requests and balance_nanos(engine, org.id)[0] < START[0]


def test_maintenance_status_shows_the_row(maintenance_switch):
    assert "maintenance=off" in maintenance_switch("status")


DEAD_CATALOG = """
[[models]]
id = "dead-model"
context_window = 8192
max_output_tokens = 1024
pricing = {{ input = "0.10", cached_input = "0.05", output = "0.30" }}
backends = [{{ url = "http://127.0.0.1:{dead_port}/v1", model = "upstream-fake" }}]

[[models]]
id = "drained-model"
context_window = 8192
max_output_tokens = 1024
pricing = {{ input = "0.10", cached_input = "0.05", output = "0.30" }}
backends = [{{ url = "{live_url}", model = "upstream-fake", weight = 0 }}]
"""


def test_no_backend_available_is_503_and_an_unreachable_one_502(start_gateway, tmp_path, fake,
                                                                org, engine):
    dead_port = free_port()
    catalog = tmp_path / "models.toml"
    catalog.write_text(DEAD_CATALOG.format(dead_port=dead_port, live_url=fake.base_url))
    gw = start_gateway(workers=1, models=catalog)
    url = gw.base_url + "/v1/chat/completions"

    def post(model):
        return requests.post(url, json={**BODY, "model": model}, headers=headers(org), timeout=30)

    r = post("drained-model")  # every backend drained (weight 0)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_backend_available"
    assert r.json()["error"]["type"] == "service_unavailable"
    assert fake.requests == [] and counts(engine, org.id) == (0, 0)

    r = post("dead-model")  # connection refused: the backend is unreachable
    assert r.status_code == 502 and r.headers["Content-Type"].startswith("text/plain")
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert event["status"] == "upstream_error" and event["cost_nanos"] == 0

    r = post("dead-model")  # ... and now out of rotation: no backend available
    assert r.status_code == 503 and r.headers["Content-Type"].startswith("application/json")
    assert r.json()["error"] == {"message": "No backend is available for model 'dead-model'. "
                                            "Retry with exponential backoff.",
                                 "type": "service_unavailable", "param": None,
                                 "code": "no_backend_available"}
    assert counts(engine, org.id) == (1, 0)  # the 503 was refused before admission
    assert balance_nanos(engine, org.id) == START

    with FakeUpstream(port=dead_port) as revived:  # back after the cooldown
        wait_until(lambda: post("dead-model").status_code == 200, timeout_s=20, interval_s=0.5)
        assert revived.requests[-1].json["model"] == "upstream-fake"
    assert balance_nanos(engine, org.id)[1:] == (0, 0)


def test_backend_at_capacity_is_503_with_retry_after(client, fake, org, engine):
    fake.enqueue(error_reply(429, "too many requests"))
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="fake-model", messages=MESSAGES)
    assert err.value.status_code == 503
    assert err.value.body["type"] == "service_unavailable"
    assert err.value.response.headers["retry-after"] == "1"
    assert balance_nanos(engine, org.id) == START
