"""A throwaway Postgres cluster for tests that stop, crash or restart the database: never the
shared server at 127.0.0.1:5432.

It is a real Debian cluster, managed as an operator manages one (postgresql-common, Debian
package ``postgresql``): ``pg_createcluster`` on a free port, trust authentication (local and
loopback TCP only), ``pg_ctlcluster`` to start, stop and crash it, ``pg_dropcluster --stop`` at
the end. The tools need root (or the ``postgres`` user); the tests and CI run as root.
"""
import glob
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

from gateway_proc import free_port


def version():
    """Return the newest installed Postgres server's major version (``"15"``)."""
    found = sorted((Path(p).parent.parent.name for p in
                    glob.glob("/usr/lib/postgresql/*/bin/postgres")), key=int)
    if not found or shutil.which("pg_createcluster") is None:
        raise RuntimeError("no Postgres server (Debian packages postgresql, postgresql-common)")
    return found[-1]


class Cluster:
    """A cluster of its own: :meth:`start`, :meth:`stop`, :meth:`crash`, :meth:`crash_and_restart`,
    :meth:`destroy`."""

    def __init__(self):
        self.version = version()
        self.name = f"kiln_test_{uuid.uuid4().hex[:10]}"
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kiln-pg-"))
        shutil.chown(self.dir, "postgres", "postgres")
        self.log = self.dir / "server.log"
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        subprocess.run(
            ["pg_createcluster", "--quiet", "--start-conf=manual", "-p", str(self.port),
             "-d", str(self.dir / "data"), "-l", str(self.log),
             "-o", "max_connections=200",
             self.version, self.name, "--", "--auth=trust", "--no-sync"],
            check=True, capture_output=True, text=True, timeout=120)

    def _ctl(self, action, *options):
        subprocess.run(["pg_ctlcluster", self.version, self.name, action, *options],
                       check=True, capture_output=True, text=True, timeout=120)

    def start(self):
        self._ctl("start")
        return self

    def stop(self):
        """Stop the server (fast shutdown: sessions are ended, no new connection is taken)."""
        self._ctl("stop", "-m", "fast")

    def crash(self):
        """Stop in immediate mode and leave it down: a crash (no checkpoint; :meth:`start`
        recovers by replaying the WAL)."""
        self._ctl("stop", "-m", "immediate")

    def crash_and_restart(self):
        """Restart in immediate mode: a crash (no checkpoint; recovery replays the WAL)."""
        self._ctl("restart", "-m", "immediate")

    def destroy(self):
        subprocess.run(["pg_dropcluster", "--stop", self.version, self.name],
                       capture_output=True, text=True, timeout=120)
        shutil.rmtree(self.dir, ignore_errors=True)
