"""Retries before the first byte (gateway/backends/fleet.py, :meth:`Route.open`), in-process:
the budget, the deadline and the timeouts it cuts, the jittered backoff, 429s
(docs/ROUTING.md, "Retries"). Through gunicorn: tests/functional/backends/test_fleet.py."""
import time

import pytest

from factories import TIMEOUTS, URLS, backends, entry, services
from fake_upstream import FakeUpstream, error_reply
from gateway.backends import fleet, upstream
from gateway.contract.catalog import Backend
from gateway.errors import ServiceUnavailable, UpstreamError, UpstreamRejected, UpstreamTimeout
from gateway.backends.fleet import Route
from gateway.endings import FIRST_BYTE_TIMEOUT, UNREACHABLE

pytestmark = pytest.mark.unit


def scripted(outcomes):
    """``send(backend, timeouts_s)`` that fails as ``outcomes[url]`` says (an exception),
    else answers."""
    calls = []

    def send(backend, timeouts_s):
        calls.append(backend.url)
        err = outcomes.get(backend.url)
        if err is not None:
            raise err
        return f"response of {backend.url}"
    return send, calls


def test_a_failure_before_the_first_byte_is_retried_on_another_backend(tmp_path):
    fleet = backends()
    route = Route(services(tmp_path, upstream_retries=2), entry(fleet), [])
    route.take(0)
    failing = {route.backend.url: UpstreamError("boom")}
    send, calls = scripted(failing)
    resp = route.open(send, TIMEOUTS)
    assert resp == f"response of {calls[-1]}" and len(calls) == 2 and len(set(calls)) == 2
    assert route.tried == calls and route.backend.url == calls[-1]
    # the failed try's slot was given back
    assert sum(route.states[b].in_flight for b in fleet) == 1
    route.release()
    assert sum(route.states[b].in_flight for b in fleet) == 0


def test_retries_stop_at_the_budget_and_raise_the_last_error(tmp_path):
    fleet = backends()
    route = Route(services(tmp_path, upstream_retries=1), entry(fleet), [])
    route.take(0)
    send, calls = scripted({u: UpstreamTimeout("slow", code=FIRST_BYTE_TIMEOUT) for u in URLS})
    with pytest.raises(UpstreamTimeout):
        route.open(send, TIMEOUTS)
    assert len(calls) == 2


def test_no_retry_once_every_live_backend_was_tried(tmp_path):
    fleet = backends()[:2]
    route = Route(services(tmp_path, upstream_retries=5), entry(fleet), [])
    route.take(0)
    send, calls = scripted({u: UpstreamError("boom") for u in URLS})
    with pytest.raises(UpstreamError):
        route.open(send, TIMEOUTS)
    assert sorted(calls) == sorted(URLS[:2])


def test_a_rejected_request_is_not_retried(tmp_path):
    route = Route(services(tmp_path), entry(backends()), [])
    route.take(0)
    send, calls = scripted({u: UpstreamRejected("too long") for u in URLS})
    with pytest.raises(UpstreamRejected):
        route.open(send, TIMEOUTS)
    assert len(calls) == 1


def test_failures_feed_the_breaker_but_never_eject_the_last_backend(tmp_path):
    svc = services(tmp_path, upstream_retries=0, breaker_failures=2)
    fleet = backends()[:2]
    for _ in range(3):  # one of the two failed twice in a row by the third
        route = Route(svc, entry(fleet), [])
        route.take(0)
        send, _ = scripted({u: UpstreamError("boom") for u in URLS})
        with pytest.raises(UpstreamError):
            route.open(send, TIMEOUTS)
        route.release()
    out = [b for b in fleet if not svc.states[b].breaker.is_up(time.monotonic())]
    assert len(out) == 1 and svc.states[out[0]].breaker.requests_failed  # the probe leaves it out
    alone = backends()[:1]
    for _ in range(5):
        route = Route(svc, entry(alone), [])
        route.take(0)
        with pytest.raises(UpstreamError):
            route.open(scripted({URLS[0]: UpstreamError("boom")})[0], TIMEOUTS)
        route.release()
    assert svc.states[alone[0]].breaker.is_up(time.monotonic())  # a 5xx keeps the only one in
    route = Route(svc, entry(alone), [])
    route.take(0)
    with pytest.raises(UpstreamError):
        route.open(scripted({URLS[0]: UpstreamError("refused", code=UNREACHABLE)})[0], TIMEOUTS)
    route.release()
    with pytest.raises(ServiceUnavailable) as err:  # a refused connection takes it out
        Route(svc, entry(alone), []).take(0)
    assert err.value.code == "no_backend_available"




# -- the deadline ----------------------------------------------------------------------------

