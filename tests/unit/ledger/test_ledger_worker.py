"""The ledger's greenlets in one worker (gateway/ledger/worker.py), with a scripted store: an
admission that waits past its deadline gives up and is settled when the database answers
after all; waiting for an org's or a generation's outstanding settlements."""
import time

import gevent
import gevent.socket
import pytest
from gevent.event import Event

from gateway.billing import Usage
from gateway.ledger import Settlement
from gateway.ledger.worker import AdmissionTurn, Admitter, Renewer, SettlementWriter

pytestmark = pytest.mark.unit


class Request:
    def __init__(self, gid, org_id=1):
        self.gid, self.org_id = gid, org_id


class StalledStore:
    """``admit_batch`` answers only once ``release`` is set; ``settle_batch`` likewise."""

    def __init__(self):
        self.release = Event()
        self.settled = []

    def admit_batch(self, requests):
        self.release.wait()
        return [(r.gid, "t0", None, None, None, None, None, None) for r in requests]

    def settle_batch(self, batch):
        self.release.wait()
        self.settled += [s.gid for s in batch]
        return {s.gid: s.cost_nanos for s in batch}


def settlement(gid, org_id):
    return Settlement(gid=gid, org_id=org_id, key_id=1, model="m", stream=False,
                      status="completed", usage=Usage(prompt=1), cost_nanos=7)


def test_an_admission_past_its_deadline_gives_up_and_is_settled_when_it_lands():
    store, orphans = StalledStore(), []
    admitter = Admitter(store, on_orphan=lambda request, row: orphans.append((request, row)))
    with pytest.raises(gevent.Timeout):
        admitter.admit(Request("gen-late"), timeout_s=0.05)
    assert orphans == []
    store.release.set()
    row = admitter.admit(Request("gen-next"), timeout_s=1)  # the queue goes on
    assert row[0] == "gen-next"
    assert [(r.gid, row[0]) for r, row in orphans] == [("gen-late", "gen-late")]


def test_waiting_for_an_orgs_outstanding_settlements():
    store = StalledStore()
    writer = SettlementWriter(store)
    assert writer.wait_for(1, org_id=1) is False  # nothing outstanding: no wait
    first, other = settlement("gen-a", 1), settlement("gen-b", 2)
    writer.put(first)
    writer.put(other)
    gevent.sleep(0)
    assert writer.wait_for(0.05, org_id=1) is True and not first.committed.is_set()
    gevent.spawn_later(0.05, store.release.set)
    assert writer.wait_for(2, org_id=1) is True
    assert first.committed.is_set() and first.debited == 7
    assert writer.wait_idle(2) and writer.wait_for(1, gid="gen-b") is False
    assert sorted(store.settled) == ["gen-a", "gen-b"]



class PromptStore:
    """Answers every admission and settlement at once, recording the settled ids."""

    def __init__(self):
        self.settled = []

    def admit_batch(self, requests):
        return [(r.gid, "t0", None, None, None, None, None, None) for r in requests]

    def settle_batch(self, batch):
        self.settled += [s.gid for s in batch]
        return {s.gid: s.cost_nanos for s in batch}


def deferring_pair(defer_s=60.0):
    """A writer that defers its batches up to ``defer_s`` and the admitter that ends the wait."""
    store = PromptStore()
    writer = SettlementWriter(store, turn=AdmissionTurn(defer_s))
    admitter = Admitter(store, on_answered=writer.turn.answered)
    return store, writer, admitter


def test_a_settlement_waits_for_the_workers_next_admission_then_is_written():
    store, writer, admitter = deferring_pair()
    done = settlement("gen-a", 1)
    writer.put(done)
    gevent.sleep(0.02)
    assert store.settled == [] and not done.committed.is_set()  # deferred: no admission yet
    assert admitter.admit(Request("gen-next"), timeout_s=1)[0] == "gen-next"
    assert done.committed.wait(5) and store.settled == ["gen-a"]


def test_a_settlement_someone_waits_for_is_not_deferred():
    store, writer, _ = deferring_pair()
    urgent = settlement("gen-u", 1)
    writer.put(urgent, urgent=True)
    assert urgent.committed.wait(5) and store.settled == ["gen-u"]
    later = settlement("gen-w", 2)
    writer.put(later)
    gevent.sleep(0.02)
    assert store.settled == ["gen-u"]  # the next one is deferred again
    assert writer.wait_for(5, org_id=2) is True  # waiting for it writes it now
    assert later.committed.is_set() and store.settled == ["gen-u", "gen-w"]


