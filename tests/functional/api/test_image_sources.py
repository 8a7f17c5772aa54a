"""The catalog's per-model ``image_sources`` (``gateway/contract/images.py``, docs/PARAMETERS.md):
what a
model set to ``["data"]``, ``["https", "private"]`` or ``["data", "http"]`` forwards and refuses,
through gunicorn with the official SDK and the scripted fake upstream; the catalog refusing a bad
value; host names judged by what they resolve to; IPv6 forms that carry an IPv4 address."""
import base64
import socket
import uuid

import openai
import pytest

from contract_table import assert_no_trace
from gateway.contract import images
from gateway.contract.catalog import CatalogError, load_catalog
from gateway.errors import InvalidRequest
from gateway_proc import Gateway, gateway_env, make_org

MODEL = """
[[models]]
id = "{id}"
context_window = 8192
max_output_tokens = 256
input = ["text", "image"]
{sources}
pricing = {{ input = "1", cached_input = "0.5", output = "2" }}
backends = [{{ url = "{url}", model = "upstream-vision" }}]
"""
SOURCES = {"data-only": '["data"]', "https-private": '["https", "private"]',
           "data-http": '["data", "http"]', "default": None}
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


def catalog_text(url, **sources):
    return "".join(MODEL.format(id=model, url=url, sources=f"image_sources = {value}"
                                if value is not None else "")
                   for model, value in sources.items())


@pytest.fixture(scope="module")
def sources_gateway(pg_url, fake_upstream, tmp_path_factory):
    path = tmp_path_factory.mktemp("image_sources") / "models.toml"
    path.write_text(catalog_text(fake_upstream.base_url, **SOURCES))
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


# -- the catalog -----------------------------------------------------------------------------

@pytest.mark.unit
@pytest.mark.parametrize("value,words", [
    ('["ftp"]', "must be a list among data, https, http, private"),
    ('["data", "HTTPS"]', "must be a list among"),
    ('"data"', "must be a list among"),  # a string is not a list of sources
    ("[1]", "must be a list among"),
    ("[{ https = true }]", "must be a list among"),
    ('["private"]', '"private" widens "http" or "https"'),
    ('["data", "private"]', '"private" widens'),
    ("7", "bad or missing"),
])
def test_a_bad_image_sources_value_stops_the_catalog_from_loading(tmp_path, value, words):
    path = tmp_path / "models.toml"
    path.write_text(catalog_text("http://127.0.0.1:9", ok=None, bad=value))
    with pytest.raises(CatalogError) as err:
        load_catalog(str(path))
    assert "'bad'" in str(err.value) and words in str(err.value)


@pytest.mark.unit
def test_image_sources_load_as_listed_and_default_to_data_and_https(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text(catalog_text("http://127.0.0.1:9", **SOURCES, none="[]"))
    catalog = load_catalog(str(path))
    assert {m: catalog[m].image_sources for m in catalog} == {
        "data-only": ("data",), "https-private": ("https", "private"),
        "data-http": ("data", "http"), "default": ("data", "https"), "none": ()}


# -- host names and addresses (in process) -------------------------------------------------------

RESOLVES = {"images.example.com": ["93.184.216.34", "2606:2800:220:1::1"],
            "rebind.example.com": ["93.184.216.34", "10.0.0.5"],
            "store.example.com": ["10.1.2.3"], "meta.example.com": ["169.254.169.254"],
            "nat64.example.com": ["64:ff9b::808:808"], "nat64-meta.example.com":
            ["64:ff9b::a9fe:a9fe"], "sixtofour.example.com": ["2002:a00:5::1"],
            "loop.example.com": ["::ffff:127.0.0.1"], "store.corp.internal": ["10.1.2.3"],
            "imagestore": ["10.1.2.4"], "localhost": ["127.0.0.1", "::1"]}


@pytest.fixture
def resolver(monkeypatch):
    """``socket.getaddrinfo`` as ``images`` calls it, answering from :data:`RESOLVES`; the
    names it was asked are in the returned list."""
    asked = []

    def getaddrinfo(name, port, *args, **kwargs):
        asked.append(name)
        if name not in RESOLVES:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, 0)) for a in RESOLVES[name]]
    monkeypatch.setattr(images.socket, "getaddrinfo", getaddrinfo)
    return asked


