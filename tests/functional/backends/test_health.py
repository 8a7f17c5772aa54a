"""The circuit breaker and the active probe of gateway/backends/health.py, in-process
(docs/ROUTING.md, "Health"). Through gunicorn: tests/functional/backends/test_fleet.py."""
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from factories import UNREACHABLE_BACKEND
from gateway.contract.catalog import Backend
from gateway.backends.health import BackendStates, Breaker, BreakerPolicy, probe

STATES = BackendStates()  # what the probe learns of each backend made here


# -- circuit breaker -----------------------------------------------------------------------

def test_breaker_opens_after_consecutive_failures_with_growing_cooldown():
    policy, breaker = BreakerPolicy(failures=3, cooldown_s=10, max_cooldown_s=25), Breaker()
    assert not breaker.failure(policy) and not breaker.failure(policy)
    breaker.success()  # not consecutive any more
    assert not breaker.failure(policy) and not breaker.failure(policy)
    before = time.monotonic()
    assert breaker.failure(policy)
    now = time.monotonic()
    assert not breaker.is_up(now) and breaker.state(now) == "open"
    assert opened_for(breaker, before, now, 10)
    assert breaker.is_up(now + 11) and breaker.state(now + 11) == "half_open"
    before = time.monotonic()
    assert breaker.failure(policy)  # half-open: one failure reopens, for twice as long
    assert opened_for(breaker, before, time.monotonic(), 20)
    before = time.monotonic()
    assert breaker.failure(policy)
    assert opened_for(breaker, before, time.monotonic(), 25)  # the ceiling
    breaker.success()
    assert breaker.state(time.monotonic()) == "closed"
    assert not breaker.failure(policy)  # a fresh count after closing


def test_a_refused_connection_opens_at_once():
    breaker = Breaker()
    assert breaker.failure(BreakerPolicy(), at_once=True)
    assert not breaker.is_up(time.monotonic())


def test_a_probe_that_cannot_connect_takes_the_backend_out_and_says_so(caplog):
    backend = Backend(url=UNREACHABLE_BACKEND, model="m")
    with caplog.at_level("WARNING", logger="gateway.backends.health"), \
            requests.Session() as session:
        assert probe(session, backend, STATES[backend].breaker, "/models", 5,
                     BreakerPolicy(cooldown_s=5)) == "down"
    assert not STATES[backend].breaker.is_up(time.monotonic())
    assert f"backend {UNREACHABLE_BACKEND} out of rotation for 5 s: probe could not connect " \
        "(ConnectionError)" in caplog.text


def test_a_probe_on_a_connection_the_server_dropped_tries_a_new_one(caplog):
    """A model server that closes an idle keep-alive connection (uvicorn after 5 s) just as
    the next probe reuses it is not taken out of rotation."""
    listener = socket.create_server(("127.0.0.1", 0))
    connections = []

    answer = b'HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}'  # keep-alive

    def serve():
        first, _ = listener.accept()
        connections.append(first)
        first.recv(65536)
        first.sendall(answer)
        first.recv(65536)  # the next probe, on the kept connection: its keep-alive ran out
        first.close()      # as it arrived, so it is closed unanswered
        second, _ = listener.accept()
        connections.append(second)
        second.recv(65536)
        second.sendall(answer)
        second.close()
    threading.Thread(target=serve, daemon=True).start()
    backend = Backend(url=f"http://127.0.0.1:{listener.getsockname()[1]}/v1", model="m")
    with caplog.at_level("WARNING", logger="gateway.backends.health"), \
            requests.Session() as session:
        assert probe(session, backend, STATES[backend].breaker, "/models", 5,
                     BreakerPolicy()) == "up"
        assert probe(session, backend, STATES[backend].breaker, "/models", 5,
                     BreakerPolicy()) == "up"
    assert STATES[backend].breaker.is_up(time.monotonic()) and "out of rotation" not in caplog.text
    assert len(connections) == 2
    listener.close()




# -- the probe and failed chat requests ----------------------------------------------------

class ModelsOnly(BaseHTTPRequestHandler):
    """A model server whose ``GET /models`` answers (what its chat endpoint does is up to the
    test, which feeds the breaker the failures of its chat requests)."""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.fixture
