"""A fleet of backends through the real gateway (gunicorn, gevent workers) and scripted fake
upstreams: retries before the first byte, timeouts, per-backend caps, the probe, drain and
reload (docs/ROUTING.md). The policies and the breaker in-process: test_routing.py."""
import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from types import SimpleNamespace

import openai
import pytest
import requests
import sqlalchemy as sa

from fake_upstream import FakeUpstream, Hang, Reset, Send, Status, chat_chunk, \
    default_script, error_reply, sse, sse_event
from gateway.billing import Usage, cost_usd, to_nanos
from gateway.contract.catalog import Pricing
from gateway.errors import UpstreamTimeout
from factories import write_fleet_catalog
from gateway_proc import balance_nanos, free_port, make_org, metric, usage_event, wait_until

PRICING = Pricing(Decimal("0.10"), Decimal("0.05"), Decimal("0.30"))
COST = to_nanos(cost_usd(Usage(prompt=10, completion=5), PRICING))  # the fake's usage
GRANT = 10 * 10**9
MESSAGES = [{"role": "user", "content": "Hello"}]
CHAT = "/v1/chat/completions"
PROBE_INTERVAL_S = 0.5

def chat(base_url, org, stream, hold=False, timeout=60):
    """POST a chat request; read the whole answer unless ``hold``."""
    body = {"model": "fleet-model", "messages": MESSAGES, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = requests.post(base_url + CHAT, json=body, headers=org.headers, stream=hold,
                      timeout=timeout)
    if not hold:
        r.close()
    return r


def sdk_call(base_url, key, stream):
    """One request through the official SDK; return the generation id."""
    with openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0,
                       timeout=60) as client:
        call = client.chat.completions.with_raw_response.create(
            model="fleet-model", messages=MESSAGES, stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            chunks = list(call.parse())
            assert chunks[-1].usage.completion_tokens == 5
        else:
            assert call.parse().choices[0].message.content
        return call.headers["X-Neocloud-Generation-Id"]


def events_of(engine, org_id):
    """The org's usage events, once none is pending (settlement commits just after the
    answer: docs/METERING.md)."""
    balance_nanos(engine, org_id)  # waits until the org has no pending event
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(sa.text(
            "SELECT * FROM usage_events WHERE org_id = :o ORDER BY started_at"), {"o": org_id})
            .mappings()]


class Phases:
    """A fake upstream's responder that turns sick on cue: ``sick`` is the script of a sick
    chat request (the probe's GET still answers)."""

    def __init__(self, sick):
        self.sick, self.on = sick, threading.Event()

    def __call__(self, record):
        if self.on.is_set() and record.method == "POST":
            return self.sick
        return default_script(record)


@pytest.fixture
def trio():
    """Three fake upstreams (not started: a test starts the ones it wants listening)."""
    fakes = [FakeUpstream(port=free_port()) for _ in range(3)]
    yield fakes
    for fake in fakes:
        if fake._listener is not None:
            fake.stop()


# -- retries before the first byte ---------------------------------------------------------

def test_a_faulty_fleet_loses_no_request_and_bills_each_once(start_gateway, trio, tmp_path,
                                                             engine):
    """One backend refuses connections (its port is closed), one answers 500 before its
    headers, one hangs before them: every request succeeds, billed once, every try on record.
    The one that answered 500s is back (half-open) only after its cool-down: the probe does not
    bring back a backend whose chat requests failed."""
    refusing, erring, hanging = trio
    erring.default, hanging.default = Phases(error_reply(500, "boom")), Phases([Hang()])
    erring.start(), hanging.start()
    catalog = write_fleet_catalog(tmp_path / "m.toml", [f.base_url for f in trio],
                            timeouts="first_byte_s = 1")
    gw = start_gateway(workers=2, models=catalog, probe_interval_s=0.5, upstream_retries=2)
    org = make_org(engine, "fleet-faults")
    gids = []
    for phase in (erring.default, hanging.default):
        phase.on.set()
        with ThreadPoolExecutor(6) as pool:
            gids += pool.map(lambda i: sdk_call(gw.base_url, org.key, i % 2 == 0), range(24))
        phase.on.clear()
        wait_until(lambda: metric(gw.base_url, "kiln_backend_state", backend=erring.base_url)
                   < 2, timeout_s=70)  # in every worker: with the hanging one alone, 502s
    events = [usage_event(engine, gid) for gid in gids]
    assert {e["status"] for e in events} == {"completed"}
    assert all(e["cost_nanos"] == COST for e in events)
    assert balance_nanos(engine, org.id) == (GRANT - COST * len(gids), 0, 0)  # billed once
    assert len(events_of(engine, org.id)) == len(gids)
    attempts = [json.loads(e["attempts"]) for e in events]
    assert all(a[-1] == e["backend"] != refusing.base_url for a, e in zip(attempts, events,
                                                                          strict=True))
    retried = [a for a in attempts if len(a) > 1]
    assert {erring.base_url, hanging.base_url} <= {u for a in retried for u in a[:-1]}
    # A hung try's connection was closed; the fake notices a close at its next poll, which
    # may come after the client has its answer from another backend.
    hanging.wait_for(lambda rs: all(r.closed_at is not None for r in rs
                                    if r.method == "POST" and not r.completed))
    assert metric(gw.base_url, "kiln_backend_errors_total", backend=erring.base_url,
                  kind="upstream_error") >= 1
    assert metric(gw.base_url, "kiln_backend_errors_total", backend=hanging.base_url,
                  kind="upstream_first_byte_timeout") >= 1
    assert metric(gw.base_url, "kiln_backend_state", backend=refusing.base_url) == 2


