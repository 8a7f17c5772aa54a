"""``/metrics`` through real gunicorn (gevent workers, prometheus-client multiprocess mode): the
counters merge every worker's samples, survive worker replacement, and count errors by code."""
import signal
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from fake_upstream import Hang, Reset, Status, chat_chunk, error_reply, sse
from factories import write_fleet_catalog
from gateway_proc import make_org, wait_until

pytestmark = pytest.mark.postgres

CLOSE = {"Connection": "close"}  # no idle keep-alive connection left to hold a stopping worker
BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "Say hello"}]}
# The fake's default usage, 10 prompt and 5 completion tokens of fake-model: 10 x 100 + 5 x 300.
DEFAULT_COST_NANOS = 2_500


def scrape(gw):
    """Return ``{(sample name, frozenset of labels): value}`` from the gateway's /metrics."""
    resp = requests.get(gw.base_url + "/metrics", headers=CLOSE, timeout=30)
    assert resp.status_code == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=")
    assert resp.headers["Content-Type"].count("charset") == 1
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(resp.text) for s in family.samples}


def value(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())), 0.0)


def chat(gw, org, n=1):
    """Send ``n`` non-stream chat requests, 8 at a time, each on a new connection."""
    def one(_):
        return requests.post(gw.base_url + "/v1/chat/completions", json=BODY,
                             headers={**org.headers, **CLOSE}, timeout=60).status_code
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n)))


def pids_with_counters(gw):
    """Return the pids that wrote counter samples (prometheus-client names files by pid)."""
    return {p.stem.split("_")[-1] for p in Path(gw.metrics_dir).glob("counter_*.db")}


def test_counters_sum_over_workers_whichever_served(start_gateway, fake, engine):
    gw = start_gateway(workers=2)
    org = make_org(engine, "metrics-sum")
    sent = 0
    for _ in range(10):  # until both workers have served some (bounded)
        assert set(chat(gw, org, 16)) == {200}
        sent += 16
        if len(pids_with_counters(gw)) >= 2:
            break
    assert len(pids_with_counters(gw)) == 2, "one worker served everything"
    # settlements commit (and are counted) just after their answers: wait for the last
    wait_until(lambda: value(scrape(gw), "kiln_settlement_batch_size_sum") == sent)
    m = scrape(gw)
    assert value(m, "kiln_requests_total", model="fake-model", status="completed") == sent
    assert value(m, "kiln_tokens_total", model="fake-model", kind="prompt") == 10 * sent
    assert value(m, "kiln_tokens_total", model="fake-model", kind="completion") == 5 * sent
    assert value(m, "kiln_cost_usd_total", model="fake-model") == pytest.approx(
        float(Decimal(DEFAULT_COST_NANOS * sent) / 10**9), rel=1e-9)
    for histogram, labels in (("kiln_time_to_first_token_seconds", {"model": "fake-model"}),
                              ("kiln_upstream_latency_seconds", {"model": "fake-model"}),
                              ("kiln_admission_seconds", {})):
        assert value(m, histogram + "_count", **labels) == sent, histogram
        assert value(m, histogram + "_bucket", le="+Inf", **labels) == sent, histogram
        assert value(m, histogram + "_sum", **labels) > 0, histogram
    # settlements are committed in batches: every generation in one, at most one batch each
    batches = value(m, "kiln_settlement_seconds_count")
    assert 1 <= batches <= sent and value(m, "kiln_settlement_seconds_sum") > 0
    assert value(m, "kiln_settlement_batch_size_count") == batches
    assert value(m, "kiln_settlement_batch_size_sum") == sent
    assert value(m, "kiln_in_flight") == 0
    assert not any(name == "kiln_errors_total" for name, _ in m)


def test_errors_by_code_and_the_in_flight_gauge(start_gateway, fake, engine):
    gw = start_gateway(workers=2)
    url = gw.base_url + "/v1/chat/completions"
    org = make_org(engine, "metrics-errors", limit=1)

    def post(body=BODY, headers=org.headers, **kw):
        return requests.post(url, json=body, headers={**headers, **CLOSE}, timeout=60, **kw)

    assert post({**BODY, "model": "no-such-model"}).status_code == 404
    assert post(headers={"Authorization": "Bearer kiln-not-a-key"}).status_code == 401
    fake.enqueue(error_reply(500, "boom"))
    assert post().status_code == 502  # plain-text body: counted by the code raised
    fake.enqueue([Status(200, {"Content-Type": "text/event-stream"}), Hang()])
    stream = post({**BODY, "stream": True}, stream=True)
    assert stream.status_code == 200
    assert post().status_code == 429  # the org's one slot is taken by the open stream
    assert value(scrape(gw), "kiln_in_flight") == 1
    stream.close()  # the client leaves: settled as client_cancelled, the slot comes back
    # The worker counts the cancellation when it notices the client gone: the gauge first,
    # then the request's counter, so wait for both.
    m = wait_until(lambda: (m := scrape(gw)) and value(m, "kiln_in_flight") == 0 and value(
        m, "kiln_requests_total", model="fake-model", status="client_cancelled") and m,
        timeout_s=30)
    for status, code in (("404", "model_not_found"), ("401", "invalid_api_key"),
                         ("502", "upstream_error"), ("429", "rate_limit_exceeded")):
        assert value(m, "kiln_errors_total", http_status=status, code=code) == 1, code
    assert value(m, "kiln_requests_total", model="fake-model", status="upstream_error") == 1
    assert value(m, "kiln_requests_total", model="fake-model", status="client_cancelled") == 1
    assert value(m, "kiln_requests_total", model="fake-model", status="completed") == 0


