"""The stored responses' items a worker holds parsed, so that a continued conversation reads
its chain's ids, not its content, again (docs/RESPONSES.md, "Stored responses"). Reads of the
rows are in :mod:`gateway.ledger.responses`.
"""
from collections import OrderedDict


class HistoryCache:
    """The items of the stored responses one worker wrote or read lately, as a history carries
    them (a row's input items, then its response's output), by response id: a least recently
    used set bounded by the bytes of the rows' JSON.

    A stored response's content never changes once written (a deletion blanks the row and
    expires it at once, :func:`gateway.ledger.responses.delete`), so an entry stays right for
    as long as the row is live; whether each link still is, and the org's,
    :func:`gateway.ledger.responses.load_chain` reads from the database every time. The items
    are shared by every request that reads them: nothing may change them (the Responses codec
    builds its messages anew, ``gateway.dialects``).

    :param max_bytes: the rows' JSON bytes held at most; 0 holds nothing.
    """

    def __init__(self, max_bytes):
        self.max_bytes = max_bytes
        self.size = 0
        self._entries = OrderedDict()  # id -> (previous id, items (a tuple), bytes)

    def __len__(self):
        return len(self._entries)

    def chain(self, response_id):
        """Return ``{id: items}`` of the links held, from ``response_id`` back to the first
        one not held."""
        known, entries = {}, self._entries
        while response_id is not None and response_id not in known:
            entry = entries.get(response_id)
            if entry is None:
                break
            entries.move_to_end(response_id)
            known[response_id] = entry[1]
            response_id = entry[0]
        return known

    def put(self, response_id, previous_id, items, size):
        """Hold ``items`` (a sequence) of ``response_id``, whose row's JSON is ``size`` bytes;
        the least recently used go while more than :attr:`max_bytes` are held."""
        if size > self.max_bytes:
            return
        old = self._entries.pop(response_id, None)
        if old is not None:
            self.size -= old[2]
        self._entries[response_id] = (previous_id, tuple(items), size)
        self.size += size
        while self.size > self.max_bytes:
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self.size -= dropped


def history_items(input_items, response):
    """What a stored response adds to a history: its request's input items, then its output."""
    return [*input_items, *(response.get("output") or [])]
