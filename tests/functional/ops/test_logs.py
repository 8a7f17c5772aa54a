"""The request log through real gunicorn: one JSON line per request on stdout (gunicorn's own
lines on stderr), with ids, org, key prefix, model, backend, status, tokens, cost and timings;
never the key, never message content — not even when a backend echoes the content back."""
import json
import os
import subprocess
import sys
import uuid
from decimal import Decimal
from pathlib import Path

import pytest
import requests

from fake_upstream import Hang, Status, chat_chunk, error_reply, json_reply, sse
from gateway.api.auth import PREFIX_LEN
from gateway_proc import ROOT, Gateway, gateway_env, make_org, wait_until

pytestmark = pytest.mark.postgres

SECRET = "Zanzibar-Quokka-4417"  # a word that must never reach the log
CLOSE = {"Connection": "close"}
GENERATION_FIELDS = {"event", "generation_id", "org_id", "key_prefix", "model", "backend",
                     "stream", "status", "http_status", "prompt_tokens", "cached_tokens",
                     "completion_tokens", "estimated", "prompt_counted_by",
                     "completion_counted_by", "cost_usd", "ttft_ms", "duration_ms"}


class SplitLogGateway(Gateway):
    """The test gateway with gunicorn's stdout and stderr in separate files."""

    def start(self, timeout_s=30):
        self.out_path, self.err_path = self.log_path + ".out", self.log_path + ".err"
        self._out, self._err = open(self.out_path, "ab"), open(self.err_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "-c", str(ROOT / "deploy" / "gunicorn.conf.py"),
             "gateway.wsgi:app"], cwd=ROOT, env=self.env, stdout=self._out, stderr=self._err)
        wait_until(self._healthy, timeout_s=timeout_s, interval_s=0.1)
        return self

    def _healthy(self):
        assert self.proc.poll() is None, Path(self.err_path).read_text()
        try:
            return requests.get(self.base_url + "/healthz", headers=CLOSE,
                                timeout=1).status_code == 200
        except requests.RequestException:
            return False

    def stdout(self):
        return Path(self.out_path).read_text(errors="replace")

    def stderr(self):
        return Path(self.err_path).read_text(errors="replace")

    def stop(self, timeout_s=30):
        super().stop(timeout_s)
        self._out.close()
        self._err.close()


@pytest.fixture
def split_gateway(pg_url, catalog_path):
    gw = SplitLogGateway(gateway_env(pg_url, catalog_path), workers=2).start()
    yield gw
    gw.stop()


def records(gw):
    """Return every stdout line parsed as JSON (a line that is not JSON fails the test)."""
    return [json.loads(line) for line in gw.stdout().splitlines() if line.strip()]


def post(gw, org_headers, body, timeout=60, **kw):
    return requests.post(gw.base_url + "/v1/chat/completions", json=body,
                         headers={**org_headers, **CLOSE}, timeout=timeout, **kw)


def messages(text):
    return [{"role": "system", "content": f"Keep this private: {SECRET}."},
            {"role": "user", "content": [{"type": "text", "text": f"{SECRET} {text}"}]}]