def test_a_retry_waits_no_longer_than_the_time_left_before_the_deadline(tmp_path):
    """The first try has its full timeouts; a retry's are cut to what is left of the deadline,
    and no try begins past it (the second try's cut timeout fires at the deadline)."""
    fleet = backends()
    route = Route(services(tmp_path, upstream_retries=5, upstream_retry_deadline_s=1.0),
                  entry(fleet), [])
    route.take(0)
    tries = []

    def send(backend, timeouts_s):  # a backend silent until its first-byte timeout fires
        tries.append((time.monotonic(), backend, timeouts_s))
        time.sleep(min(timeouts_s[1], 0.6))
        raise UpstreamTimeout("slow", code=FIRST_BYTE_TIMEOUT)
    started = time.monotonic()
    with pytest.raises(UpstreamTimeout):
        route.open(send, TIMEOUTS)
    assert len(tries) == 2  # the third would begin past the deadline
    (_, first, first_timeouts), (begun, second, cut) = tries
    assert first_timeouts == TIMEOUTS
    # The retry's timeouts are what was left of the 1 s deadline when it began: at least
    # what the clock shows was left (the deadline counts from within the ``open`` call), and
    # no more than what the first try's 0.6 s left, however loaded the machine.
    assert started + 1.0 - begun <= cut[0] == cut[1] < 0.45 and begun - started < 1.0
    assert all(t - started < 1.0 for t, _, _ in tries)
    assert time.monotonic() - started < 5  # not the full 30 s of a first byte
    assert route.states[first].breaker.failures == 1
    assert route.states[second].breaker.failures == 0  # cut short: it proves nothing of the backend
    route.release()


def test_no_retry_begins_while_waiting_for_a_slot_past_the_deadline(tmp_path):
    fleet = backends(caps=(1, 1, 0))[:2]
    svc = services(tmp_path, upstream_retries=2, upstream_retry_deadline_s=0.3,
                   backend_wait_s=5)
    route = Route(svc, entry(fleet), [])
    route.take(0)
    other = fleet[1] if route.backend is fleet[0] else fleet[0]
    holder = Route(svc, entry([other]), [])
    holder.take(0)  # the other backend's only slot is taken
    send, calls = scripted({u: UpstreamError("boom") for u in URLS})
    started = time.monotonic()
    with pytest.raises(UpstreamError):  # the client learns what the backend did
        route.open(send, TIMEOUTS)
    assert 0.3 <= time.monotonic() - started < 2.5  # the deadline, not backend_wait_s's 5 s
    assert calls == [route.tried[0]] and route.tried == calls
    route.release()
    holder.release()


# -- the backoff -----------------------------------------------------------------------------

def test_the_backoff_is_drawn_in_zero_to_base_times_two_to_the_retry(tmp_path, monkeypatch):
    draws, sleeps = [], []

    def uniform(low, high):
        draws.append((low, high))
        return high
    monkeypatch.setattr(fleet.random, "uniform", uniform)
    monkeypatch.setattr(fleet.gevent, "sleep", sleeps.append)
    route = Route(services(tmp_path, upstream_retries=2, upstream_retry_backoff_s=0.1),
                  entry(backends()), [])
    route.take(0)
    send, calls = scripted({u: UpstreamError("boom") for u in URLS})
    with pytest.raises(UpstreamError):
        route.open(send, TIMEOUTS)
    assert len(calls) == 3
    assert draws == [(0, 0.1), (0, 0.2)] and sleeps == [0.1, 0.2]  # the draw is what it waits


def test_the_backoff_is_jittered_within_its_range(tmp_path, monkeypatch):
    sleeps = []
    monkeypatch.setattr(fleet.gevent, "sleep", sleeps.append)
    svc = services(tmp_path, upstream_retries=2, upstream_retry_backoff_s=0.1)
    for _ in range(50):
        route = Route(svc, entry(backends()), [])
        route.take(0)
        with pytest.raises(UpstreamError):
            route.open(scripted({u: UpstreamError("boom") for u in URLS})[0], TIMEOUTS)
        route.release()
        for b in route.entry.backends:
            route.states[b].breaker.success()
    firsts, seconds = sleeps[0::2], sleeps[1::2]
    assert all(0 <= s <= 0.1 for s in firsts) and all(0 <= s <= 0.2 for s in seconds)
    assert max(seconds) > 0.1 and len(set(firsts)) == 50  # spread, not a fixed wait


# -- 429: a backend at capacity ----------------------------------------------------------------

@pytest.fixture
def pair(tmp_path):
    """Two fake upstreams behind one model, and a route over them (no backoff)."""
    with FakeUpstream() as one, FakeUpstream() as two:
        fakes = (one, two)
        fleet_ = [Backend(url=f.base_url, model="m") for f in fakes]
        route = Route(services(tmp_path, upstream_retries=2), entry(fleet_), [])
        route.take(0)
        session = upstream.create_session(4)
        yield fakes, route, lambda b, timeouts_s: upstream.open_chat(session, b, b"{}",
                                                                     timeouts_s)
        route.release()
        session.close()


def test_a_429_from_every_backend_is_retried_then_503_with_retry_after(pair):
    fakes, route, send = pair
    for fake in fakes:
        fake.enqueue(error_reply(429, "busy"))
    with pytest.raises(ServiceUnavailable) as err:
        route.open(send, TIMEOUTS)
    assert err.value.status == 503 and err.value.headers["Retry-After"] == "1"
    assert sorted(route.tried) == sorted(f.base_url for f in fakes)
    assert all(len(f.requests) == 1 for f in fakes)
    # full, not sick
    assert all(route.states[b].breaker.failures == 0 for b in route.entry.backends)


def test_a_429_then_an_answer_is_answered(pair):
    fakes, route, send = pair
    first = next(f for f in fakes if f.base_url == route.backend.url)
    first.enqueue(error_reply(429, "busy"))
    resp = route.open(send, TIMEOUTS)
    assert resp.status_code == 200 and route.backend.url != first.base_url
    assert route.tried == [first.base_url, route.backend.url]
    resp.close()
