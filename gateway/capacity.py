"""A backend's concurrency cap (catalog ``max_in_flight``), exact across this host's workers.

Slot ``i`` of a backend is a POSIX record lock on byte ``i`` of a file named after the
backend's URL (``fcntl(2)``, F_SETLK): taken without blocking, held while the generation runs,
and released by the kernel if the worker dies, so a killed worker never leaks a slot. Record
locks belong to the process, so each worker also remembers which bytes it holds itself.
The cap is per gateway host: N hosts in front of one backend share it as cap × N (size it so,
docs/ROUTING.md).
"""
import errno
import fcntl
import hashlib
import os
import tempfile
from pathlib import Path


def slot_dir(configured):
    """Return the directory for slot files: ``KILN_SLOT_DIR``, else one under the temp dir."""
    path = Path(configured) if configured else Path(tempfile.gettempdir()) / "kiln-slots"
    path.mkdir(parents=True, exist_ok=True)
    return path


class Slots:
    """The ``limit`` slots of one backend on this host (``limit`` 0: no cap)."""

    def __init__(self, directory, url, limit):
        self.limit = limit
        self.path = Path(directory) / (hashlib.sha256(url.encode()).hexdigest()[:24] + ".slots")
        self._fd = None
        self._held = set()

    def try_take(self):
        """Take a free slot without waiting; return its number (-1 when uncapped), or None
        when all ``limit`` are taken, here or in another worker."""
        if not self.limit:
            return -1
        for i in range(self.limit):
            if i not in self._held and self._lock(i, fcntl.LOCK_EX | fcntl.LOCK_NB):
                self._held.add(i)
                return i
        return None

    def release(self, slot):
        """Give slot ``slot`` back (a number :meth:`try_take` returned)."""
        if slot is not None and slot >= 0 and slot in self._held:
            self._lock(slot, fcntl.LOCK_UN)
            self._held.discard(slot)

    def _lock(self, i, how):
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.lockf(self._fd, how, 1, i, os.SEEK_SET)
        except OSError as err:
            if err.errno in (errno.EACCES, errno.EAGAIN):
                return False
            raise
        return True
