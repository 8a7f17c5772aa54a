"""Large bodies are parsed and checked in the worker's child process (gateway/api/body_process.py).

In process, with Flask's test client on a Kiln over SQLite: every row of the contract table,
padded with JSON whitespace past the inline threshold, gets through the child exactly the
answer it gets inline, and leaves nothing behind; the worker itself never parses a body the
child refuses; a child that dies or hangs costs one request a 503, and the next body gets a
new child.
"""
import json
import os
import signal

import pytest

import factories
from contract_table import REJECTED, START_NANOS, trace
from gateway.api import intake
from gateway.api.body_process import BodyProcess
from gateway.errors import InvalidRequest, ServiceUnavailable

pytestmark = pytest.mark.unit
PAD = b" " * intake.INLINE_BYTES  # whitespace: the same JSON, but a large body


@pytest.fixture(scope="module", autouse=True)
def parse_at_once():
    """Parses here take no turns (the budget's share of time is tested in test_intake.py)."""
    share = intake.PARSE_SHARE
    intake.PARSE_SHARE = 1.0
    yield
    intake.PARSE_SHARE = share


def post(app, org, raw):
    return app.test_client().post("/v1/chat/completions", data=raw, headers=org.headers,
                                  content_type="application/json")


@pytest.mark.parametrize("body,status,code,param",
                         [pytest.param(*case[1:], id=case[0]) for case in REJECTED])
def test_a_large_body_gets_the_answer_a_small_one_gets(kiln, org, body, status, code, param):
    app, engine = kiln
    small = post(app, org, json.dumps(body).encode())
    large = post(app, org, json.dumps(body).encode() + PAD)
    assert (small.status_code, small.get_json()["error"]["code"],
            small.get_json()["error"]["param"]) == (status, code, param)
    assert large.status_code == small.status_code
    assert large.get_json() == small.get_json()
    assert trace(engine, org.id) == (0, 0, START_NANOS, 0, 0)


def test_a_valid_large_body_is_served_as_parsed_by_the_child(kiln):
    """The control row: through the child, a valid body is admitted (and then finds no
    backend: a 502 with its usage event, nothing charged)."""
    app, engine = kiln
    other = factories.org(engine)
    r = post(app, other, json.dumps(factories.chat_body()).encode() + PAD)
    assert r.status_code == 502 and r.headers.get("X-Neocloud-Generation-Id"), r.data
    assert trace(engine, other.id) == (1, 0, START_NANOS, 0, 0)


def test_a_large_bodys_request_is_checked_in_the_child_not_again_in_the_worker(kiln,
                                                                              monkeypatch):
    """The child answers the canonical request its codec built: the worker's event loop does
    not check the body a second time."""
    app, engine = kiln
    import gateway.dialects.chat
    checked, real = [], gateway.dialects.chat.validate_chat
    monkeypatch.setattr(gateway.dialects.chat, "validate_chat",
                        lambda *args: checked.append(args[2]) or real(*args))
    other = factories.org(engine)
    # Accepted, then no backend: 502 (or 503 once its failures opened the breaker).
    r = post(app, other, json.dumps(factories.chat_body()).encode() + PAD)
    assert r.status_code == 502 or r.get_json()["error"]["code"] == "no_backend_available"
    assert checked == []
    small = json.dumps(factories.chat_body()).encode()
    assert post(app, other, small).status_code in (502, 503) and checked == [len(small)]


def test_the_worker_never_parses_a_large_body_the_child_refuses(kiln, org, monkeypatch):
    app, _ = kiln
    parsed = []
    import gateway.api.bodies
    real = gateway.api.bodies.parse_json_body
    monkeypatch.setattr(gateway.api.bodies, "parse_json_body",
                        lambda raw, *args: parsed.append(len(raw)) or real(raw, *args))
    many = {"model": "fake-vision",
            "messages": [{"role": "user", "content": "x"}] * (32768 + 1)}
    r = post(app, org, json.dumps(many).encode())
    assert len(json.dumps(many)) > intake.INLINE_BYTES
    assert (r.status_code, r.get_json()["error"]["code"]) == (400, "context_length_exceeded")
    assert r.get_json()["error"]["param"] == "messages"
    assert parsed == []
    small = post(app, org, json.dumps({"model": "fake-model"}).encode())
    assert small.status_code == 400 and parsed == [len(json.dumps({"model": "fake-model"}))]


def test_more_messages_than_the_context_window_has_tokens_cannot_fit(kiln, org):
    app, engine = kiln
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "x"}] * 8193}
    r = post(app, org, json.dumps(body).encode())
    assert r.status_code == 400
    assert (r.get_json()["error"]["code"], r.get_json()["error"]["param"]) == (
        "context_length_exceeded", "messages")
    assert trace(engine, org.id) == (0, 0, START_NANOS, 0, 0)


@pytest.fixture
def checker(kiln):
    app, _ = kiln
    process = BodyProcess(app.config["KILN"].models, app.config["KILN"].max_body_bytes,
                          timeout_s=3)  # a check takes milliseconds; a loaded host, more
    process.start()
    yield process
    process.stop()


def valid_raw():
    return json.dumps(factories.chat_body()).encode() + PAD


def test_a_child_that_died_is_replaced_before_the_next_body(checker):
    assert checker.check(valid_raw(), "application/json") == factories.chat_body()
    first = checker._proc.pid
    os.kill(first, signal.SIGKILL)
    checker._proc.wait()
    assert checker.check(valid_raw(), "application/json") == factories.chat_body()
    assert checker._proc.pid != first


def test_a_child_that_hangs_costs_one_request_a_503(checker):
    assert checker.check(valid_raw(), "application/json") == factories.chat_body()
    stuck = checker._proc
    os.kill(stuck.pid, signal.SIGSTOP)
    try:
        with pytest.raises(ServiceUnavailable) as refused:
            checker.check(valid_raw(), "application/json")
    finally:
        if stuck.poll() is None:
            os.kill(stuck.pid, signal.SIGCONT)
    assert refused.value.code == "server_busy" and refused.value.headers["Retry-After"] == "1"
    assert stuck.poll() is not None  # killed, not left behind
    assert checker.check(valid_raw(), "application/json") == factories.chat_body()


def test_the_childs_errors_come_back_whole(checker):
    with pytest.raises(InvalidRequest) as err:
        checker.check(b'{"model": "fake-model", "messages": [' + PAD, "application/json")
    assert err.value.status == 400 and err.value.code == "invalid_json"
    with pytest.raises(InvalidRequest) as err:
        checker.check(valid_raw(), "text/plain")
    assert err.value.code == "invalid_content_type"
