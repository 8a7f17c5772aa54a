"""The parse budget is shared fairly between orgs (gateway/api/intake.py ``ParseBudget``): one
org's large bodies take at most its share of the bytes, one child at a time, and its pause
after a parse is its own."""
import gevent
import pytest
from gevent.event import Event

from gateway.api.intake import ParseBudget
from gateway.errors import ServiceUnavailable

pytestmark = pytest.mark.unit


def test_one_org_holds_at_most_half_and_another_finds_room():
    budget = ParseBudget(100, wait_s=0.05)
    held = budget.acquire("flood", 60)  # holding nothing, it may take one body of any size
    with pytest.raises(ServiceUnavailable) as busy:
        budget.acquire("flood", 30)  # 90 > its share, 50
    assert busy.value.code == "server_busy" and busy.value.headers["Retry-After"] == "1"
    assert budget.acquire("victim", 30) == 30
    assert budget.share() == 50
    budget.release("flood", held)
    assert budget.held == {"victim": 30} and budget.free == 70


def test_the_share_shrinks_as_more_orgs_want_some():
    budget = ParseBudget(90, wait_s=0.05)
    for org in ("a", "b", "c"):
        budget.acquire(org, 20)
    assert budget.share() == 30
    with pytest.raises(ServiceUnavailable):
        budget.acquire("a", 20)  # 40 > 30
    assert budget.acquire("a", 10) == 10


def test_a_pause_after_a_costly_parse_is_its_own_orgs():
    budget = ParseBudget(100, wait_s=0.05, parsers=2)
    assert budget.run("flood", lambda parser: "parsed", cost_s=lambda parser: 10.0) == "parsed"
    with pytest.raises(ServiceUnavailable):  # 30 s of pause: a quarter of a core
        budget.run("flood", lambda parser: "again")
    assert budget.run("victim", lambda parser: "served") == "served"


def test_while_one_org_parses_another_takes_the_other_child():
    budget = ParseBudget(100, wait_s=0.05, parsers=2)
    release, used = Event(), []

    def slow(parser):
        used.append(parser)
        release.wait()
    flood = gevent.spawn(budget.run, "flood", slow)
    gevent.sleep(0)
    with pytest.raises(ServiceUnavailable):  # one parse at a time per org
        budget.run("flood", lambda parser: None)
    assert budget.run("victim", lambda parser: used.append(parser) or parser) != used[0]
    release.set()
    flood.get(timeout=5)
    assert sorted(used) == [0, 1]
