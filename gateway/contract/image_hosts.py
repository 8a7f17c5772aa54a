"""Resolving image URLs' host names: bounded per org and per worker, cancelled for real at the
timeout, cached, and apart from the backends' connections.

``socket.getaddrinfo`` under gevent runs on the hub's threadpool (10 threads): a thread stuck
in a slow lookup cannot be cancelled, so a dozen image URLs naming a slow name server used up
every thread, and every outbound connection of the worker (backends included) waited behind
them. Image hosts are resolved here instead, with dnspython: its queries are UDP (then TCP)
sockets that gevent makes cooperative, with a lifetime after which the query's socket is
closed (nothing keeps running), and no thread is used. Backends' host names still go through
``getaddrinfo``; none of them waits for an image lookup.

Bounds (docs/RELIABILITY.md, "A key that pays nothing cannot slow another org"):

- a lookup takes at most ``timeout_s`` (``KILN_IMAGE_RESOLVE_TIMEOUT_S``), waiting for a
  slot included; an image URL whose host is not resolved within it is refused (400
  ``invalid_image_url``);
- at most ``per_worker`` lookups run at once in a worker and ``per_org`` for one org; a
  request that finds no slot within its timeout is a fast 503 ``server_busy`` with
  ``Retry-After`` (``KILN_IMAGE_LOOKUPS_PER_WORKER``, ``KILN_IMAGE_LOOKUPS_PER_ORG``);
- answers are cached (``cache_size`` names, least recently used dropped): found addresses for
  their DNS TTL at most ``ttl_s``, a name that does not resolve (NXDOMAIN, no address, a
  timeout) for ``negative_ttl_s``; concurrent lookups of one name share one query.
"""
import collections
import ipaddress
import time

import gevent
from gevent.event import AsyncResult
from gevent.lock import BoundedSemaphore

from ..errors import ServiceUnavailable
from . import images

RETRY_AFTER_S = "1"
FAMILIES = ("A", "AAAA")


