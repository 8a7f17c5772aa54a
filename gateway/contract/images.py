"""Which image sources a request may make a vision backend read (``image_url`` parts).

Vision model servers fetch ``image_url`` URLs themselves, from inside the operator's network: a
URL naming a loopback, private or link-local address (a cloud metadata service at
169.254.169.254, an admin page) would make the backend fetch it for the client (server-side
request forgery, OWASP). Each catalog entry lists the sources it forwards (``image_sources``):

- ``data``: ``data:image/{png,jpeg,gif,webp};base64,...`` URLs whose bytes are that type;
- ``https`` / ``http``: URLs of that scheme on public addresses (host names are resolved; every
  address must be public); each scheme is listed on its own;
- ``private``: the listed schemes may also name private-use addresses (10/8, 172.16/12,
  192.168/16, 100.64/10, fc00::/7: an operator's own image store) and local host names
  (``.internal``, ``.lan``, no dot); loopback, link-local (the cloud metadata service) and
  other reserved addresses stay refused.

The default is ``data`` and ``https``. Anything else is refused with 400 ``invalid_image_url``.
An IPv6 address that carries an IPv4 one (IPv4-mapped ``::ffff:0:0/96``, IPv4-compatible
``::/96``, NAT64 ``64:ff9b::/96`` of RFC 6052, 6to4 ``2002::/16`` of RFC 3056) is judged by that
IPv4 address; the local-use NAT64 prefix ``64:ff9b:1::/48`` (RFC 8215) is never public.
A host name can resolve differently when the backend fetches it (DNS rebinding): Kiln checks the
addresses it sees; an operator who needs more blocks egress from the model servers.

A model server that fetches the URL itself follows redirects (vLLM's fetcher does), so a public
host may send it to a private address on a hop Kiln never sees: a model with such backends
(every family but ``openai``, :attr:`gateway.contract.families.Family.follows_image_redirects`)
is sent remote URLs only of the hosts its catalog vouches for (``image_hosts``).

Checking a part here needs no I/O: a URL whose host is a name gives a :class:`Lookup`, which
the view resolves with the org's share of the worker's resolver
(:class:`gateway.contract.image_hosts.HostResolver`) and checks with :func:`check_addresses`.
"""
import binascii
import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..errors import InvalidRequest

DEFAULT_SOURCES = ("data", "https")
SOURCES = ("data", "https", "http", "private")
MAX_IMAGE_BYTES = 20 * 1024 * 1024
# Leading bytes of each accepted image type.
MAGIC = {"image/png": (b"\x89PNG\r\n\x1a\n",), "image/jpeg": (b"\xff\xd8\xff",),
         "image/gif": (b"GIF87a", b"GIF89a"), "image/webp": (b"RIFF",)}
