"""Which orgs may be sent to their backend while they are admitted (gateway/ledger/early.py;
docs/METERING.md, "Early send"): only one this worker admitted last, within the window."""
import pytest

from gateway.ledger.early import RecentAdmissions

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_only_an_org_admitted_last_within_the_window_is_likely():
    clock = Clock()
    recent = RecentAdmissions(window_s=60, clock=clock)
    assert not recent.likely(1)  # never admitted here: a new org, a $0 key
    recent.admitted(1)
    assert recent.likely(1) and not recent.likely(2)
    clock.now += 59.9
    assert recent.likely(1)
    clock.now += 0.2
    assert not recent.likely(1)  # a minute since: admitted first again
    recent.admitted(1)
    recent.refused(1)
    assert not recent.likely(1)  # refused since: nothing sent before its next admission
    recent.refused(3)  # an org never seen
    assert not recent.likely(3)


def test_the_org_unseen_longest_is_forgotten_first():
    recent = RecentAdmissions(max_orgs=3, clock=Clock())
    for org in (1, 2, 3):
        recent.admitted(org)
    recent.admitted(1)  # seen again: now the newest
    recent.admitted(4)
    assert [recent.likely(org) for org in (1, 2, 3, 4)] == [True, False, True, True]