def test_per_backend_series_and_its_failures_by_kind(start_gateway, fake, engine, tmp_path):
    """``kiln_backend_*``: every try, in flight back to 0, time to first token and tokens/s of
    what it served, and its failures by kind, before its headers and after them."""
    catalog = write_fleet_catalog(tmp_path / "m.toml", [fake.base_url],
                            timeouts="first_byte_s = 30, idle_s = 1")
    gw = start_gateway(models=catalog)
    org = make_org(engine, "metrics-backend")

    def post(stream):
        body = {"model": "fleet-model", "messages": BODY["messages"], "stream": stream}
        r = requests.post(gw.base_url + "/v1/chat/completions", json=body,
                          headers={**org.headers, **CLOSE}, timeout=60)
        return r.status_code, r.text
    began = sse([chat_chunk("Hello", role="assistant")], done=False)
    assert post(False)[0] == 200 and post(True)[0] == 200
    fake.enqueue(began + [Hang()])  # silent after its first token: the idle timeout
    status, text = post(True)
    assert status == 200 and '"code": "upstream_idle_timeout"' in text
    fake.enqueue(began + [Reset()])  # the connection breaks mid-stream
    status, text = post(True)
    assert status == 200 and '"code": "upstream_error"' in text
    fake.enqueue(error_reply(500, "boom"))  # a failed try, before its headers
    assert post(False)[0] == 502
    labels = {"model": "fleet-model", "backend": fake.base_url}
    wait_until(lambda: value(scrape(gw), "kiln_backend_in_flight", **labels) == 0, timeout_s=30)
    m = scrape(gw)
    assert value(m, "kiln_backend_requests_total", **labels) == 5
    assert value(m, "kiln_backend_time_to_first_token_seconds_count", **labels) == 4
    assert value(m, "kiln_backend_tokens_per_second_count", **labels) == 1  # the whole stream
    assert value(m, "kiln_backend_tokens_per_second_sum", **labels) > 0
    for kind in ("upstream_idle_timeout", "upstream_error_after_headers", "upstream_error"):
        assert value(m, "kiln_backend_errors_total", kind=kind, **labels) == 1, kind


def test_counts_survive_a_reload_and_dead_workers_leave_no_in_flight(start_gateway, fake,
                                                                     engine):
    """HUP replaces every worker: the old workers' counters stay in the sums, their live
    gauges leave (child_exit marks them dead)."""
    gw = start_gateway(workers=2)
    org = make_org(engine, "metrics-hup")
    assert set(chat(gw, org, 10)) == {200}
    old = set(gw.worker_pids())
    gw.signal(signal.SIGHUP)
    wait_until(lambda: len(set(gw.worker_pids())) == 2 and not old & set(gw.worker_pids()),
               timeout_s=60, interval_s=0.2)
    assert set(chat(gw, org, 6)) == {200}
    m = scrape(gw)
    assert value(m, "kiln_requests_total", model="fake-model", status="completed") == 16
    assert value(m, "kiln_admission_seconds_count") == 16
    assert value(m, "kiln_in_flight") == 0


def test_openmetrics_when_the_scraper_asks_for_it(gateway):
    accept = "application/openmetrics-text; version=1.0.0"
    resp = requests.get(gateway.base_url + "/metrics", headers={"Accept": accept, **CLOSE},
                        timeout=30)
    assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
    assert "# TYPE kiln_in_flight gauge" in resp.text and resp.text.endswith("# EOF\n")


def test_metrics_without_multiprocess_dir_serve_the_app_registry(tmp_path, monkeypatch):
    """Outside gunicorn (``flask run``, tests calling create_app) the app's own registry is
    served; the same collectors, just this process."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    from gateway import create_app
    app = create_app({"database_url": f"sqlite:///{tmp_path / 'm.db'}", "sweep_interval_s": 0})
    app.extensions["kiln.metrics"].requests.labels("fake-model", "completed").inc(3)
    with app.test_client() as client:
        text = client.get("/metrics").get_data(as_text=True)
    assert 'kiln_requests_total{model="fake-model",status="completed"} 3.0' in text