def verdict(url, sources):
    """``"ok"``, or the message of the 400 ``invalid_image_url``."""
    try:
        images.check_image_url({"url": url}, "p", sources)
    except InvalidRequest as err:
        assert err.code == "invalid_image_url" and err.param == "p"
        return err.message
    return "ok"


PUBLIC, PRIVATE = ("https",), ("https", "private")


@pytest.mark.unit
@pytest.mark.parametrize("host,public,private", [
    ("images.example.com", "ok", "ok"),
    ("rebind.example.com", "private", "ok"),  # every address must pass, not only the first
    ("store.example.com", "private", "ok"),
    ("meta.example.com", "link-local", "link-local"),
    ("nat64.example.com", "ok", "ok"),  # 64:ff9b::8.8.8.8
    ("nat64-meta.example.com", "link-local", "link-local"),
    ("sixtofour.example.com", "private", "ok"),  # 6to4 of 10.0.0.5
    ("loop.example.com", "loopback", "loopback"),
    ("localhost", "local host", "loopback"),
    ("store.corp.internal", "local host", "ok"),
    ("imagestore", "local host", "ok"),
    ("nowhere.example.com", "could not be resolved", "could not be resolved"),
])
def test_a_host_name_is_judged_by_every_address_it_resolves_to(resolver, host, public, private):
    for sources, expect in ((PUBLIC, public), (PRIVATE, private)):
        got = verdict(f"https://{host}/cat.png", sources)
        assert (got == "ok") if expect == "ok" else (expect in got), (sources, got)


@pytest.mark.unit
def test_a_local_name_is_refused_without_asking_the_resolver(resolver):
    assert "local host" in verdict("https://store.corp.internal/a.png", PUBLIC)
    assert "local host" in verdict("https://imagestore/a.png", PUBLIC)
    assert resolver == []


WRAPPED = [  # IPv6 forms whose last bits are an IPv4 address: (literal, the IPv4 it carries)
    ("64:ff9b::a9fe:a9fe", "169.254.169.254"), ("64:ff9b::7f00:1", "127.0.0.1"),
    ("64:ff9b::a00:5", "10.0.0.5"), ("64:ff9b::c0a8:101", "192.168.1.1"),
    ("2002:a9fe:a9fe::1", "169.254.169.254"), ("2002:7f00:1::", "127.0.0.1"),
    ("2002:c0a8:101:1::5", "192.168.1.1"), ("::ffff:127.0.0.1", "127.0.0.1"),
    ("::ffff:169.254.169.254", "169.254.169.254"), ("::127.0.0.1", "127.0.0.1"),
    ("::a00:5", "10.0.0.5"), ("::ffff:0:a9fe:a9fe", "169.254.169.254"),
]


@pytest.mark.unit
@pytest.mark.parametrize("literal,ipv4", WRAPPED)
def test_an_ipv6_address_carrying_a_non_public_ipv4_is_refused(literal, ipv4):
    assert str(images.embedded_ipv4(images.ipaddress.ip_address(literal))) == ipv4
    assert "loopback, private, link-local" in verdict(f"https://[{literal}]/a.png", PUBLIC)


@pytest.mark.unit
@pytest.mark.parametrize("literal", ["64:ff9b::808:808", "2002:808:808::1", "::ffff:8.8.8.8",
                                     "2606:4700::1111"])
def test_an_ipv6_address_carrying_a_public_ipv4_is_public(literal):
    assert verdict(f"https://[{literal}]/a.png", PUBLIC) == "ok"


@pytest.mark.unit
@pytest.mark.parametrize("url,expect", [
    ("https://[2002:a00:5::1]/a.png", "ok"),  # 6to4 of 10.0.0.5: private use
    ("https://[64:ff9b::a00:5]/a.png", "ok"),
    ("https://[2002:7f00:1::]/a.png", "loopback"),
    ("https://[64:ff9b::a9fe:a9fe]/a.png", "link-local"),
    ("https://[64:ff9b:1::a00:5]/a.png", "link-local"),  # local-use NAT64 (RFC 8215)
    ("https://[ff02::1]/a.png", "link-local"), ("https://224.0.0.1/a.png", "link-local"),
])
def test_private_widens_to_private_use_addresses_only(url, expect):
    got = verdict(url, PRIVATE)
    assert (got == "ok") if expect == "ok" else (expect in got), got
