"""Which orgs' requests may go to their backend while the ledger admits them (docs/METERING.md,
"Early send"): those this worker admitted last, less than ``WINDOW_S`` ago, with no refusal
since. An org refused (402, 429, 503) is sent nothing before its next admission, so a key that
pays nothing never makes a backend work, and one that stops paying does so at most once.
"""
import time

WINDOW_S = 60.0
MAX_ORGS = 10_000  # the orgs remembered per worker; the longest unseen is forgotten first


class RecentAdmissions:
    """The orgs this worker admitted last, and when (``clock()`` seconds)."""

    def __init__(self, window_s=WINDOW_S, max_orgs=MAX_ORGS, clock=time.monotonic):
        self._window_s, self._max_orgs, self._clock = window_s, max_orgs, clock
        self._orgs = {}  # org id -> when last admitted, oldest first

    def admitted(self, org_id):
        """``org_id``'s request was admitted now."""
        self._orgs.pop(org_id, None)
        self._orgs[org_id] = self._clock()
        if len(self._orgs) > self._max_orgs:
            del self._orgs[next(iter(self._orgs))]

    def refused(self, org_id):
        """``org_id``'s request was refused (or its admission failed)."""
        self._orgs.pop(org_id, None)

    def likely(self, org_id):
        """Whether ``org_id``'s last admission here was granted less than the window ago."""
        at = self._orgs.get(org_id)
        return at is not None and self._clock() - at < self._window_s
