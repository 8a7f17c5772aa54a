"""Name resolution in the gateway's gevent workers: gevent's thread resolver, with addresses
written as IP literals answered in place.

gevent resolves every host, an IP literal too, in a thread of its pool
(:mod:`gevent.resolver.thread`): about 70 µs of CPU per new backend connection, measured in a
worker, where the C call with ``AI_NUMERICHOST`` takes 2 µs and never blocks (it does not look
anything up: RFC 3493, section 6.1, on ``AI_NUMERICHOST``). A burst of streams opens a backend
connection each (bench/RESULTS.md, bursts), and backends are often named by address. Any
other host name goes to gevent's resolver as before.

deploy/gunicorn.conf.py installs it as ``GEVENT_RESOLVER``, the setting gevent reads when a
worker's hub first resolves a name (gevent's documentation, "Name Resolution (DNS)": the
setting also takes a class's dotted name).
"""
import _socket
import ipaddress

from gevent.resolver.thread import Resolver as ThreadResolver


def is_ip_literal(host):
    """Whether ``host`` (str or bytes) is an IPv4 or IPv6 address, not a name."""
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    if not isinstance(host, str):
        return False
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class Resolver(ThreadResolver):
    """gevent's thread resolver; an IP literal is resolved in place (numerically)."""

    def getaddrinfo(self, host, port, family=0, type=0, proto=0, flags=0):  # noqa: A002 - socket's names
        if is_ip_literal(host):
            return _socket.getaddrinfo(host, port, family, type, proto,
                                       flags | _socket.AI_NUMERICHOST)
        return super().getaddrinfo(host, port, family, type, proto, flags)
