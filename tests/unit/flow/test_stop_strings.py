"""Stop strings (gateway/flow/rules.py): the automaton gives the results the direct search gives
(the earliest stop string, the earlier listed at a tie; text that could begin one held back until
the next delta decides), and the work of a stream is linear in its length plus the longest stop
string, counted in steps, however the deltas come and however many near misses they make."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.flow.rules import StopCutter, StopStrings, cut_at_stop, first_stop

pytestmark = pytest.mark.unit


# -- the direct search: what the results must be ---------------------------------------------

def direct_first_stop(text, stops):
    found = [(p, s) for p, s in ((text.find(s), s) for s in stops) if p >= 0]
    return min(found, key=lambda hit: hit[0]) if found else (-1, None)


class DirectCutter:
    """Each delta searched again with the text held before it, every stop string tried."""

    def __init__(self, stops):
        self.stops, self.pending, self.finished = stops, {}, set()

    def feed(self, index, text):
        text = self.pending.pop(index, "") + text
        cut, _ = direct_first_stop(text, self.stops)
        if cut >= 0:
            self.finished.add(index)
            return text[:cut], True
        keep = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), keep, -1):
                if text.endswith(stop[:k]):
                    keep = k
                    break
        if keep:
            self.pending[index] = text[-keep:]
            text = text[:-keep]
        return text, False

    def flush(self, index):
        return self.pending.pop(index, "")


SMALL = st.text("abc", min_size=1, max_size=6)
STOPS = st.lists(SMALL, min_size=1, max_size=4)
DELTAS = st.lists(st.tuples(st.integers(0, 1), st.text("abcd", max_size=8)), max_size=30)


@settings(max_examples=500, deadline=None)
@given(text=st.text("abcd", max_size=60), stops=STOPS)
def test_first_stop_is_the_direct_searchs(text, stops):
    assert first_stop(text, stops) == direct_first_stop(text, stops)
    cut, stop = direct_first_stop(text, stops)
    assert cut_at_stop(text, stops) == ((text[:cut], stop) if stop else (text, None))


@settings(max_examples=500, deadline=None)
@given(deltas=DELTAS, stops=STOPS)
def test_a_stream_is_cut_as_the_direct_search_cuts_it(deltas, stops):
    ours, direct = StopCutter(stops), DirectCutter(stops)
    for index, delta in deltas:
        if index in direct.finished:
            continue
        assert ours.feed(index, delta) == direct.feed(index, delta)
    for index in (0, 1):
        assert ours.flush(index) == direct.flush(index)
    assert ours.finished == direct.finished


def test_the_earliest_stop_wins_and_the_earlier_listed_at_a_tie():
    assert first_stop("xabcd", ["bc", "abcd"]) == (1, "abcd")
    assert first_stop("abc", ["ab", "abc"]) == (0, "ab")
    assert first_stop("abc", ["abc", "ab"]) == (0, "abc")
    assert first_stop("a]^-\\b", ["]^-\\"]) == (1, "]^-\\")  # the skip's characters escaped
    cutter = StopCutter(["abcd", "bc"])
    assert cutter.feed(0, "xa") == ("x", False)  # "a" may begin "abcd"
    assert cutter.feed(0, "bc") == ("a", True)   # "bc" is whole; "abcd" is not yet
    assert cutter.matched == {0: "bc"}


def near_miss_stream(stop, deltas):
    """Deltas that keep almost matching ``stop`` (all of it but its last character) and then
    miss, each cut into pieces of one to seven characters."""
    miss = stop[:-1] + "x"
    text = miss * (deltas // len(miss) + 1)
    pieces, at = [], 0
    while len(pieces) < deltas:
        size = 1 + len(pieces) % 7
        pieces.append(text[at:at + size])
        at += size
    return pieces


@pytest.mark.parametrize("longest", [10, 100, 1000])
def test_a_streams_work_is_linear_in_its_length(longest):
    """The direct search reads the held text again at every delta and tries each prefix of
    each stop string: about deltas × longest² steps here. The automaton's steps stay within
    twice the characters read, plus one longest stop string."""
    stop = "a" * (longest - 1) + "b"
    stops = [stop, "a" * (longest // 2) + "c", "ab" * (longest // 4) + "d"]
    cutter = StopCutter(stops)
    pieces = near_miss_stream(stop, 5000)
    out = [cutter.feed(0, piece) for piece in pieces]
    assert not any(hit for _, hit in out)
    assert "".join(text for text, _ in out) + cutter.flush(0) == "".join(pieces)
    read = sum(map(len, pieces))
    assert cutter.automaton.examined <= 2 * read + longest


def test_a_long_answers_search_examines_each_character_at_most_twice():
    stops = ["a" * 63 + "b", "a" * 62 + "c"]
    text = ("a" * 63 + "x") * 2000
    automaton = StopStrings(stops)
    assert automaton.search(text) == (0, None)
    assert automaton.examined <= 2 * len(text)
    skipped = StopStrings(["<|end|>"])
    skipped.search("plain words " * 1000)
    assert skipped.examined == len("plain words " * 1000)  # skipped, counted once each
