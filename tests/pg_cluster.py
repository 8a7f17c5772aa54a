"""A private Postgres cluster for tests that stop, crash or restart the database: never the
shared server at 127.0.0.1:5432. ``initdb`` into a temporary directory, ``pg_ctl`` on a free
loopback port, run as the ``postgres`` OS user (the server refuses to run as root)."""
import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from gateway_proc import free_port


def bindir():
    """Return the newest installed Postgres server's bin directory."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
                   key=lambda p: int(Path(p).parent.parent.name))
    if not found:
        raise RuntimeError("no Postgres server binaries (Debian package postgresql)")
    return Path(found[-1]).parent


class Cluster:
    """A throwaway cluster: :meth:`start`, :meth:`stop`, :meth:`crash` (immediate stop)."""

    def __init__(self):
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="kiln-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust",
                  "--no-sync", "-E", "UTF8")

    def _run(self, tool, *args, check=True):
        command = [str(bindir() / tool), *args]
        if os.geteuid() == 0:
            command = ["runuser", "-u", "postgres", "--", *command]
        return subprocess.run(command, check=check, capture_output=True, text=True, timeout=120)

    def start(self):
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.dir} "
                   f"-c max_connections=200")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w",
                  "start")
        return self

    def stop(self, mode="fast"):
        """Stop the server; ``mode="immediate"`` is a crash (no checkpoint, recovery at start)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def crash_and_restart(self):
        self.stop("immediate")
        self.start()

    def destroy(self):
        self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)
