"""Routing policies, per-backend slots, retries and the catalog's fleet fields, in-process
(docs/ROUTING.md). Through gunicorn: tests/functional/backends/test_fleet.py."""
import random
import subprocess
import sys
import textwrap
from collections import Counter

import pytest
from click.testing import CliRunner

from gateway.ops import cli
from gateway.backends import routing
from gateway.backends.capacity import HostLoad, Slots
from gateway.contract.catalog import Backend, CatalogError, load_catalog
from gateway.config import Config
from factories import URLS, backends, entry, services
from gateway.errors import ServiceUnavailable
from gateway.backends.fleet import Route
from gateway.backends.health import BackendStates


def rank(policy, fleet, key=None, states=None, **kwargs):
    """``routing.rank`` with each backend's load read from ``states`` (none in flight when
    None)."""
    states = BackendStates() if states is None else states
    return routing.rank(policy, fleet, lambda b: states[b].load(), key, **kwargs)


def conversation(system, first, later=()):
    messages = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    for i, text in enumerate(later):
        messages += [{"role": "assistant", "content": f"answer {i}"},
                     {"role": "user", "content": text}]
    return messages


# -- policies ------------------------------------------------------------------------------

def test_weighted_draws_by_weight():
    fleet, rng = backends(weights=(3, 1, 0))[:2], random.Random(7)
    firsts = Counter(rank("weighted", fleet, rng=rng)[0].url for _ in range(4000))
    assert 0.70 < firsts[URLS[0]] / 4000 < 0.80


def test_a_drained_backend_gets_no_new_request(tmp_path):
    fleet = backends(weights=(1, 0, 1))
    chosen = set()
    for _ in range(200):
        route = Route(services(tmp_path), entry(fleet), [])
        chosen.add(route.take(0).url)
        route.release()
    assert chosen == {URLS[0], URLS[2]}


def test_least_outstanding_prefers_the_less_loaded_of_two():
    states = BackendStates()
    fleet = backends()[:2]
    states[fleet[0]].in_flight = 5
    for _ in range(50):
        assert rank("least-outstanding", fleet, states=states)[0] is fleet[1]
    fleet = backends()
    states[fleet[0]].in_flight, states[fleet[1]].in_flight = 4, 2
    firsts = Counter(rank("least-outstanding", fleet, states=states)[0].url for _ in range(600))
    # Only a draw of the two loaded ones puts a loaded one first (a third of the draws).
    assert firsts[URLS[0]] == 0 and firsts[URLS[2]] > firsts[URLS[1]]


def test_prefix_affinity_keeps_a_conversation_on_one_backend():
    fleet = backends()
    first = conversation("You are terse.", "Tell me about kilns.")
    key = routing.prefix_key(first)
    later = conversation("You are terse.", "Tell me about kilns.", ["More.", "And glazes?"])
    assert routing.prefix_key(later) == key
    assert routing.prefix_key(conversation("You are terse.", "Tell me about pots.")) != key
    assert routing.prefix_key([{"role": "assistant", "content": "hi"}]) is None
    home = rank("prefix-affinity", fleet, key)[0]
    assert all(rank("prefix-affinity", fleet, key)[0] is home for _ in range(20))


def test_prefix_affinity_spreads_conversations_and_moves_few_when_one_leaves():
    fleet = backends()
    keys = [routing.prefix_key(conversation("sys", f"question {i}")) for i in range(600)]
    homes = {k: rank("prefix-affinity", fleet, k)[0].url for k in keys}
    shares = Counter(homes.values())
    assert all(150 < shares[u] < 250 for u in URLS), shares
    rest = fleet[:2]
    moved = [k for k in keys if homes[k] != URLS[2]
             and rank("prefix-affinity", rest, k)[0].url != homes[k]]
    assert moved == []  # rendezvous hashing: only the leaving backend's keys move