def test_one_json_line_per_generation_without_key_or_content(split_gateway, fake, engine):
    gw = split_gateway
    org = make_org(engine, "logs-generation")
    fake.enqueue(json_reply({"id": "c", "object": "chat.completion", "created": 0,
                             "model": "fake-model", "usage": {"prompt_tokens": 12,
                                                              "completion_tokens": 34},
                             "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                 "role": "assistant", "content": f"Echo: {SECRET}"}}]}))
    plain = post(gw, org.headers, {"model": "fake-model", "messages": messages("hi")})
    fake.enqueue(sse([chat_chunk(f"{SECRET}!"), chat_chunk(finish_reason="stop"),
                      chat_chunk(choices=False, usage={"prompt_tokens": 7,
                                                       "completion_tokens": 1})]))
    streamed = post(gw, org.headers, {"model": "fake-model", "messages": messages("go"),
                                      "stream": True})
    assert plain.status_code == streamed.status_code == 200 and "[DONE]" in streamed.text
    gids = [r.headers["X-Neocloud-Generation-Id"] for r in (plain, streamed)]
    lines = wait_until(lambda: (g := [r for r in records(gw) if r.get("event") == "generation"])
                       and len(g) == 2 and g)
    assert {line["generation_id"] for line in lines} == set(gids)
    first = next(line for line in lines if line["generation_id"] == gids[0])
    assert GENERATION_FIELDS <= set(first)
    assert (first["org_id"], first["key_prefix"]) == (org.id, org.key[:PREFIX_LEN])
    assert (first["model"], first["backend"]) == ("fake-model", fake.base_url)
    assert (first["status"], first["http_status"], first["stream"]) == ("completed", 200, False)
    assert (first["prompt_tokens"], first["completion_tokens"]) == (12, 34)
    # 12 x 0.10 + 34 x 0.30 micro-dollars: 11,400 nano-dollars.
    assert Decimal(first["cost_usd"]) == Decimal("0.0000114")
    assert first["ttft_ms"] >= 0 and first["duration_ms"] >= first["ttft_ms"]
    second = next(line for line in lines if line["generation_id"] == gids[1])
    assert (second["stream"], second["completion_tokens"]) == (True, 1)
    assert_never_logged(gw, org.key)


def test_backend_errors_that_echo_the_content_stay_out_of_the_log(split_gateway, fake, engine):
    """A FastAPI model server (llama-cpp-python) answers a bad request with 422 and the
    offending input in ``detail``; another backend's short 400 message may quote the prompt; a
    backend may also end a stream with an error event that quotes it. The client gets those
    messages (the 422's without its echo of the input); the log does not."""
    gw = split_gateway
    org = make_org(engine, "logs-echo")
    detail = {"detail": [{"type": "string_type", "loc": ["body", "messages", 0, "content"],
                          "msg": "Input should be a valid string", "input": SECRET}]}
    fake.enqueue(json_reply(detail, status=422))
    rejected = post(gw, org.headers, {"model": "fake-model", "messages": messages("a")})
    assert rejected.status_code == 400 and "Input should be a valid string" in rejected.text
    assert SECRET not in rejected.text
    fake.enqueue(error_reply(400, f"unsupported content '{SECRET}'"))
    quoted = post(gw, org.headers, {"model": "fake-model", "messages": messages("c")})
    assert quoted.status_code == 400 and SECRET in quoted.text
    fake.enqueue([Status(200, {"Content-Type": "text/event-stream"})] + sse(
        [chat_chunk("x"), {"error": {"message": f"prompt '{SECRET}' hit a filter"}}],
        done=False)[1:])
    failed = post(gw, org.headers, {"model": "fake-model", "messages": messages("b"),
                                    "stream": True})
    assert SECRET in failed.text and "[DONE]" not in failed.text
    lines = wait_until(lambda: (g := [r for r in records(gw) if r.get("event") == "generation"])
                       and len(g) == 3 and g)
    assert sorted(line["status"] for line in lines) == ["rejected", "rejected", "upstream_error"]
    assert_never_logged(gw, org.key)


def test_rejected_requests_get_a_line_too_probes_do_not(split_gateway, fake, engine):
    gw = split_gateway
    org = make_org(engine, "logs-rejected")
    wrong_key = "kiln-" + SECRET
    assert post(gw, {"Authorization": f"Bearer {wrong_key}"},
                {"model": "fake-model", "messages": messages("c")}).status_code == 401
    assert post(gw, org.headers, {"model": "no-such-model",
                                  "messages": messages("d")}).status_code == 404
    assert post(gw, org.headers, {"model": "fake-model", "messages": []}).status_code == 400
    for path in ("/healthz", "/readyz", "/metrics"):
        assert requests.get(gw.base_url + path, headers=CLOSE, timeout=30).status_code == 200
    lines = wait_until(lambda: (r := [x for x in records(gw) if x.get("event") == "request"])
                       and len(r) == 3 and r)
    by_status = {line["http_status"]: line for line in lines}
    assert by_status[401]["code"] == "invalid_api_key" and by_status[401]["org_id"] is None
    assert by_status[404]["code"] == "model_not_found"
    assert (by_status[404]["org_id"], by_status[404]["key_prefix"]) == (
        org.id, org.key[:PREFIX_LEN])
    assert by_status[400]["code"] == "empty_array"
    assert {line["path"] for line in lines} == {"/v1/chat/completions"}
    assert all(line["duration_ms"] >= 0 for line in lines)
    assert fake.requests == []
    assert_never_logged(gw, org.key, wrong_key)


def test_a_client_that_leaves_gets_one_line(split_gateway, fake, engine):
    """A stream client that gives up while the backend is silent: one generation line
    (``client_cancelled``), no second line for the 499 nobody received."""
    gw = split_gateway
    org = make_org(engine, "logs-gone")
    fake.enqueue([Hang()])
    with pytest.raises(requests.ReadTimeout):
        post(gw, org.headers, {"model": "fake-model", "messages": messages("e"),
                               "stream": True}, timeout=(10, 1))
    wait_until(lambda: records(gw), timeout_s=30)
    assert_never_logged(gw, org.key)  # stops the gateway: every line is written by now
    assert [(r["event"], r.get("status"), r["http_status"]) for r in records(gw)] == [
        ("generation", "client_cancelled", 499)]


def assert_never_logged(gw, *keys):
    """Neither stream of gunicorn's output holds a key or the secret word."""
    gw.stop()  # flush and close: everything the workers wrote is in the files now
    for name, text in (("stdout", gw.stdout()), ("stderr", gw.stderr())):
        for secret in (SECRET, *keys):
            assert secret not in text, f"{secret!r} found in gunicorn's {name}"
    assert "Booting worker" in gw.stderr() and "Booting worker" not in gw.stdout()
    assert os.path.getsize(gw.out_path) > 0


def test_client_address_comes_from_forwarded_for_only_behind_a_trusted_proxy(split_gateway,
                                                                             fake, engine):
    """nginx (on loopback, trusted by default) sets X-Forwarded-For: the log names that client;
    with no trusted proxy configured the same header is ignored and the peer is named."""
    org = make_org(engine, f"logs-xff-{uuid.uuid4().hex[:8]}")
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    r = post(split_gateway, {**org.headers, "X-Forwarded-For": "198.51.100.7, 203.0.113.9"}, body)
    assert r.status_code == 200
    gid = r.headers["X-Neocloud-Generation-Id"]
    line = wait_until(lambda: next((x for x in records(split_gateway)
                                    if x.get("generation_id") == gid), None))
    assert line["client_addr"] == "203.0.113.9"  # the entry the trusted proxy appended


def test_forwarded_for_from_an_untrusted_peer_is_ignored(pg_url, catalog_path, fake, engine):
    gw = SplitLogGateway(gateway_env(pg_url, catalog_path, trusted_proxies="192.0.2.1"),
                         workers=1).start()
    try:
        org = make_org(engine, f"logs-noxff-{uuid.uuid4().hex[:8]}")
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
        r = post(gw, {**org.headers, "X-Forwarded-For": "203.0.113.9"}, body)
        gid = r.headers["X-Neocloud-Generation-Id"]
        line = wait_until(lambda: next((x for x in records(gw)
                                        if x.get("generation_id") == gid), None))
        assert line["client_addr"] == "127.0.0.1"
    finally:
        gw.stop()