def answering():
    """A :class:`Backend` whose probe path answers 200, and a session to probe it with."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), ModelsOnly)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with requests.Session() as session:
        yield Backend(url=f"http://127.0.0.1:{server.server_port}/v1", model="m"), session
    server.shutdown()
    server.server_close()


def opened_for(breaker, before, after, cooldown_s):
    """Whether ``breaker`` was opened for ``cooldown_s`` by a failure between the
    ``time.monotonic()`` readings ``before`` and ``after`` (exact: no margin for the clock to
    run out on a loaded machine)."""
    return before + cooldown_s <= breaker.open_until <= after + cooldown_s


POLICY = BreakerPolicy(failures=2, cooldown_s=10, max_cooldown_s=100)


def test_the_probe_never_brings_back_a_backend_whose_chat_requests_failed(answering):
    """Its cool-down keeps growing: the probe leaves it open, then half-open; only a
    request's success closes it."""
    backend, session = answering
    breaker = STATES[backend].breaker
    breaker.failure(POLICY, request=True)
    before = time.monotonic()
    assert breaker.failure(POLICY, request=True)  # two 5xx in a row: open for 10 s
    after = time.monotonic()
    assert probe(session, backend, STATES[backend].breaker, "/models", 5, POLICY) == "failing"
    assert breaker.state(time.monotonic()) == "open" and opened_for(breaker, before, after, 10)
    breaker.open_until = time.monotonic() - 1  # the cool-down ran out: half-open
    assert probe(session, backend, STATES[backend].breaker, "/models", 5, POLICY) == "failing"
    assert breaker.state(time.monotonic()) == "half_open"
    before = time.monotonic()
    assert breaker.failure(POLICY, request=True)  # the one request let through failed
    assert opened_for(breaker, before, time.monotonic(), 20)  # twice as long: growth kept
    breaker.open_until = time.monotonic() - 1
    breaker.success()                             # the next one was answered
    assert breaker.state(time.monotonic()) == "closed" and breaker.openings == 0
    assert probe(session, backend, STATES[backend].breaker, "/models", 5, POLICY) == "up"


def test_the_probe_does_not_wipe_a_count_of_failed_chat_requests(answering):
    backend, session = answering
    breaker = STATES[backend].breaker
    assert not breaker.failure(POLICY, request=True)
    assert probe(session, backend, STATES[backend].breaker, "/models", 5, POLICY) == "failing"
    assert breaker.failure(POLICY, request=True)  # still two in a row


def test_the_probe_brings_back_a_backend_taken_out_as_unreachable(answering):
    """Refused connections (a request's or the probe's) mean the server was gone: the first
    probe it answers brings it back, its cool-down reset, even after its chat had failed."""
    backend, session = answering
    breaker = STATES[backend].breaker
    for _ in range(2):
        breaker.failure(POLICY, request=True)
    breaker.open_until = time.monotonic() - 1
    assert breaker.failure(POLICY, at_once=True)  # restarting: refused
    assert breaker.state(time.monotonic()) == "open"
    assert probe(session, backend, STATES[backend].breaker, "/models", 5, POLICY) == "up"
    assert breaker.state(time.monotonic()) == "closed" and breaker.openings == 0


def test_the_probe_brings_back_a_backend_its_own_failures_took_out():
    listener = socket.create_server(("127.0.0.1", 0))
    failing = threading.Event()
    failing.set()

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(65536)
            status = b"500 Internal Server Error" if failing.is_set() else b"200 OK"
            conn.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Length: 2\r\n"
                         b"Connection: close\r\n\r\n{}")
            conn.close()
    threading.Thread(target=serve, daemon=True).start()
    backend = Backend(url=f"http://127.0.0.1:{listener.getsockname()[1]}/v1", model="m")
    with requests.Session() as session:
        for _ in range(2):
            assert probe(session, backend, STATES[backend].breaker, "/models", 5, POLICY) == "down"
        assert STATES[backend].breaker.state(time.monotonic()) == "open"
        failing.clear()
        assert probe(session, backend, STATES[backend].breaker, "/models", 5, POLICY) == "up"
    assert STATES[backend].breaker.state(time.monotonic()) == "closed"
    listener.close()
