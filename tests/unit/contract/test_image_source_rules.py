"""The catalog's per-model ``image_sources`` in process (``gateway/contract/images.py``,
docs/PARAMETERS.md): the catalog refusing a bad value and loading good ones as listed; host names
judged by everything they resolve to (a real name server: tests/support/dns_server.py); IPv6
forms that carry an IPv4 address. Through gunicorn with the official SDK:
functional/api/test_image_sources.py."""
import pytest

from dns_server import DnsServer
from factories import IMAGE_SOURCES, image_sources_catalog
from gateway.contract import images
from gateway.contract.image_hosts import HostResolver
from gateway.contract.catalog import CatalogError, load_catalog
from gateway.errors import InvalidRequest

pytestmark = pytest.mark.unit


# -- the catalog -----------------------------------------------------------------------------

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
    path.write_text(image_sources_catalog("http://127.0.0.1:9", ok=None, bad=value))
    with pytest.raises(CatalogError) as err:
        load_catalog(str(path))
    assert "'bad'" in str(err.value) and words in str(err.value)


def test_image_sources_load_as_listed_and_default_to_data_and_https(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text(image_sources_catalog("http://127.0.0.1:9", **IMAGE_SOURCES, none="[]"))
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


@pytest.fixture(scope="module")
def dns():
    with DnsServer(RESOLVES) as server:
        yield server


@pytest.fixture
def resolver(dns):
    """A resolver asking :data:`RESOLVES`' name server; ``resolver.asked`` the names it asked
    (in this test)."""
    before = len(dns.queries)
    resolver = HostResolver(dns.nameserver, timeout_s=5.0)
    resolver.asked = lambda: dns.queries[before:]
    return resolver


def verdict(url, sources, resolver=None):
    """``"ok"``, or the message of the 400 ``invalid_image_url``."""
    try:
        lookup = images.check_image_url({"url": url}, "p", sources)
        if lookup is not None:
            resolver.vouch([lookup], org=1)
    except InvalidRequest as err:
        assert err.code == "invalid_image_url" and err.param == "p"
        return err.message
    return "ok"


PUBLIC, PRIVATE = ("https",), ("https", "private")


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
        got = verdict(f"https://{host}/cat.png", sources, resolver)
        assert (got == "ok") if expect == "ok" else (expect in got), (sources, got)


def test_a_local_name_is_refused_without_asking_the_resolver(resolver):
    assert "local host" in verdict("https://store.corp.internal/a.png", PUBLIC, resolver)
    assert "local host" in verdict("https://imagestore/a.png", PUBLIC, resolver)
    assert resolver.asked() == []


WRAPPED = [  # IPv6 forms whose last bits are an IPv4 address: (literal, the IPv4 it carries)
    ("64:ff9b::a9fe:a9fe", "169.254.169.254"), ("64:ff9b::7f00:1", "127.0.0.1"),
    ("64:ff9b::a00:5", "10.0.0.5"), ("64:ff9b::c0a8:101", "192.168.1.1"),
    ("2002:a9fe:a9fe::1", "169.254.169.254"), ("2002:7f00:1::", "127.0.0.1"),
    ("2002:c0a8:101:1::5", "192.168.1.1"), ("::ffff:127.0.0.1", "127.0.0.1"),
    ("::ffff:169.254.169.254", "169.254.169.254"), ("::127.0.0.1", "127.0.0.1"),
    ("::a00:5", "10.0.0.5"), ("::ffff:0:a9fe:a9fe", "169.254.169.254"),
]


@pytest.mark.parametrize("literal,ipv4", WRAPPED)
def test_an_ipv6_address_carrying_a_non_public_ipv4_is_refused(literal, ipv4):
    assert str(images.embedded_ipv4(images.ipaddress.ip_address(literal))) == ipv4
    assert "loopback, private, link-local" in verdict(f"https://[{literal}]/a.png", PUBLIC)


@pytest.mark.parametrize("literal", ["64:ff9b::808:808", "2002:808:808::1", "::ffff:8.8.8.8",
                                     "2606:4700::1111"])
def test_an_ipv6_address_carrying_a_public_ipv4_is_public(literal):
    assert verdict(f"https://[{literal}]/a.png", PUBLIC) == "ok"


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