def test_a_deferred_settlement_is_written_without_any_admission():
    store, writer, _ = deferring_pair(defer_s=0.01)
    alone = settlement("gen-alone", 1)
    writer.put(alone)
    assert alone.committed.wait(5) and store.settled == ["gen-alone"]
    drained = settlement("gen-drained", 1)
    writer.put(drained)
    writer.turn.defer_s = 60.0
    assert writer.wait_idle(5) and store.settled == ["gen-alone", "gen-drained"]



class SocketStore:
    """``admit_batch`` answers once a byte arrives on its socket (as a database's reply)."""

    def __init__(self):
        self.ours, self.database = gevent.socket.socketpair()

    def admit_batch(self, requests):
        self.ours.recv(1)
        return [(r.gid, "t0", None, None, None, None, None, None) for r in requests]


def admit_as_the_deadline_passes():
    """One admission whose answer and deadline fall due together: (outcome, orphans)."""
    store, orphans, outcome = SocketStore(), [], []
    admitter = Admitter(store, on_orphan=lambda request, row: orphans.append(row[0]))

    def request():
        try:
            outcome.append(admitter.admit(Request("gen-edge"), timeout_s=0.02)[0])
        except gevent.Timeout:
            outcome.append("timeout")
    waiting = gevent.spawn(request)
    gevent.sleep(0.005)  # queued; the batch waits for the database
    store.database.send(b"x")
    time.sleep(0.05)  # the hub held past the deadline: answer and timeout due together
    waiting.join()
    gevent.sleep(0.01)
    return outcome, orphans


def test_an_answer_that_lands_with_the_deadline_is_settled_never_dropped():
    """The database's answer and the request's deadline can fall due in one turn of the event
    loop; the answer's greenlet may run first and hand the row over, and gevent's
    AsyncResult.get still raises the timeout. The admission is then handed to ``on_orphan``
    to be settled (the request gave up: 503), never left leased (a slot lost until the
    sweeper)."""
    for _ in range(5):
        assert admit_as_the_deadline_passes() in ((["gen-edge"], []),
                                                  (["timeout"], ["gen-edge"]))


class RecordingStore:
    """``renew`` keeps each call's ``(gid, usage)`` leases and TTL."""

    def __init__(self):
        self.renewals = []

    def renew(self, leases, lease_ttl_s):
        self.renewals.append((list(leases), lease_ttl_s))
        return {gid: "leased" for gid, _ in leases}


class Running:
    def __init__(self, gid, completion):
        self.gid, self.completion, self.lost = gid, completion, Event()

    def progress(self):
        return Usage(prompt=3, completion=self.completion)


class Stop(Exception):
    pass


@pytest.mark.parametrize("lease_ttl_s, every_s", [(3600, 5.0), (60, 5.0), (15, 5.0), (6, 2.0)])
def test_progress_is_recorded_at_least_every_5_s_whatever_the_lease_ttl(monkeypatch, lease_ttl_s,
                                                                        every_s):
    """README "Metering": what the sweeper bills a killed worker's generation lags its real usage
    by at most the renewal interval, a third of the lease's TTL capped at 5 s
    (``RENEW_EVERY_MAX_S``): a long TTL must not stretch it. Each wait of the renewer is read
    (not slept) and each renewal carries the lease's progress at that moment."""
    store, lease = RecordingStore(), Running("gen-a", completion=0)
    renewer = Renewer(store, lease_ttl_s=lease_ttl_s)
    renewer.live = {lease.gid: lease}
    waits = []

    def sleep(seconds):
        waits.append(seconds)
        if len(waits) > 3:
            raise Stop
        lease.completion += 10  # tokens relayed meanwhile

    monkeypatch.setattr(gevent, "sleep", sleep)
    with pytest.raises(Stop):
        renewer._run()
    assert waits == [every_s] * 4
    assert store.renewals == [([("gen-a", Usage(prompt=3, completion=c))], lease_ttl_s)
                              for c in (10, 20, 30)]