def test_a_non_stream_reply_that_breaks_off_is_retried_elsewhere(start_gateway, trio, tmp_path,
                                                                  engine):
    """A backend answers 200 and resets the connection mid-body: nothing reached the client,
    so the request goes to another backend like a failure before the status line, and is
    billed once, for the reply it got."""
    broken, healthy = trio[:2]
    broken.default = lambda record: default_script(record) if record.method == "GET" else [
        Status(200, {"Content-Type": "application/json", "Content-Length": "4000"}),
        Send(b'{"id": "chatcmpl-cut", "choices": [{"index": 0, "message": {"content": "'),
        Reset()]
    broken.start(), healthy.start()
    catalog = write_fleet_catalog(tmp_path / "m.toml", [broken.base_url, healthy.base_url],
                            routing="weighted")
    gw = start_gateway(workers=1, models=catalog, probe_interval_s=0, upstream_retries=2)
    org = make_org(engine, "fleet-cut-body")
    gids = [sdk_call(gw.base_url, org.key, stream=False) for _ in range(12)]
    events = [usage_event(engine, gid) for gid in gids]
    assert {(e["status"], e["cost_nanos"], e["backend"]) for e in events} == \
        {("completed", COST, healthy.base_url)}
    retried = [json.loads(e["attempts"]) for e in events if len(json.loads(e["attempts"])) > 1]
    assert retried and all(a == [broken.base_url, healthy.base_url] for a in retried)
    assert balance_nanos(engine, org.id) == (GRANT - COST * len(gids), 0, 0)
    assert any(r.method == "POST" for r in broken.requests)


def test_a_reply_over_the_bound_is_neither_retried_nor_held_against_its_backend(
        start_gateway, trio, tmp_path, engine):
    """Both backends answer 200 with a reply larger than Kiln reads for the request
    (docs/RELIABILITY.md, "Big answers"): each request is tried once (another backend would
    generate it again), gets 502 ``upstream_too_large`` in the error envelope and is billed
    what was generated; no breaker opens, though one failure would open it."""
    big = json.dumps({"id": "chatcmpl-big", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "z" * 300_000},
         "finish_reason": "stop"}]}).encode()
    oversized = [Status(200, {"Content-Type": "application/json",
                              "Content-Length": str(len(big))}, chunked=False), Send(big)]
    for fake in trio[:2]:
        fake.default = lambda record: default_script(record) if record.method == "GET" \
            else oversized
        fake.start()
    catalog = write_fleet_catalog(tmp_path / "m.toml", [f.base_url for f in trio[:2]],
                                  routing="weighted")
    gw = start_gateway(workers=1, models=catalog, probe_interval_s=0, upstream_retries=2,
                       breaker_failures=1)
    org = make_org(engine, "fleet-too-large")
    gids = []
    for _ in range(16):  # weighted at random: each backend serves some (all but 2**-15)
        r = requests.post(gw.base_url + CHAT, headers=org.headers, timeout=60,
                          json={"model": "fleet-model", "messages": MESSAGES, "max_tokens": 50})
        assert r.status_code == 502 and r.headers["Content-Type"] == "application/json"
        error = r.json()["error"]
        assert error["code"] == "upstream_too_large" and "larger than" in error["message"]
        gids.append(r.headers["X-Neocloud-Generation-Id"])
    events = [usage_event(engine, gid) for gid in gids]
    assert all(len(json.loads(e["attempts"])) == 1 for e in events)  # never retried
    assert sum(1 for f in trio[:2] for r in f.requests if r.method == "POST") == len(gids)
    assert {(e["status"], e["error_code"], e["completion_tokens"], e["estimated"])
            for e in events} == {("upstream_error", "upstream_too_large", 50, True)}
    assert all(e["cost_nanos"] > 0 for e in events)  # billed: the backend generated
    # Both stay in rotation: one failure would have taken the first out for its cool-down.
    assert {e["backend"] for e in events} == {f.base_url for f in trio[:2]}
    for fake in trio[:2]:
        assert metric(gw.base_url, "kiln_backend_errors_total", backend=fake.base_url,
                      kind="upstream_too_large") >= 1
        assert not metric(gw.base_url, "kiln_backend_errors_total", backend=fake.base_url,
                          kind="upstream_error")
    total = sum(e["cost_nanos"] for e in events)
    assert balance_nanos(engine, org.id) == (GRANT - total, 0, 0)


