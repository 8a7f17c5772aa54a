"""Image URL policy holds across redirects (docs/PARAMETERS.md, "image_hosts"; docs/RELIABILITY.md):
a model server that fetches an image URL itself and follows redirects (vLLM, SGLang, llama.cpp,
llama-cpp-python, a server of unknown kind) is sent only URLs of the hosts its catalog vouches
for; the ``openai`` family fetches outside the operator's network and keeps the sources' rules.

A real HTTP server on this machine's private-use address (``fd00::2``, fc00::/7) answers every
image URL with a redirect to a loopback address: the address check passes on the first hop,
and a fetcher that follows redirects lands on 127.0.0.1. Through gunicorn with the official
SDK and the scripted fake upstream.
"""
import http.server
import socket
import threading
import uuid

import openai
import pytest
import requests

from contract_table import assert_no_trace
from gateway_proc import Gateway, gateway_env, make_org

PRIVATE_HOST = "fd00::2"  # this machine's private-use address
CATALOG = """
[[models]]
id = "{id}"
context_window = 8192
max_output_tokens = 256
input = ["text", "image"]
image_sources = ["data", "http", "private"]
{hosts}
pricing = {{ input = "1", cached_input = "0.5", output = "2" }}
backends = [{{ url = "{url}", model = "upstream-vision", server = "{server}" }}]
"""
MODELS = {"vllm": ("vllm", ""), "sglang": ("sglang", ""), "generic": ("generic", ""),
          "llama-cpp-python": ("llama-cpp-python", ""),
          "vllm-vouched": ("vllm", f'image_hosts = ["{PRIVATE_HOST}"]'),
          "openai": ("openai", "")}


class _Redirect(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.server.seen.append(self.path)
        self.send_response(302)
        self.send_header("Location", f"http://127.0.0.1:{self.server.loopback_port}/secret")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


class _V6Server(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6


@pytest.fixture(scope="module")
def redirector(fake_upstream):
    try:
        server = _V6Server((PRIVATE_HOST, 0), _Redirect)
    except OSError as err:
        pytest.skip(f"this machine has no {PRIVATE_HOST} to listen on: {err}")
    server.seen, server.loopback_port = [], fake_upstream.port
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://[{PRIVATE_HOST}]:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def redirects_gateway(pg_url, fake_upstream, tmp_path_factory):
    path = tmp_path_factory.mktemp("image_redirects") / "models.toml"
    path.write_text("".join(CATALOG.format(id=m, server=server, hosts=hosts,
                                           url=fake_upstream.base_url)
                            for m, (server, hosts) in MODELS.items()))
    gw = Gateway(gateway_env(pg_url, path), workers=1).start()
    yield gw
    gw.stop()


@pytest.fixture
def redirect_org(engine):
    return make_org(engine, f"redirects-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def redirect_client(redirects_gateway, redirect_org):
    with openai.OpenAI(base_url=redirects_gateway.base_url + "/v1", api_key=redirect_org.key,
                       max_retries=0, timeout=30) as c:
        yield c


def ask(client, model, url):
    part = {"type": "image_url", "image_url": {"url": url}}
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, part]}])
    return part


def test_the_image_server_redirects_a_fetcher_to_loopback(redirector, fake):
    """The hazard is real: a fetcher that follows redirects, as vLLM's does, ends at
    127.0.0.1 (here the fake upstream, which answers 404 to the path)."""
    r = requests.get(redirector + "/cat.png", timeout=10)
    assert r.url.startswith("http://127.0.0.1:") and r.history[0].status_code == 302


@pytest.mark.parametrize("model", ["vllm", "sglang", "generic", "llama-cpp-python"])
def test_a_redirect_following_backend_is_not_sent_a_host_no_one_vouched_for(
        redirect_client, redirector, fake, engine, redirect_org, model):
    with pytest.raises(openai.BadRequestError) as err:
        ask(redirect_client, model, redirector + "/cat.png")
    assert err.value.body["code"] == "invalid_image_url"
    assert err.value.body["param"] == "messages[0].content[1].image_url"
    assert "follow redirects" in err.value.body["message"]
    assert_no_trace(engine, fake, redirect_org)


@pytest.mark.parametrize("model", ["vllm-vouched", "openai"])
def test_a_vouched_host_or_a_backend_outside_the_network_is_sent_the_url(
        redirect_client, redirector, fake, model):
    part = ask(redirect_client, model, redirector + "/cat.png")
    assert fake.requests[-1].json["messages"][0]["content"][1] == part


def test_a_data_url_still_goes_to_a_redirect_following_backend(redirect_client, fake):
    png = "data:image/png;base64,iVBORw0KGgoAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    part = ask(redirect_client, "vllm", png)
    assert fake.requests[-1].json["messages"][0]["content"][1] == part