_DATA_URL = re.compile(r"data:([a-z/+.-]+);base64,", re.IGNORECASE)
LOCAL_SUFFIXES = (".localhost", ".local", ".internal", ".lan", ".home.arpa", ".intranet")
PRIVATE_USE = tuple(ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7"))
# IPv6 prefixes whose last 32 bits are an IPv4 address a gateway or the host's stack reaches:
# IPv4-compatible (RFC 4291, 2.5.5.1; also :: and ::1), SIIT (RFC 2765), NAT64 (RFC 6052).
IPV4_IN_LAST_32_BITS = tuple(ipaddress.ip_network(n) for n in (
    "::/96", "::ffff:0:0:0/96", "64:ff9b::/96"))
LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215: never globally reachable


@dataclass(frozen=True)
class Lookup:
    """An image URL whose host is a name, to resolve before the request is admitted: where it
    is (``param``), the name (lower case, no final dot), and whether the model takes
    private-use addresses."""

    param: str
    name: str
    private_ok: bool


def check_image_url(value, param, sources=DEFAULT_SOURCES, vouched=None):
    """Check an ``image_url`` part's value against the model's allowed ``sources``; return the
    :class:`Lookup` its host name needs, or None (a data: URL, an address).

    :param value: ``{"url": ..., "detail": ...}`` (or the URL as a string).
    :param vouched: None, or the only hosts (lower case) a remote URL may name: the model's
        backends follow redirects fetching it, so the policy holds only for hosts the operator
        vouches for (:attr:`gateway.contract.catalog.ModelEntry.vouched_image_hosts`).
    :raises InvalidRequest: 400, ``invalid_type`` or ``invalid_image_url``.
    """
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise InvalidRequest(f"Invalid '{param}': expected an object with a 'url'.",
                             param=param, code="invalid_type")
    if url[:5].lower() == "data:":
        if "data" not in sources:
            raise refused(param, "data: URLs are not accepted by this model")
        _check_data_url(url, param)
        return None
    scheme = url.split(":", 1)[0].lower()
    if scheme not in ("http", "https") or scheme not in sources:
        allowed = [s for s in sources if s != "private"]
        raise refused(param, f"only {', '.join(allowed)} image URLs are accepted")
    return _check_host(url, param, "private" in sources, vouched)


def _check_data_url(url, param):
    match = _DATA_URL.match(url)
    media_type = match.group(1).lower() if match else None
    if media_type not in MAGIC:
        raise refused(param, f"a data: URL must be base64 of one of {', '.join(MAGIC)}")
    payload = url[match.end():]
    if len(payload) * 3 // 4 > MAX_IMAGE_BYTES:
        raise refused(param, f"the image is larger than {MAX_IMAGE_BYTES} bytes")
    try:
        head = binascii.a2b_base64(payload[:64].encode("ascii"), strict_mode=True)
        binascii.a2b_base64(payload.encode("ascii"), strict_mode=True)
    except (binascii.Error, UnicodeEncodeError) as err:
        raise refused(param, "the data: URL is not valid base64") from err
    if not head.startswith(MAGIC[media_type]):
        raise refused(param, f"the data: URL's bytes are not {media_type}")


def _check_host(url, param, private_ok, vouched=None):
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as err:
        raise refused(param, "the URL is malformed") from err
    if not host or parts.username is not None or parts.password is not None:
        raise refused(param, "the URL needs a host and no user name or password")
    if vouched is not None and host.rstrip(".").lower() not in vouched:
        raise refused(param, "this model's servers follow redirects when they fetch an image, "
                      "so only URLs of the hosts its catalog vouches for are accepted; send "
                      "the image as a data: URL")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        name = host.rstrip(".").lower()
        if not private_ok and ("." not in name or name.endswith(LOCAL_SUFFIXES)):
            raise refused(param, "the URL names a local host") from None
        return Lookup(param, name, private_ok)
    check_addresses([address], param, private_ok)
    return None


def check_addresses(addresses, param, private_ok):
    """Refuse an image URL whose host is, or resolved to, an address the model does not take.

    :param addresses: ``ipaddress`` objects, every one of which must be allowed.
    :raises InvalidRequest: 400 ``invalid_image_url``.
    """
    for address in addresses:
        if not _allowed(address, private_ok):
            raise refused(param, "the URL names a loopback, link-local or reserved address"
                           if private_ok else "the URL names a loopback, private, link-local "
                           "or reserved address")


def _allowed(address, private_ok):
    """Whether an image URL may name ``address``: public, or private-use with ``private_ok``."""
    address = embedded_ipv4(address)
    if address.is_multicast or address in LOCAL_NAT64:
        return False
    return address.is_global or private_ok and any(address in n for n in PRIVATE_USE)


def embedded_ipv4(address):
    """Return the IPv4 address an IPv6 ``address`` carries (mapped, compatible, SIIT, NAT64,
    6to4), else ``address`` itself."""
    if address.version == 4:
        return address
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if any(address in n for n in IPV4_IN_LAST_32_BITS):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address


def refused(param, why):
    """The 400 ``invalid_image_url`` of the part at ``param``, saying ``why``."""
    return InvalidRequest(f"Invalid '{param}': {why}.", param=param, code="invalid_image_url")