class HostResolver:
    """A worker's resolver of image hosts (one per app).

    :param nameservers: ``"ip[:port],..."``; empty: the system's (``/etc/resolv.conf``).
    :param timeout_s: the longest one request waits for one name, slot included.
    :param per_worker: lookups at once in this worker.
    :param per_org: lookups at once for one org.
    :param cache_size: names kept; ``ttl_s``, ``negative_ttl_s``: seconds an answer is kept.
    """

    def __init__(self, nameservers="", timeout_s=2.0, per_worker=32, per_org=4,
                 cache_size=4096, ttl_s=300.0, negative_ttl_s=30.0):
        self.nameservers = nameservers
        self.timeout_s = timeout_s
        self.per_org = per_org
        self.cache_size, self.ttl_s, self.negative_ttl_s = cache_size, ttl_s, negative_ttl_s
        self._worker = BoundedSemaphore(per_worker)
        self._orgs = {}  # org -> its slots, while it has lookups
        self._cache = collections.OrderedDict()  # name -> (expires_at, addresses or None)
        self._pending = {}  # name -> AsyncResult of the query under way
        self._dns = None

    def vouch(self, lookups, org):
        """Refuse the request unless every host of ``lookups`` resolves, within the bounds,
        to addresses its model takes (:func:`gateway.contract.images.check_addresses`).

        :param lookups: :class:`gateway.contract.images.Lookup` items.
        :param org: the calling org (its share of the lookups).
        :raises InvalidRequest: 400 ``invalid_image_url``: a host did not resolve, or to an
            address the model does not take.
        :raises ServiceUnavailable: 503 ``server_busy``: no lookup slot within the timeout.
        """
        for lookup in lookups:
            addresses = self.addresses(lookup.name, org)
            if addresses is None:
                raise images.refused(lookup.param,
                                     f"the host {lookup.name[:100]!r} could not be resolved")
            images.check_addresses(addresses, lookup.param, lookup.private_ok)

    def addresses(self, name, org):
        """Return ``name``'s addresses (``ipaddress`` objects), or None when it does not
        resolve within the timeout; from the cache when it has them.

        :raises ServiceUnavailable: no slot within the timeout.
        """
        cached = self._cached(name)
        if cached is not None:
            return cached[1]
        pending = self._pending.get(name)
        if pending is not None:  # the same name asked meanwhile: one query answers both
            return pending.wait(self.timeout_s)  # None if not answered in time
        deadline = time.monotonic() + self.timeout_s
        with self._slot(org, deadline):
            return self._query(name, deadline)

    def _cached(self, name):
        hit = self._cache.get(name)
        if hit is None:
            return None
        if hit[0] <= time.monotonic():
            del self._cache[name]
            return None
        self._cache.move_to_end(name)
        return hit

    def _remember(self, name, addresses, ttl_s):
        self._cache[name] = (time.monotonic() + ttl_s, addresses)
        self._cache.move_to_end(name)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    def _slot(self, org, deadline):
        return _Slot(self, org, deadline)

    def _query(self, name, deadline):
        """Ask the name servers for ``name``'s A and AAAA records before ``deadline``; cache
        and return the addresses (None: none found in time)."""
        result = self._pending[name] = AsyncResult()
        addresses, ttl_s = None, self.negative_ttl_s
        try:
            with gevent.Timeout(max(0.0, deadline - time.monotonic()), False):
                addresses, ttl_s = self._ask(name, deadline)
        finally:
            del self._pending[name]
            self._remember(name, addresses, ttl_s if addresses else self.negative_ttl_s)
            result.set(addresses)
        return addresses

    def _ask(self, name, deadline):
        import dns.exception
        import dns.resolver
        resolver = self._resolver()
        found, ttl_s = [], self.ttl_s
        for family in FAMILIES:
            left = deadline - time.monotonic()
            if left <= 0:
                return None, ttl_s
            try:
                answer = resolver.resolve(name, family, lifetime=left, search=False)
            except dns.resolver.NXDOMAIN:
                return None, self.negative_ttl_s
            except (dns.resolver.NoAnswer, dns.resolver.NoNameservers):
                continue
            except (dns.exception.DNSException, ValueError, UnicodeError):
                return None, self.negative_ttl_s  # a timeout, a bad name, a malformed answer
            ttl_s = min(ttl_s, answer.rrset.ttl)
            found += [ipaddress.ip_address(r.address) for r in answer]
        return (found or None), ttl_s

    def _resolver(self):
        """The dnspython resolver, made at the first lookup (after gevent patched sockets)."""
        if self._dns is None:
            import dns.nameserver
            import dns.resolver
            resolver = dns.resolver.Resolver(configure=not self.nameservers)
            if self.nameservers:
                resolver.nameservers = [_nameserver(dns.nameserver, s)
                                        for s in self.nameservers.split(",") if s.strip()]
            resolver.cache = None  # this module's cache holds both kinds of answer
            self._dns = resolver
        return self._dns


class _Slot:
    """A lookup slot of the org and of the worker, taken by ``deadline`` or a 503."""

    def __init__(self, resolver, org, deadline):
        self.resolver, self.org, self.deadline = resolver, org, deadline
        self._org = None

    def __enter__(self):
        self._org = self.resolver._orgs.setdefault(self.org, _OrgSlots(self.resolver.per_org))
        self._org.users += 1
        if not self._org.semaphore.acquire(timeout=self._left()):
            self._leave()
            raise _busy()
        if not self.resolver._worker.acquire(timeout=self._left()):
            self._org.semaphore.release()
            self._leave()
            raise _busy()
        return self

    def __exit__(self, *exc):
        self.resolver._worker.release()
        self._org.semaphore.release()
        self._leave()

    def _left(self):
        return max(0.0, self.deadline - time.monotonic())

    def _leave(self):
        self._org.users -= 1
        if not self._org.users:  # no lookup of the org left: its entry goes
            self.resolver._orgs.pop(self.org, None)


class _OrgSlots:
    def __init__(self, size):
        self.semaphore, self.users = BoundedSemaphore(size), 0


def _busy():
    return ServiceUnavailable("Kiln is busy resolving other image hosts; retry with backoff.",
                              code="server_busy", headers={"Retry-After": RETRY_AFTER_S})


def _nameserver(module, spec):
    """``"ip"`` or ``"ip:port"`` (``"[v6]:port"``) -> a dnspython name server."""
    spec = spec.strip()
    host, port = spec, 53
    if spec.startswith("["):
        host, _, rest = spec[1:].partition("]")
        port = int(rest[1:]) if rest.startswith(":") else 53
    elif spec.count(":") == 1:
        host, port = spec.split(":")[0], int(spec.split(":")[1])
    return module.Do53Nameserver(host, port)