def test_a_first_byte_timeout_is_a_plain_502_that_names_it(start_gateway, fake, tmp_path,
                                                           engine):
    catalog = write_fleet_catalog(tmp_path / "m.toml", [fake.base_url], timeouts="first_byte_s = 1")
    gw = start_gateway(models=catalog, keepalive_s=10)
    org = make_org(engine, "fleet-first-byte")
    for stream in (False, True):
        fake.enqueue([Hang()])
        began = time.monotonic()
        r = chat(gw.base_url, org, stream)
        assert 1 <= time.monotonic() - began < 1 + 1.5  # at the timeout, not after
        assert r.status_code == 502 and r.headers["Content-Type"].startswith("text/plain")
        assert "first byte timeout" in r.text
        event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
        assert event["status"] == "timeout"
        assert event["error_code"] == "upstream_first_byte_timeout"
        assert event["cost_nanos"] == 0
        wait_until(lambda: fake.requests[-1].closed_at is not None)  # the upstream was closed
    assert balance_nanos(engine, org.id) == (GRANT, 0, 0)


def test_an_idle_timeout_ends_the_stream_with_an_error_event(start_gateway, fake, tmp_path,
                                                             engine):
    catalog = write_fleet_catalog(tmp_path / "m.toml", [fake.base_url],
                            timeouts="first_byte_s = 30, idle_s = 1")
    gw = start_gateway(models=catalog)
    org = make_org(engine, "fleet-idle")
    head, first = sse([chat_chunk("Hello", role="assistant")], done=False)
    fake.enqueue([head, first, Hang()])
    r = chat(gw.base_url, org, stream=True)
    assert r.status_code == 200
    body = r.content.decode()
    events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert json.loads(events[-1])["error"]["code"] == "upstream_idle_timeout"
    assert "[DONE]" not in body
    event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
    assert (event["status"], event["error_code"]) == ("timeout", "upstream_idle_timeout")
    assert event["completion_tokens"] > 0 and event["cost_nanos"] > 0  # what was generated
    wait_until(lambda: fake.requests[-1].closed_at is not None)


# -- capacity ------------------------------------------------------------------------------

def test_a_backend_at_its_cap_makes_the_next_request_wait_then_503(start_gateway, fake,
                                                                   tmp_path, engine):
    catalog = write_fleet_catalog(tmp_path / "m.toml", [fake.base_url], caps=[1])
    gw = start_gateway(workers=2, models=catalog, backend_wait_s=1,
                       slot_dir=str(tmp_path / "slots"))
    org = make_org(engine, "fleet-cap")
    fake.enqueue([Status(200, {"Content-Type": "text/event-stream"}),
                  Send(sse_event(chat_chunk("a", role="assistant"))), Hang()])
    with chat(gw.base_url, org, stream=True, hold=True) as holding:
        lines = holding.iter_lines()  # kept: a dropped iterator closes the connection
        next(lines)  # the only slot is taken (whichever worker serves the next request)
        for stream in (False, True, False):
            r = chat(gw.base_url, org, stream)
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            assert r.json()["error"]["code"] == "backends_at_capacity"
            assert "X-Neocloud-Generation-Id" not in r.headers  # never admitted
        assert fake.active == 1
    assert len(events_of(engine, org.id)) == 1
    wait_until(lambda: chat(gw.base_url, org, False).status_code == 200, timeout_s=30)


# -- health --------------------------------------------------------------------------------

