"""The catalog's per-model ``image_sources`` (``gateway/contract/images.py``, docs/PARAMETERS.md):
what a model set to ``["data"]``, ``["https", "private"]`` or ``["data", "http"]`` forwards and
refuses, through gunicorn with the official SDK and the scripted fake upstream. The catalog's
checks and the address rules in process: unit/contract/test_image_source_rules.py."""
import base64
import uuid

import openai
import pytest

from contract_table import assert_no_trace
from factories import IMAGE_SOURCES, image_sources_catalog
from gateway_proc import Gateway, gateway_env, make_org

PNG = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(32)).decode()
PUBLIC_HTTPS, PUBLIC_HTTP = "https://1.1.1.1/cat.png", "http://1.1.1.1/cat.png"
PRIVATE_HTTPS, PRIVATE_HTTP = "https://10.0.0.5/cat.png", "http://10.0.0.5/cat.png"
ULA_HTTPS, CGNAT_HTTPS = "https://[fd00::5]/cat.png", "https://100.64.0.7/cat.png"
METADATA = "https://169.254.169.254/latest/meta-data/"
LOOPBACK, NAT64_METADATA = "https://127.0.0.1/cat.png", "https://[64:ff9b::a9fe:a9fe]/a.png"

# model -> (URLs it forwards as sent, URLs it refuses with 400 invalid_image_url)
CASES = {
    "data-only": ([PNG], [PUBLIC_HTTPS, PUBLIC_HTTP, PRIVATE_HTTPS]),
    "https-private": ([PUBLIC_HTTPS, PRIVATE_HTTPS, ULA_HTTPS, CGNAT_HTTPS],
                      [PNG, PUBLIC_HTTP, PRIVATE_HTTP, METADATA, LOOPBACK, NAT64_METADATA,
                       "https://[::1]/a.png", "https://[fe80::1]/a.png", "ftp://10.0.0.5/a"]),
    "data-http": ([PNG, PUBLIC_HTTP], [PUBLIC_HTTPS, PRIVATE_HTTP, METADATA, LOOPBACK,
                                       "http://[::ffff:10.0.0.5]/a.png"]),
    "default": ([PNG, PUBLIC_HTTPS], [PUBLIC_HTTP, PRIVATE_HTTPS, NAT64_METADATA]),
}


@pytest.fixture(scope="module")
def sources_gateway(pg_url, fake_upstream, tmp_path_factory):
    path = tmp_path_factory.mktemp("image_sources") / "models.toml"
    path.write_text(image_sources_catalog(fake_upstream.base_url, **IMAGE_SOURCES))
    gw = Gateway(gateway_env(pg_url, path), workers=1).start()
    yield gw
    gw.stop()


@pytest.fixture
def sources_org(engine):
    return make_org(engine, f"images-{uuid.uuid4().hex[:8]}")


@pytest.fixture
def sources_client(sources_gateway, sources_org):
    with openai.OpenAI(base_url=sources_gateway.base_url + "/v1", api_key=sources_org.key,
                       max_retries=0, timeout=30) as c:
        yield c


def ask(client, model, url):
    part = {"type": "image_url", "image_url": {"url": url}}
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, part]}])
    return part


@pytest.mark.parametrize("model,url", [(m, u) for m, (ok, _) in CASES.items() for u in ok])
def test_a_listed_source_is_forwarded_as_sent(sources_client, fake, model, url):
    part = ask(sources_client, model, url)
    assert fake.requests[-1].json["messages"][0]["content"][1] == part


@pytest.mark.parametrize("model,url", [(m, u) for m, (_, no) in CASES.items() for u in no])
def test_a_source_the_model_does_not_list_is_refused(sources_client, fake, sources_org, engine,
                                                     model, url):
    with pytest.raises(openai.BadRequestError) as err:
        ask(sources_client, model, url)
    assert err.value.body["code"] == "invalid_image_url"
    assert err.value.body["param"] == "messages[0].content[1].image_url"
    assert_no_trace(engine, fake, sources_org)
