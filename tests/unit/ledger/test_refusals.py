"""A worker never stops settling (docs/RELIABILITY.md): a settlement or a lease renewal the
database refuses for its values is isolated from the others of its batch, written again within
the columns' ranges, and otherwise given up to the sweeper; a transient failure is still retried
until it commits; a background greenlet that raises is restarted and reported down meanwhile."""
import gevent
from gevent.event import Event

from gateway.background import Background
from gateway.billing import Usage
from gateway.ledger import Settlement
from gateway.ledger.worker import Renewer, SettlementWriter, refused_for_its_data

LONG_URL = "http://backend.example/v1/" + "a" * 600  # past usage_events.backend's 500


class DataError(Exception):
    """A driver's refusal of a value: SQLSTATE 22001 (string data right truncation)."""

    sqlstate = "22001"


class ConnectionLost(Exception):
    """A driver's failure to run the statement at all: SQLSTATE 08006."""

    sqlstate = "08006"


class RefusingStore:
    """Refuses, as Postgres would, any batch holding a settlement whose backend is longer than
    its column, or one of ``always`` (refused whatever it holds); fails ``transient`` times
    with a lost connection first."""

    def __init__(self, always=(), transient=0):
        self.always, self.transient = set(always), transient
        self.committed, self.calls = {}, 0

    def settle_batch(self, batch):
        self.calls += 1
        if self.transient:
            self.transient -= 1
            raise ConnectionLost("server closed the connection")
        if any(len(s.backend or "") > 500 or s.gid in self.always for s in batch):
            raise DataError("value too long for type character varying(500)")
        for s in batch:
            self.committed[s.gid] = s
        return {s.gid: s.cost_nanos for s in batch}


class Counter:
    def __init__(self):
        self.value = 0

    def inc(self):
        self.value += 1


class Metrics:
    def __init__(self):
        self.settlements_refused = Counter()
        self.settlement = self.settlement_batch = self  # histograms: observed, not checked

    def observe(self, value):
        pass


def settlement(gid, backend="http://backend.example/v1", prompt=5):
    return Settlement(gid=gid, org_id=1, key_id=1, model="m", stream=False,
                      status="completed", usage=Usage(prompt=prompt, completion=3),
                      cost_nanos=11, backend=backend)


def write(store, settlements, metrics=None):
    forgotten = []
    writer = SettlementWriter(store, metrics, on_committed=forgotten.append)
    for s in settlements:
        writer.put(s)
    assert writer.wait_idle(5), "the writer is stuck"
    return forgotten


def test_the_sqlstate_class_decides_what_is_retried():
    assert refused_for_its_data(DataError()) and not refused_for_its_data(ConnectionLost())
    assert not refused_for_its_data(RuntimeError("no sqlstate"))


def test_a_refused_settlement_is_written_within_its_columns_and_the_others_commit():
    store = RefusingStore()
    batch = [settlement(f"gen-{i}") for i in range(7)] + [settlement("gen-long", LONG_URL)]
    forgotten = write(store, batch)
    assert set(store.committed) == {s.gid for s in batch}
    kept = store.committed["gen-long"]
    assert kept.backend == LONG_URL[:500] and kept.cost_nanos == 11  # billed in full
    assert kept.usage == Usage(prompt=5, completion=3)
    assert all(s.committed.is_set() for s in batch) and batch[-1].debited == 11
    assert sorted(forgotten) == sorted(s.gid for s in batch)


def test_a_settlement_refused_even_within_its_columns_is_left_to_the_sweeper():
    store, metrics = RefusingStore(always={"gen-poison"}), Metrics()
    batch = [settlement("gen-a"), settlement("gen-poison", LONG_URL), settlement("gen-b")]
    forgotten = write(store, batch, metrics)
    assert set(store.committed) == {"gen-a", "gen-b"}
    poison = batch[1]
    assert poison.committed.is_set() and poison.debited is None  # nobody waits forever
    assert "gen-poison" in forgotten  # its lease is no longer renewed: the sweeper bills it
    assert metrics.settlements_refused.value == 1


def test_a_batch_is_split_only_as_far_as_the_refusal():
    store = RefusingStore(always={"gen-5"})
    write(store, [settlement(f"gen-{i}") for i in range(16)])
    assert len(store.committed) == 15
    # 16 -> 8 + 8 -> the good half in one statement; 8 -> 4 + 4 -> ... -> 1: no retry loop
    assert store.calls <= 2 * 4 + 2


def test_a_transient_failure_is_still_retried_until_it_commits():
    store = RefusingStore(transient=3)
    write(store, [settlement("gen-a"), settlement("gen-b")])
    assert set(store.committed) == {"gen-a", "gen-b"} and store.calls == 4


class RenewingStore:
    """Refuses a renewal whose progress is above 32 bits."""

    def __init__(self):
        self.renewed = {}

    def renew(self, leases, ttl_s):
        if any(u is not None and u.prompt > 2 ** 31 - 1 for _, u in leases):
            raise DataError("integer out of range")
        self.renewed.update(leases)
        return {gid: "renewed" for gid, _ in leases}


class Lease:
    def __init__(self, gid, prompt):
        self.gid, self.usage, self.lost = gid, Usage(prompt=prompt), Event()

    def progress(self):
        return self.usage


def test_a_refused_renewal_renews_the_lease_without_its_progress_and_the_others_with_theirs():
    store = RenewingStore()
    renewer = Renewer(store, lease_ttl_s=60)
    leases = [Lease("gen-a", 5), Lease("gen-huge", 2 ** 40), Lease("gen-b", 7)]
    renewer.live = {lease.gid: lease for lease in leases}
    renewer.renew_now()
    assert store.renewed == {"gen-a": Usage(prompt=5), "gen-huge": None, "gen-b": Usage(prompt=7)}


def test_a_background_greenlet_that_raises_is_restarted_and_down_meanwhile():
    restarts, runs = [], []
    background = Background(on_restart=restarts.append)

    def run():
        runs.append(1)
        if len(runs) == 1:
            raise RuntimeError("driver error")
        gevent.sleep(10)  # then runs as meant: forever

    background.spawn("ledger.settlements", run)
    gevent.sleep(0.01)
    assert background.down == {"ledger.settlements": "RuntimeError"}
    assert restarts == ["ledger.settlements"]
    gevent.sleep(0.2)  # past the first backoff
    assert len(runs) == 2 and background.down == {}
    assert background.spawn("ledger.settlements", run) is background._greenlets[
        "ledger.settlements"]  # one greenlet per name
    background.stop()


def test_readyz_names_a_background_greenlet_that_is_down(kiln):
    app, _ = kiln
    services = app.extensions["kiln"]
    client = app.test_client()
    assert client.get("/readyz").status_code == 200
    services.background.down["sweeper"] = "OperationalError"
    try:
        r = client.get("/readyz")
        assert r.status_code == 503
        assert r.get_json() == {"status": "unavailable",
                                "background": {"sweeper": "OperationalError"}}
    finally:
        services.background.down.clear()
