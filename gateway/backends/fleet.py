"""The backends one generation goes to: the first chosen by the model's routing policy, and
retries before the first byte on another live backend. docs/ROUTING.md.

A try that fails before the backend answered (no connection, a connect or first-byte timeout,
a 5xx or 429 status) is retried: at most ``KILN_UPSTREAM_RETRIES`` more tries, none begun past
``KILN_UPSTREAM_RETRY_DEADLINE_S`` from the first and none waiting past it (a retry's connect
and first-byte timeouts are cut to the time left), a jittered exponential wait between them
("full jitter", AWS Architecture Blog, "Exponential Backoff And Jitter", 2015). Nothing was
relayed by then, so nothing is billed twice: the usage event names every backend tried
(``attempts``) and the one that answered (``backend``). A 4xx is the request's fault and goes
to the client as it is; a 2xx reply larger than Kiln relays is an answer, not a failure: never
retried, never counted against the backend (docs/RELIABILITY.md, "Big answers").
"""
import math
import random
import time

import gevent

from .capacity import HostLoad, Slots, slot_dir
from ..errors import (ServiceUnavailable, UpstreamError, UpstreamRejected, UpstreamTimeout,
                      UpstreamTooLarge)
from .health import BackendStates, BreakerPolicy, note_failure
from .routing import PREFIX_AFFINITY, prefix_key, rank
from ..endings import CONNECT_TIMEOUT, UNREACHABLE

SLOT_POLL_S = 0.05  # how often a request waiting for a capped backend looks again
RETRY_AFTER_S = "1"


class Route:
    """Where one generation is sent: the backend it holds a slot on, and every one it tried."""

    def __init__(self, services, entry, messages):
        self.services, self.entry, self.states = services, entry, services.states
        self.config = services.config
        self.key = prefix_key(messages) if entry.routing == PREFIX_AFFINITY else None
        self.policy = BreakerPolicy.from_config(self.config)
        self.tried = []        # backend URLs in order: the usage event's attempts
        self.backend = None    # the backend whose slot is held (the last tried)
        self.answered = False  # that backend answered 2xx: what follows is its relay
        self._slot = None

    # -- choosing ----------------------------------------------------------------------------

    def take(self, wait_s, until=math.inf):
        """Take a slot on the best live backend not tried yet, waiting up to ``wait_s`` while
        every one is at its ``max_in_flight``, and taking none at or past ``until``
        (a ``time.monotonic()`` time: the retries' deadline).

        :raises ServiceUnavailable: none is live (``no_backend_available``), or none had a free
            slot in time (``backends_at_capacity``, with Retry-After).
        """
        deadline = time.monotonic() + wait_s
        while time.monotonic() < until:
            live = self._live()
            for backend in rank(self.entry.routing, live, self._load, self.key,
                                load_bound=self.entry.load_bound):
                slot = self._slots(backend).try_take()
                if slot is not None:
                    return self._hold(backend, slot)
            if time.monotonic() >= deadline:
                break
            gevent.sleep(SLOT_POLL_S)
        raise ServiceUnavailable(
            f"Every backend of model '{self.entry.id}' is at capacity. Retry with backoff.",
            code="backends_at_capacity", headers={"Retry-After": RETRY_AFTER_S})

    def _live(self):
        """The backends in rotation (weight above 0, breaker not open) not tried yet."""
        now = time.monotonic()
        live = [b for b in self.entry.backends if b.weight > 0 and b.url not in self.tried
                and self.states[b].breaker.is_up(now)]
        if not live:
            raise ServiceUnavailable(f"No backend is available for model '{self.entry.id}'. "
                                     f"Retry with exponential backoff.",
                                     code="no_backend_available")
        return live

    def _load(self, backend):
        return self.states[backend].load()

    def _slots(self, backend):
        state = self.states[backend]
        if state.slots is None:  # not prepared (used without an app)
            state.slots = Slots(slot_dir(self.config.slot_dir), backend.url,
                                        backend.max_in_flight)
        return state.slots

    def _hold(self, backend, slot):
        self.backend, self._slot = backend, slot
        self.tried.append(backend.url)
        self.states[backend].begin()
        m = self.services.metrics
        m.child(m.backend_in_flight, self.entry.id, backend.url).inc()
        m.child(m.backend_requests, self.entry.id, backend.url).inc()
        return backend

    def release(self):
        """Give back the slot held (safe to call twice)."""
        backend = self.backend
        if self._slot is None or backend is None:
            return
        self._slots(backend).release(self._slot)
        self._slot = None
        self.states[backend].end()
        m = self.services.metrics
        m.child(m.backend_in_flight, self.entry.id, backend.url).dec()

    # -- trying ------------------------------------------------------------------------------

    def open(self, send, timeouts_s):
        """Return ``send(backend, timeouts_s)`` (a 2xx response) from the first backend that
        answers, retrying on another before the first byte.

        :param send: ``(backend, (connect, first byte) seconds) -> response``; raises the
            gateway error of a failed try.
        :param timeouts_s: the first try's ``(connect, first byte)`` seconds; a retry's are cut
            to the time left before the deadline, so that none outlasts it.
        :raises GatewayError: the last try's error once retries or the deadline run out.
        """
        until = time.monotonic() + self.config.upstream_retry_deadline_s
        tries, last = timeouts_s, None
        for retry in range(self.config.upstream_retries + 1):
            if last is not None:
                tries = self._next(retry, until, last, timeouts_s)
            try:
                resp = send(self.backend, tries)
            except UpstreamRejected:
                self.states[self.backend].breaker.success()  # it answered: it is there
                raise
            except UpstreamTooLarge:
                # It answered 2xx and generated: a reply too large to relay is no sign of a
                # sick backend, and another backend would generate (and be paid for) it again.
                self.states[self.backend].breaker.success()
                self.answered = True
                raise
            except (UpstreamError, ServiceUnavailable) as err:
                self._failed(err, cut=tries != timeouts_s)
                if retry >= self.config.upstream_retries or time.monotonic() >= until:
                    raise
                last = err
                continue
            self.states[self.backend].breaker.success()
            self.answered = True
            return resp
        raise AssertionError("unreachable")  # the last try returns or raises

    def _next(self, retry, until, last, timeouts_s):
        """Wait a jittered backoff (within the deadline), then take another backend; return
        the try's timeouts, cut to the time left. Raise ``last`` (the client learns what the
        backends did) when no backend is left or no time."""
        gevent.sleep(max(0.0, min(until - time.monotonic(), random.uniform(
            0, self.config.upstream_retry_backoff_s * 2 ** (retry - 1)))))
        self.release()
        try:
            self.take(self.config.backend_wait_s, until=until)
        except ServiceUnavailable:
            raise last from None
        left = until - time.monotonic()
        return tuple(min(t, left) for t in timeouts_s)

    def _failed(self, err, cut=False):
        """Feed the breaker and the error counter (a 429 is a full backend, not a sick one;
        a timeout cut short by the deadline proves nothing of the backend)."""
        backend, m = self.backend, self.services.metrics
        kind = err.code if isinstance(err, UpstreamError) else "at_capacity"
        m.child(m.backend_errors, self.entry.id, backend.url, kind).inc()
        if not isinstance(err, UpstreamError) or (cut and isinstance(err, UpstreamTimeout)):
            return
        if err.code in (UNREACHABLE, CONNECT_TIMEOUT):
            note_failure(backend, self.states[backend].breaker, self.policy, err.code,
                         at_once=True)
        elif self._others_up(backend):
            # A 5xx or a timeout never takes out a model's last backend in rotation: its
            # clients are better served by that backend's own errors than by 503s.
            note_failure(backend, self.states[backend].breaker, self.policy, err.code,
                         request=True)

    def _others_up(self, backend):
        now = time.monotonic()
        return any(b is not backend and b.weight > 0 and self.states[b].breaker.is_up(now)
                   for b in self.entry.backends)