def test_prefix_affinity_skips_a_backend_over_its_bounded_load():
    states = BackendStates()
    fleet = backends()
    key = routing.prefix_key(conversation("sys", "q"))
    home = rank("prefix-affinity", fleet, key, states=states)[0]
    others = [b for b in fleet if b is not home]
    # A backend is offered while its in flight + 1 fits max(ceil(1.5 × share), share + 2),
    # share = (all in flight + 1) / 3.
    states[home].in_flight = 4  # share 5/3: bound 3 < 5
    order = rank("prefix-affinity", fleet, key, states=states)
    assert order[0] is not home and order[-1] is home
    states[home].in_flight = 2  # share 1: bound 3, and 3 fits (few in flight: no scattering)
    assert rank("prefix-affinity", fleet, key, states=states)[0] is home
    states[home].in_flight, states[others[0]].in_flight, states[others[1]].in_flight = 22, 10, 10
    assert rank("prefix-affinity", fleet, key, states=states)[-1] is home  # share 43/3: bound 22
    states[home].in_flight, states[others[0]].in_flight, states[others[1]].in_flight = 20, 10, 10
    assert rank("prefix-affinity", fleet, key, states=states)[0] is home  # 21 fits 41/3 × 1.5


def test_a_looser_load_bound_keeps_more_on_home():
    states = BackendStates()
    fleet = backends()
    key = routing.prefix_key(conversation("sys", "q"))
    home = rank("prefix-affinity", fleet, key, states=states)[0]
    others = [b for b in fleet if b is not home]
    states[home].in_flight, states[others[0]].in_flight, states[others[1]].in_flight = 13, 9, 8
    # share (30 + 1) / 3 = 10.3: bound 13 at 1.25 (14 does not fit), 16 at 1.5
    assert rank("prefix-affinity", fleet, key, states=states, load_bound=1.25)[0] is not home
    assert rank("prefix-affinity", fleet, key, states=states, load_bound=1.5)[0] is home


# -- slots ---------------------------------------------------------------------------------

def test_slots_cap_a_backend_across_processes(tmp_path):
    slots = Slots(tmp_path, URLS[0], 2)
    first, second = slots.try_take(), slots.try_take()
    assert {first, second} == {0, 1} and slots.try_take() is None
    slots.release(first)
    assert slots.try_take() == first
    other = Slots(tmp_path, URLS[1], 1)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from gateway.backends.capacity import HostLoad, Slots
        slots = Slots({str(tmp_path)!r}, {URLS[1]!r}, 1)
        print(slots.try_take(), flush=True)
        sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "0"
        assert other.try_take() is None  # the other worker holds the only slot
    finally:
        holder.kill()
        holder.communicate()
    assert other.try_take() == 0  # the kernel released a dead worker's lock
    assert Slots(tmp_path, URLS[2], 0).try_take() == -1  # no cap


def test_host_load_sums_every_worker_and_forgets_a_dead_one(tmp_path):
    here = HostLoad(tmp_path)
    here.add(URLS[0], 2)
    worker = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from gateway.backends.capacity import HostLoad
        load = HostLoad({str(tmp_path)!r})
        load.add({URLS[0]!r}, 3)
        print(load.cell, load.total({URLS[0]!r}), flush=True)
        sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        cell, seen = worker.stdout.readline().split()
        assert int(cell) != here.cell and int(seen) == 5
        assert here.total(URLS[0]) == 5 and here.total(URLS[1]) == 0
    finally:
        worker.kill()
        worker.communicate()
    assert here.total(URLS[0]) == 5  # the dead worker's count stays until its cell is taken
    successor = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from gateway.backends.capacity import HostLoad
        load = HostLoad({str(tmp_path)!r})
        print(load.cell, load.total({URLS[0]!r}))
        """)], capture_output=True, text=True, check=True)
    assert successor.stdout.split() == [cell, "2"]  # took the free cell and zeroed it


def test_take_waits_for_a_slot_then_503_with_retry_after(tmp_path):
    fleet = backends(caps=(1, 1, 1))[:1]
    svc = services(tmp_path)
    holder = Route(svc, entry(fleet), [])
    holder.take(0)
    with pytest.raises(ServiceUnavailable) as err:
        Route(svc, entry(fleet), []).take(0.1)
    assert err.value.code == "backends_at_capacity" and err.value.headers["Retry-After"]
    holder.release()
    holder.release()  # twice is harmless
    assert Route(svc, entry(fleet), []).take(0).url == URLS[0]


# -- catalog -------------------------------------------------------------------------------

FLEET_CATALOG = """
[[models]]
id = "m"
context_window = 4096
max_output_tokens = 512
routing = "{routing}"
load_bound = {load_bound}
timeouts = {timeouts}
pricing = {{ input = "1", cached_input = "0.5", output = "2" }}
backends = [{{ url = "http://a:1/v1", model = "x", max_in_flight = {cap} }},
            {{ url = "http://b:1/v1", model = "x", weight = 0 }}]