def test_the_probe_takes_a_dead_backend_out_and_brings_it_back(start_gateway, trio, tmp_path,
                                                               engine):
    coming, steady = trio[0], trio[1]
    steady.start()
    catalog = write_fleet_catalog(tmp_path / "m.toml", [coming.base_url, steady.base_url])
    gw = start_gateway(models=catalog, probe_interval_s=PROBE_INTERVAL_S)
    org = make_org(engine, "fleet-probe")
    wait_until(lambda: metric(gw.base_url, "kiln_backend_state", backend=coming.base_url) == 2,
               timeout_s=30)
    for stream in (False, True) * 3:  # out of rotation: no request even tries it
        assert chat(gw.base_url, org, stream).status_code == 200
    assert all(json.loads(e["attempts"]) == [steady.base_url]
               for e in events_of(engine, org.id))
    coming.start()  # it answers its probe path from now on
    answering = time.monotonic()
    wait_until(lambda: chat(gw.base_url, org, False) and any(
        r.method == "POST" for r in coming.requests), timeout_s=PROBE_INTERVAL_S + 1)
    routed = min(r.received_at for r in coming.requests if r.method == "POST")
    assert routed - answering <= PROBE_INTERVAL_S + 1  # back within one probe interval
    wait_until(lambda: metric(gw.base_url, "kiln_backend_state", backend=coming.base_url) == 0,
               timeout_s=5)


# -- drain and reload ----------------------------------------------------------------------

def test_drain_by_weight_zero_and_reload_lose_no_request(start_gateway, trio, tmp_path,
                                                         engine):
    """A HUP (``systemctl reload``) applies a catalog that drains a backend: the stream it
    serves finishes, new requests go elsewhere, and no request fails meanwhile."""
    for fake in trio[:2]:
        fake.start()
    urls = [f.base_url for f in trio[:2]]
    catalog = write_fleet_catalog(tmp_path / "m.toml", urls, weights=[1, 1])
    gw = start_gateway(workers=2, models=catalog)
    org = make_org(engine, "fleet-drain", usd="100", limit=32)
    long_events = [chat_chunk(f"t{i}", role="assistant" if i == 0 else None) for i in range(30)]
    for fake in trio[:2]:
        fake.enqueue(sse(long_events + [chat_chunk(finish_reason="stop")], delay_s=0.1))
    long = chat(gw.base_url, org, True, hold=True)
    draining = wait_until(lambda: next((f for f in trio[:2] if f.requests), None))
    staying = trio[1] if draining is trio[0] else trio[0]
    staying.clear()  # its copy of the long script was not used
    stop, failures, done = threading.Event(), [], []

    def traffic():
        while not stop.is_set():
            r = chat(gw.base_url, org, len(done) % 2 == 0)
            body = r.content
            if r.status_code != 200 or (r.headers["Content-Type"].startswith(
                    "text/event-stream") and not body.endswith(b"data: [DONE]\n\n")):
                failures.append((r.status_code, body[:200]))
            done.append(r.status_code)
    clients = [threading.Thread(target=traffic) for _ in range(3)]
    for t in clients:
        t.start()
    old = set(gw.worker_pids())
    write_fleet_catalog(catalog, urls, weights=[0 if u == draining.base_url else 1 for u in urls])
    gw.signal(signal.SIGHUP)
    wait_until(lambda: not old & set(gw.worker_pids()) and len(gw.worker_pids()) == 2,
               timeout_s=60, interval_s=0.2)
    long_body = long.content  # the old worker let it finish
    seen = len(draining.requests)
    count = len(done)
    wait_until(lambda: len(done) >= count + 20, timeout_s=60)
    stop.set()
    for t in clients:
        t.join()
    assert failures == [] and len(done) >= 20
    assert long_body.endswith(b"data: [DONE]\n\n") and b"t29" in long_body
    assert len(draining.requests) == seen  # drained: nothing new after the reload
    assert len(staying.requests) >= 20


# -- a connect timeout, in-process -----------------------------------------------------------

