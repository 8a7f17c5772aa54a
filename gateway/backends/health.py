"""Backend health as one worker sees it: a circuit breaker fed by the requests it sends
(passive) and by a probe of every backend every few seconds (active). docs/ROUTING.md.

Passive: consecutive failures open the breaker for a cool-down that doubles with every
opening in a row (up to a ceiling); after the cool-down requests may try the backend again
(half-open), and the first failure reopens it at once. One success closes it. A refused
connection is proof enough: it opens the breaker at once. The requests' side
(:meth:`gateway.backends.fleet.Route.open`) never opens the breaker of a model's last backend in
rotation on a 5xx or a timeout.

Active: ``GET {url}{probe_path}``. An answer below 500 closes a breaker that only
unreachability or probes opened (a restarted backend comes back before a client pays for
finding out), never one that chat requests which reached the backend failed: a server whose
``/models`` answers while its chat endpoint fails would otherwise be brought back every probe
interval, its cool-down never growing; it comes back after its cool-down, half-open. A refused
connection or a 5xx counts as a failure; a probe that connected but got no answer in time says
nothing (a single-slot llama.cpp server busy with a long generation answers its queue in order).
"""
import logging
import time
from dataclasses import dataclass

import gevent
import requests
from gevent.pool import Group

from .upstream import auth_headers, unreachable

log = logging.getLogger(__name__)

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_VALUES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # the ``kiln_backend_state`` gauge


@dataclass(frozen=True)
class BreakerPolicy:
    """When a breaker opens and for how long (seconds)."""

    failures: int = 3
    cooldown_s: float = 5.0
    max_cooldown_s: float = 60.0

    @classmethod
    def from_config(cls, config):
        return cls(config.breaker_failures, config.breaker_cooldown_s,
                   config.breaker_max_cooldown_s)


class Breaker:
    """One backend's circuit breaker (per worker process)."""

    def __init__(self):
        self.failures = 0       # consecutive failures since the last success or opening
        self.openings = 0       # openings since the last success: the cool-down grows with it
        self.open_until = 0.0   # time.monotonic() seconds
        # A chat request that reached the backend failed (5xx, first-byte timeout) since the
        # last success: only a request's success closes the breaker then, not the probe's.
        self.requests_failed = False

    def is_up(self, now):
        """Whether requests may go to the backend (closed, or open past its cool-down)."""
        return now >= self.open_until

    def state(self, now):
        if now < self.open_until:
            return OPEN
        return HALF_OPEN if self.openings else CLOSED

    def success(self):
        """Close the breaker: a request's answer proves the backend is there and serving."""
        self.failures = self.openings = 0
        self.open_until = 0.0
        self.requests_failed = False

    def probe_success(self):
        """Close the breaker on a probe's answer unless failed chat requests count against
        it (those wait out their cool-down); return whether it is closed."""
        if not self.requests_failed:
            self.success()
        return not self.requests_failed

    def failure(self, policy, at_once=False, request=False):
        """Count a failure; open the breaker past the threshold, at once when ``at_once``
        (unreachable: a refused connection or a connect timeout) or when it was half-open.
        Return whether it opened.

        :param request: a chat request that reached the backend failed (not a probe).
        """
        if at_once:  # the server is gone; whatever answers there next is a new process
            self.requests_failed = False
        elif request:
            self.requests_failed = True
        self.failures += 1
        if not (at_once or self.openings or self.failures >= policy.failures):
            return False
        cooldown = min(policy.cooldown_s * 2 ** self.openings, policy.max_cooldown_s)
        self.openings += 1
        self.failures = 0
        self.open_until = time.monotonic() + cooldown
        return True


class BackendState:
    """What one worker knows of a backend: its breaker, its requests in flight (this worker's,
    and the host's once :meth:`attach`-ed), and its slots (``max_in_flight``)."""

    def __init__(self):
        self.breaker = Breaker()
        self.in_flight = 0     # this worker's
        self.slots = None      # gateway.backends.capacity.Slots
        self._host = None      # (gateway.backends.capacity.HostLoad, url)

    def attach(self, slots, host_load, url):
        self.slots, self._host = slots, (host_load, url)

    def begin(self):
        self.in_flight += 1
        if self._host is not None:
            self._host[0].add(self._host[1], 1)

    def end(self):
        self.in_flight -= 1
        if self._host is not None:
            self._host[0].add(self._host[1], -1)

    def load(self):
        """Requests in flight: every worker's of this host when known, else this worker's."""
        total = self._host[0].total(self._host[1]) if self._host is not None else None
        return self.in_flight if total is None else total