"""


def write_catalog(tmp_path, routing="prefix-affinity", timeouts="{ first_byte_s = 600 }",
                  cap="1", load_bound="1.5"):
    path = tmp_path / "models.toml"
    path.write_text(FLEET_CATALOG.format(routing=routing, timeouts=timeouts, cap=cap,
                                         load_bound=load_bound))
    return path


def test_catalog_reads_routing_timeouts_and_caps(tmp_path):
    model = load_catalog(write_catalog(tmp_path))["m"]
    assert model.routing == "prefix-affinity" and model.backends[0].max_in_flight == 1
    assert model.load_bound == 1.5 == routing.LOAD_BOUND
    timeouts = model.timeouts_for(Config.from_mapping({"upstream_connect_timeout_s": 3,
                                                       "upstream_read_timeout_s": 100}))
    assert (timeouts.connect_s, timeouts.first_byte_s, timeouts.idle_s) == (3, 600, 100)


@pytest.mark.parametrize("fields", [
    {"routing": "fastest"}, {"timeouts": "{ first_byte_s = 0 }"},
    {"timeouts": "{ header_s = 5 }"}, {"timeouts": '{ idle_s = "x" }'}, {"cap": "-1"},
    {"cap": "1.5"}, {"load_bound": "0.9"}, {"load_bound": '"x"'},
])
def test_catalog_refuses_bad_fleet_fields(tmp_path, fields):
    with pytest.raises(CatalogError):
        load_catalog(write_catalog(tmp_path, **fields))


def test_kiln_catalog_check(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(cli.main, ["catalog", "check", str(write_catalog(tmp_path))])
    assert ok.exit_code == 0 and "m: 1 in rotation, 1 drained" in ok.output
    bad = runner.invoke(cli.main, ["catalog", "check",
                                   str(write_catalog(tmp_path, routing="fastest"))])
    assert bad.exit_code == 1 and "routing 'fastest' is not one of" in bad.output
    missing = runner.invoke(cli.main, ["catalog", "check", str(tmp_path / "nope.toml")])
    assert missing.exit_code == 1 and "nope.toml" in missing.output
    named = runner.invoke(cli.main, ["catalog", "check"],  # no PATH: KILN_MODELS's
                          env={"KILN_MODELS": str(write_catalog(tmp_path, routing="fastest"))})
    assert named.exit_code == 1 and "routing 'fastest' is not one of" in named.output


def test_a_server_named_by_two_models_has_one_cap(tmp_path):
    from gateway.backends.fleet import prepare
    shared = [Backend(url=URLS[0], model="a", max_in_flight=2),
              Backend(url=URLS[0], model="b", max_in_flight=1), Backend(url=URLS[1], model="c")]
    catalog = {"a": entry(shared[:1]), "b": entry(shared[1:2]), "c": entry(shared[2:])}
    states = prepare(catalog, Config.from_mapping({"slot_dir": str(tmp_path)}))
    assert states[shared[0]].slots is states[shared[1]].slots
    assert states[shared[0]].slots.limit == 1 and states[shared[2]].slots.limit == 0
    states[shared[0]].begin()
    assert states[shared[1]].load() == 1  # one count per server, read through the host's cells