@pytest.fixture
def full_backlog():
    """A port whose listener never accepts and whose backlog is full: a connect to it times
    out (the kernel drops the SYN)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    yield f"http://127.0.0.1:{port}/v1"
    for sock in fillers + [listener]:
        sock.close()


def test_a_connect_timeout_names_itself_and_is_retried_elsewhere(full_backlog, fake, tmp_path):
    from gateway.backends import upstream
    from gateway.contract.catalog import Backend
    from gateway.config import Config
    from gateway.backends.fleet import Route
    from gateway.ops.metrics import Metrics
    from gateway.backends.health import BackendStates
    services = SimpleNamespace(config=Config.from_mapping({"slot_dir": str(tmp_path)}),
                               metrics=Metrics(), states=BackendStates())
    silent, alive = Backend(url=full_backlog, model="m"), Backend(url=fake.base_url, model="m")
    entry = SimpleNamespace(id="m", backends=(silent, alive), routing="weighted",
                            load_bound=1.5)
    session = upstream.create_session(4)
    with pytest.raises(UpstreamTimeout) as err:
        upstream.open_chat(session, silent, b"{}", (0.5, 5))
    assert err.value.code == "upstream_connect_timeout"

    def route_via_silent():  # a route whose first try is the silent backend (weighted draw)
        route = Route(services, entry, MESSAGES)
        if route.take(0) is silent:
            return route
        route.release()
        return None
    route = wait_until(route_via_silent)
    resp = route.open(lambda b, timeouts_s: upstream.open_chat(session, b, json.dumps(
        {"model": "m", "messages": MESSAGES}).encode(), timeouts_s), (0.5, 5))
    assert resp.status_code == 200 and route.tried == [silent.url, alive.url]
    resp.close()
    route.release()
    assert not services.states[silent].breaker.is_up(time.monotonic())  # out at once


def test_a_stream_is_not_retried_once_its_backend_answered_2xx(start_gateway, trio, tmp_path,
                                                               engine):
    """docs/ROUTING.md, "Retries before the first byte": two live backends, retries allowed,
    and each answers a stream 200, one token, then resets the connection. Each request is tried
    on one backend only (its bytes were already the client's answer): the client gets the
    token and an error event, never a second answer spliced on, and the try is on record."""
    first, second = trio[:2]
    for backend in (first, second):
        backend.default = lambda record: default_script(record) if record.method == "GET" else [
            Status(200, {"Content-Type": "text/event-stream"}),
            Send(sse_event(chat_chunk("Hello", role="assistant"))), Reset()]
        backend.start()
    catalog = write_fleet_catalog(tmp_path / "m.toml", [first.base_url, second.base_url],
                                  routing="weighted")
    gw = start_gateway(workers=1, models=catalog, probe_interval_s=0, upstream_retries=2)
    org = make_org(engine, "fleet-no-retry-2xx")
    answers = [chat(gw.base_url, org, stream=True) for _ in range(8)]
    for r in answers:
        assert r.status_code == 200
        data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert json.loads(data[0])["choices"][0]["delta"]["content"] == "Hello"
        assert "error" in json.loads(data[-1]) and "[DONE]" not in r.text
        assert sum(1 for line in data if '"content": "Hello"' in line
                   or '"content":"Hello"' in line) == 1
    posts = [r for backend in (first, second) for r in backend.requests if r.method == "POST"]
    assert len(posts) == len(answers)  # one try per request, on either backend
    for r in answers:
        event = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])
        assert len(json.loads(event["attempts"])) == 1, event["attempts"]
        assert event["status"] != "completed"
    assert {r.headers["X-Neocloud-Generation-Id"] for r in answers} == \
        {e["id"] for e in events_of(engine, org.id)}


def test_prefix_affinity_keeps_each_conversation_on_one_backend_through_the_gateway(
        start_gateway, trio, tmp_path, engine):
    """docs/ROUTING.md, "prefix-affinity": through gunicorn (two workers, each choosing on its
    own), every turn of a conversation reaches the backend that served its first turn, whichever
    worker takes it, and the conversations spread over both backends. One request at a time,
    so no backend is over its bounded load."""
    first, second = trio[:2]
    first.start(), second.start()
    catalog = write_fleet_catalog(tmp_path / "m.toml", [first.base_url, second.base_url],
                                  routing="prefix-affinity")
    gw = start_gateway(workers=2, models=catalog, probe_interval_s=0)
    org = make_org(engine, "fleet-affinity")
    homes = {}
    for turn in range(3):
        for c in range(12):
            messages = [{"role": "system", "content": f"You are assistant {c}."},
                        {"role": "user", "content": f"Question {c}"}]
            for k in range(turn):
                messages += [{"role": "assistant", "content": f"Answer {k}"},
                             {"role": "user", "content": f"Follow-up {k}"}]
            r = requests.post(gw.base_url + CHAT, headers=org.headers, timeout=60,
                              json={"model": "fleet-model", "messages": messages})
            assert r.status_code == 200, r.text
            backend = usage_event(engine, r.headers["X-Neocloud-Generation-Id"])["backend"]
            homes.setdefault(c, set()).add(backend)
    assert all(len(backends) == 1 for backends in homes.values()), homes
    assert {b for backends in homes.values() for b in backends} == \
        {first.base_url, second.base_url}
    served = [r for f in (first, second) for r in f.requests if r.method == "POST"]
    assert len(served) == 36