class BackendStates:
    """This worker's :class:`BackendState` of each backend (a catalog entry, frozen), made on
    first use: the mutable side of the fleet, one per app (``Services.states``). Each catalog
    entry has its own, as it had when the state lived on the entry: two entries naming one
    server share its slots (:func:`gateway.backends.fleet.prepare`), not their breakers."""

    def __init__(self):
        self._states = {}  # id(backend) -> (backend, state); the backend kept: its id stays its

    def __getitem__(self, backend):
        found = self._states.get(id(backend))
        if found is None:
            found = self._states[id(backend)] = (backend, BackendState())
        return found[1]


def note_failure(backend, breaker, policy, why, at_once=False, request=False):
    """Count a failure of ``backend`` (a :class:`gateway.contract.catalog.Backend`) on its
    ``breaker`` (:meth:`Breaker.failure`); say in the log when that takes it out of rotation,
    and for how long."""
    if breaker.failure(policy, at_once=at_once, request=request):
        log.warning("backend %s out of rotation for %.0f s: %s", backend.url,
                    breaker.open_until - time.monotonic(), why)


# -- active probe ------------------------------------------------------------------------------

def probe(session, backend, breaker, path, timeout_s, policy):
    """Probe ``backend`` once and feed its ``breaker``; return ``"up"``, ``"down"``,
    ``"unknown"`` (connected, no answer in time) or ``"failing"`` (answered, but its chat
    requests failed: the breaker is left to its cool-down).

    A connection that cannot be made takes the backend out at once. One that drops without an
    answer is tried once more on a new connection first: the pooled connection may be one the
    server had closed as its keep-alive ran out (uvicorn's is 5 s, the probe's interval too).
    """
    url = backend.url.rstrip("/") + path
    for last_try in (False, True):
        try:
            resp = session.get(url, timeout=(timeout_s, timeout_s),
                               headers=auth_headers(backend))
            resp.close()
            break
        except requests.ConnectionError as err:
            if unreachable(err):
                note_failure(backend, breaker, policy,
                             f"probe could not connect ({type(err).__name__})",
                             at_once=True)
                return "down"
            if last_try:
                note_failure(backend, breaker, policy, f"probe's connection dropped twice "
                                                       f"({type(err).__name__})")
                return "down"
        except requests.Timeout:
            return "unknown"
    if resp.status_code >= 500:
        note_failure(backend, breaker, policy, f"probe answered {resp.status_code}")
        return "down"
    return "up" if breaker.probe_success() else "failing"


def start_prober(app):
    """Start this worker's probe greenlet (once); ``KILN_PROBE_INTERVAL_S`` 0 turns it off."""
    state = app.extensions["kiln.maintenance"]
    services = app.extensions["kiln"]
    if state.get("prober") is not None or services.config.probe_interval_s <= 0:
        return
    state["prober"] = services.background.spawn("prober", _probe_forever, services)


def _probe_forever(services):
    """Probe every backend on its own cadence (a slow one delays no other's comeback), and
    publish the breakers' states as often."""
    config = services.config
    policy = BreakerPolicy.from_config(config)
    backends = [(entry.id, b) for entry in services.catalog.values() for b in entry.backends]
    loops = Group()
    try:
        for _, backend in backends:
            loops.spawn(_probe_backend, services, backend, policy)
        while True:
            publish_states(services.metrics, backends, services.states)
            gevent.sleep(config.probe_interval_s)
    finally:
        loops.kill(block=False)


def _probe_backend(services, backend, policy):
    """Probe ``backend`` every ``KILN_PROBE_INTERVAL_S``, counted from one probe's start to
    the next: a backend that starts answering is seen within one interval."""
    config = services.config
    while True:
        began = time.monotonic()
        with gevent.Timeout(config.probe_timeout_s * 2 + 1, False):  # a trickling answer
            probe(services.session, backend, services.states[backend].breaker,
                  config.probe_path, config.probe_timeout_s, policy)
        gevent.sleep(max(0.0, config.probe_interval_s - (time.monotonic() - began)))


def publish_states(metrics, backends, states):
    """Set the ``kiln_backend_state`` gauge of every ``(model id, backend)``."""
    now = time.monotonic()
    for model, backend in backends:
        state = states[backend].breaker.state(now)
        metrics.child(metrics.backend_state, model, backend.url).set(STATE_VALUES[state])