def prepare(catalog, config):
    """Return this worker's :class:`~gateway.backends.health.BackendStates` of ``catalog``'s
    backends, each with its slots and the host's load counters (one cell of this worker's)."""
    states = BackendStates()
    directory = slot_dir(config.slot_dir)
    host_load, slots = HostLoad(directory), {}
    backends = [b for entry in catalog.values() for b in entry.backends]
    for backend in backends:  # one server named by several models: one cap, the smallest
        caps = [b.max_in_flight for b in backends if b.url == backend.url and b.max_in_flight]
        if backend.url not in slots:
            slots[backend.url] = Slots(directory, backend.url, min(caps, default=0))
        states[backend].attach(slots[backend.url], host_load, backend.url)
    return states


# A generation's end (``usage_events.status``) that is its backend's failure once the backend had
# answered: counted in ``kiln_backend_errors_total`` by the outcome's code, a stream that broke or
# ended incomplete under its own kind (the code ``upstream_error`` is a failed try's too).
BACKEND_FAILURES = ("upstream_error", "timeout")
AFTER_HEADERS = {"upstream_error": "upstream_error_after_headers"}


def observe(metrics, route, status, code, first_token_s, completion_tokens, elapsed_s):
    """Count a settled generation on the backend that answered it: a failure of that backend
    after its headers (an idle timeout, a broken or incomplete stream), its time to first
    token, and its tokens/s after the first (not of a stream the backend failed: an idle
    timeout's wait is no rate of generation).

    :param status: the usage event's status; ``code`` its error code.
    :param elapsed_s: admission to settlement, seconds (0: not a stream, no rate).
    """
    backend = route.backend
    if backend is None or not route.answered:
        return  # failed tries were counted as they failed (:meth:`Route._failed`)
    model, failed = route.entry.id, status in BACKEND_FAILURES
    if failed:
        kind = AFTER_HEADERS.get(code, code) or AFTER_HEADERS["upstream_error"]
        metrics.child(metrics.backend_errors, model, backend.url, kind).inc()
    if first_token_s is None:
        return
    metrics.child(metrics.backend_ttft, model, backend.url).observe(first_token_s)
    stream_s = elapsed_s - first_token_s
    if not failed and elapsed_s > 0 and stream_s > 0 and completion_tokens:
        metrics.child(metrics.backend_tokens_per_s, model, backend.url).observe(
            completion_tokens / stream_s)
