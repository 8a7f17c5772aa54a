"""A backend's concurrency cap (catalog ``max_in_flight``), exact across this host's workers,
and the host's count of requests in flight per backend (:class:`HostLoad`).

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
import mmap
import os
import tempfile
from pathlib import Path


def slot_dir(configured):
    """Return the directory for slot and load files: ``KILN_SLOT_DIR`` (the systemd unit sets it
    under its ``RuntimeDirectory=``), else this user's own directory under the temp dir.

    The files decide a backend's cap and load for every worker of the host, so a directory
    another user could have made first (a predictable name in a shared ``/tmp``) is refused.

    :raises RuntimeError: the default directory exists but is not this user's alone.
    """
    if configured:
        path = Path(configured)
        path.mkdir(parents=True, exist_ok=True)
        return path
    path = Path(tempfile.gettempdir()) / f"kiln-slots-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    found = path.lstat()
    if path.is_symlink() or found.st_uid != os.getuid() or found.st_mode & 0o077:
        raise RuntimeError(f"{path} is not this user's private directory: set KILN_SLOT_DIR")
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
            if i not in self._held and self._lock(i, fcntl.LOCK_EX):
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
        if how == fcntl.LOCK_UN:
            fcntl.lockf(self._fd, how, 1, i, os.SEEK_SET)
            return True
        return _try_lock(self._fd, i)


class HostLoad:
    """Requests in flight to each backend from every worker of this host, for the routing
    policies: a memory-mapped file per backend with one 8-byte cell per worker, each written
    only by its owner and read by all.

    A worker owns cell ``i`` while it holds the record lock on byte ``i`` of ``workers.lock``;
    the kernel frees the lock if the worker dies, and the next worker to take ``i`` zeroes the
    cell before using it. Without a free cell a worker counts only its own requests.
    """

    CELLS = 64

    def __init__(self, directory):
        self.directory = Path(directory)
        self._lock_fd = os.open(self.directory / "workers.lock", os.O_RDWR | os.O_CREAT, 0o600)
        self.cell = next((i for i in range(self.CELLS) if _try_lock(self._lock_fd, i)), None)
        self._maps = {}

    def add(self, url, delta):
        """Add ``delta`` to this worker's count for ``url``."""
        cells = self._map(url)
        if cells is not None:
            offset = self.cell * 8
            value = int.from_bytes(cells[offset:offset + 8], "little", signed=True)
            cells[offset:offset + 8] = (value + delta).to_bytes(8, "little", signed=True)

    def total(self, url):
        """Return the host's requests in flight to ``url``, or None without a cell."""
        cells = self._map(url)
        if cells is None:
            return None
        return sum(int.from_bytes(cells[i:i + 8], "little", signed=True)
                   for i in range(0, self.CELLS * 8, 8))

    def _map(self, url):
        if self.cell is None:
            return None
        cells = self._maps.get(url)
        if cells is None:
            path = self.directory / (hashlib.sha256(url.encode()).hexdigest()[:24] + ".load")
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < self.CELLS * 8:
                    os.ftruncate(fd, self.CELLS * 8)
                cells = self._maps[url] = mmap.mmap(fd, self.CELLS * 8)
            finally:
                os.close(fd)
            cells[self.cell * 8:self.cell * 8 + 8] = bytes(8)  # a dead worker's count, if any
        return cells


def _try_lock(fd, i):
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, i, os.SEEK_SET)
    except OSError as err:
        if err.errno in (errno.EACCES, errno.EAGAIN):
            return False
        raise
    return True
