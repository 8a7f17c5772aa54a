"""The client watch and the stuck-write check (gateway/backends/client.py): event-loop watchers
on the client's socket, no greenlet of their own while nothing happens."""
import socket

import gevent
import pytest
from gevent import socket as gsocket

from gateway.backends.client import ClientWatch, guard_writes

pytestmark = pytest.mark.unit


@pytest.fixture
def pair():
    ours, theirs = gsocket.socketpair()
    yield ours, theirs
    ours.close()
    theirs.close()


def test_the_client_closing_sets_gone_and_calls_back_from_a_greenlet(pair):
    ours, theirs = pair
    watch = ClientWatch(ours)
    called = []
    watch.on_gone(lambda: called.append(gevent.getcurrent()))
    gevent.sleep(0.05)
    assert not watch.gone.is_set() and called == []
    theirs.close()
    assert watch.gone.wait(2)
    gevent.sleep(0.01)
    assert len(called) == 1 and called[0] is not gevent.get_hub()  # callbacks may block
    late = []
    watch.on_gone(lambda: late.append(1))  # already gone: called at once
    assert late == [1]
    watch.stop()


def test_bytes_of_a_next_request_are_not_the_client_leaving(pair):
    ours, theirs = pair
    watch = ClientWatch(ours)
    theirs.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")  # pipelined, left unread
    gevent.sleep(ClientWatch.RECHECK_S * 2.5)
    assert not watch.gone.is_set()
    assert ours.recv(4, socket.MSG_PEEK) == b"POST"  # the watch read nothing of it
    theirs.close()
    assert watch.gone.wait(2)
    watch.stop()


def test_a_stopped_watch_calls_nothing(pair):
    ours, theirs = pair
    watch = ClientWatch(ours)
    called = []
    watch.on_gone(lambda: called.append(1))
    watch.stop()
    theirs.close()
    gevent.sleep(0.1)
    assert not watch.gone.is_set() and called == []


def test_a_write_stuck_past_the_idle_time_hangs_up_on_the_client(pair):
    ours, theirs = pair
    closed = []

    def body():
        try:
            yield b"a"
            yield b"b"
        finally:
            closed.append(True)

    guarded = guard_writes(body(), ours, idle_s=0.2)
    assert next(guarded) == b"a"  # the server is now "writing" it and never asks for more
    gevent.sleep(0.6)
    theirs.settimeout(2)
    assert theirs.recv(10) == b""  # hung up: the client sees the connection end
    guarded.close()
    assert closed == [True]


def test_a_writer_that_keeps_up_is_left_alone(pair):
    ours, theirs = pair
    guarded = guard_writes((item for item in [b"x"] * 8), ours, idle_s=0.2)
    for item in guarded:
        gevent.sleep(0.05)
        ours.sendall(item)
    theirs.settimeout(2)
    assert theirs.recv(16) == b"x" * 8
