"""Catalog backends' API keys through the real gateway (gunicorn, gevent workers) and a scripted
fake upstream (docs/ROUTING.md, "Keys"): every request a keyed backend gets carries its key as
``Authorization: Bearer`` (chat, stream and not, completions, embeddings, the tokenize call, the
probe), a backend without a key gets none, and the key is nowhere in what the gateway shows or
logs. A key that cannot be read stops the gateway from starting."""
import pytest
import requests

from fake_upstream import CHAT_PATH, COMPLETIONS_PATH, EMBEDDINGS_PATH, FakeUpstream, \
    chat_chunk, json_reply, sse
from gateway_proc import Gateway, gateway_env, wait_until

SECRET = "sk-backend-fleet-5f1e2d3c4b5a"
VARIABLE = "KILN_TEST_BACKEND_KEY"
TOKENIZE_PATH = "/v1/extras/tokenize/count"
CATALOG = """
[[models]]
id = "keyed"
context_window = 4096
max_output_tokens = 256
endpoints = ["chat", "completions"]
pricing = {{ input = "0.10", cached_input = "0.05", output = "0.30" }}
[[models.backends]]
url = "{url}"
model = "keyed-up"
api_key_env = "{variable}"
tokenize_url = "{url}/extras/tokenize/count"

[[models]]
id = "keyed-embed"
context_window = 512
endpoints = ["embeddings"]
pricing = {{ input = "0.02" }}
backends = [{{ url = "{url}", model = "embed-up", api_key_file = "{key_file}" }}]

[[models]]
id = "open"
context_window = 4096
max_output_tokens = 256
pricing = {{ input = "0.10", cached_input = "0.05", output = "0.30" }}
backends = [{{ url = "{url}", model = "open-up" }}]
"""
MESSAGES = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def keyed(tmp_path, pg_url):
    """``(gateway, fake)``: a gateway on a catalog of two keyed backends and an open one, all
    on one fake upstream, probing every half second."""
    key_file = tmp_path / "embed.key"
    key_file.write_text(SECRET + "\n")
    with FakeUpstream() as fake:
        catalog = tmp_path / "models.toml"
        catalog.write_text(CATALOG.format(url=fake.base_url, variable=VARIABLE,
                                          key_file=key_file))
        env = {**gateway_env(pg_url, catalog, probe_interval_s=0.5), VARIABLE: SECRET}
        gw = Gateway(env, workers=1).start()
        try:
            yield gw, fake
        finally:
            gw.stop()


def post(gw, org, path, body):
    return requests.post(gw.base_url + path, json=body, headers=org.headers, timeout=30)


def test_every_request_to_a_keyed_backend_carries_its_key(keyed, org):
    gw, fake = keyed
    bearer = "Bearer " + SECRET
    assert post(gw, org, "/v1/chat/completions",
                {"model": "keyed", "messages": MESSAGES}).status_code == 200
    # A stream without usage: Kiln counts the output with the backend's tokenizer.
    fake.enqueue(sse([chat_chunk("Hi", role="assistant"), chat_chunk(finish_reason="stop")]))
    fake.enqueue(json_reply({"count": 1}), path=TOKENIZE_PATH)
    assert post(gw, org, "/v1/chat/completions",
                {"model": "keyed", "messages": MESSAGES, "stream": True}).status_code == 200
    fake.enqueue(json_reply({"id": "cmpl-1", "object": "text_completion", "created": 0,
                             "model": "keyed-up", "choices": [
                                 {"index": 0, "text": "hi", "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 2, "completion_tokens": 1,
                                       "total_tokens": 3}}), path=COMPLETIONS_PATH)
    assert post(gw, org, "/v1/completions",
                {"model": "keyed", "prompt": "Say hi", "max_tokens": 4}).status_code == 200
    fake.enqueue(json_reply({"object": "list", "model": "embed-up", "data": [
        {"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}],
        "usage": {"prompt_tokens": 2, "total_tokens": 2}}), path=EMBEDDINGS_PATH)
    assert post(gw, org, "/v1/embeddings",
                {"model": "keyed-embed", "input": "hello"}).status_code == 200
    assert post(gw, org, "/v1/chat/completions",
                {"model": "open", "messages": MESSAGES}).status_code == 200
    # Three backends at one URL: the keyed ones' probes carry the key, the open one's none.
    wait_until(lambda: {r.headers.get("Authorization") for r in fake.requests
                        if r.method == "GET"} == {bearer, None})

    posts = [r for r in fake.requests if r.method == "POST"]
    by_model = {(r.path, (r.json or {}).get("model")): r.headers.get("Authorization")
                for r in posts}
    assert by_model == {(CHAT_PATH, "keyed-up"): bearer, (TOKENIZE_PATH, None): bearer,
                        (COMPLETIONS_PATH, "keyed-up"): bearer,
                        (EMBEDDINGS_PATH, "embed-up"): bearer, (CHAT_PATH, "open-up"): None}

    shown = [requests.get(gw.base_url + "/v1/models", headers=org.headers, timeout=10).text,
             requests.get(gw.base_url + "/metrics", timeout=10).text, gw.log()]
    assert "keyed" in shown[0] and all(SECRET not in text for text in shown)


def test_a_key_that_cannot_be_read_stops_the_gateway_starting(tmp_path, pg_url):
    catalog = tmp_path / "models.toml"
    catalog.write_text(CATALOG.format(url="http://127.0.0.1:9/v1", variable=VARIABLE,
                                      key_file=tmp_path / "missing.key"))
    gw = Gateway(gateway_env(pg_url, catalog), workers=1)
    with pytest.raises(RuntimeError) as failed:
        gw.start(timeout_s=20)
    assert f"api_key_env {VARIABLE} is not set" in str(failed.value)
