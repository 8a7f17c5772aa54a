"""The image-host resolver's cache (gateway/contract/image_hosts.py), against a real name
server (tests/support/dns_server.py): answers found and not found are kept, a slow name server
costs one timeout per name, and the cache is bounded. Its bounds under load, through gunicorn:
functional/api/test_noisy_neighbour.py."""
import ipaddress

import pytest

from dns_server import DnsServer
from gateway.contract.image_hosts import HostResolver

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def dns():
    with DnsServer({"a.example.com": ["93.184.216.34", "2606:2800:220:1::1"],
                    "b.example.com": ["93.184.216.35"], "c.example.com": ["93.184.216.36"]},
                   slow={"slow.example.com": 3}) as server:
        yield server


def test_found_addresses_are_cached(dns):
    resolver = HostResolver(dns.nameserver, timeout_s=5)
    first = resolver.addresses("a.example.com", org=1)
    assert first == [ipaddress.ip_address("93.184.216.34"),
                     ipaddress.ip_address("2606:2800:220:1::1")]
    asked = dns.asked("a.example.com")
    assert asked == 2  # A and AAAA
    assert resolver.addresses("a.example.com", org=2) == first
    assert dns.asked("a.example.com") == asked


def test_a_name_that_does_not_resolve_is_cached_too(dns):
    resolver = HostResolver(dns.nameserver, timeout_s=5)
    assert resolver.addresses("nowhere.example.com", org=1) is None
    asked = dns.asked("nowhere.example.com")
    assert asked == 1  # NXDOMAIN for A: no AAAA query
    assert resolver.addresses("nowhere.example.com", org=1) is None
    assert dns.asked("nowhere.example.com") == asked


def test_a_slow_name_server_costs_one_timeout_per_name(dns):
    resolver = HostResolver(dns.nameserver, timeout_s=0.3)
    assert resolver.addresses("slow.example.com", org=1) is None
    asked = dns.asked("slow.example.com")
    assert resolver.addresses("slow.example.com", org=1) is None  # from the cache
    assert dns.asked("slow.example.com") == asked


def test_the_cache_keeps_the_names_used_last(dns):
    resolver = HostResolver(dns.nameserver, timeout_s=5, cache_size=2)
    for name in ("a.example.com", "b.example.com", "c.example.com"):
        resolver.addresses(name, org=1)
    assert list(resolver._cache) == ["b.example.com", "c.example.com"]
    asked = dns.asked("a.example.com")
    resolver.addresses("a.example.com", org=1)
    assert dns.asked("a.example.com") == asked + 2


def test_nameservers_are_read_with_their_ports():
    from gateway.contract.image_hosts import _nameserver
    import dns.nameserver
    parsed = [_nameserver(dns.nameserver, s) for s in ("127.0.0.1:5353", "10.0.0.2",
                                                          "[fd00::1]:53", "fd00::2")]
    assert [(n.address, n.port) for n in parsed] == [
        ("127.0.0.1", 5353), ("10.0.0.2", 53), ("fd00::1", 53), ("fd00::2", 53)]


@pytest.mark.parametrize("name", ["a..example.com", "x" * 64 + ".example.com",
                                  ("a" * 60 + ".") * 5 + "com", "bücher.example"])
def test_a_name_dns_cannot_carry_does_not_resolve(dns, name):
    assert HostResolver(dns.nameserver, timeout_s=2).addresses(name, org=1) is None
