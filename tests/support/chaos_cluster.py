"""The system under test of a chaos run: a private Postgres cluster, two gateway "hosts" and
the ``kiln`` command, driven only through Kiln's external interfaces.

The run restarts Postgres with an immediate shutdown, so it never uses a shared server: it
creates its own cluster (``initdb`` into a temporary directory, started on a free loopback
port). Postgres refuses to run as root; as root the cluster belongs to the ``postgres`` OS user.
"""
import glob
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg
from psycopg.rows import dict_row

from gateway_proc import Gateway, free_port

PG_USER = "postgres"
DB_NAME = "kiln_chaos"


def pg_bindir():
    """Return the directory of the Postgres server binaries (``initdb``, ``pg_ctl``)."""
    candidates = []
    try:
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True,
                             check=True)
        candidates.append(out.stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for path in candidates:
        if os.path.exists(os.path.join(path, "initdb")) and \
                os.path.exists(os.path.join(path, "pg_ctl")):
            return path
    raise RuntimeError("no Postgres server binaries (initdb, pg_ctl) found; install Postgres")


class PrivatePostgres:
    """A throwaway Postgres cluster on 127.0.0.1:``port``, owned by this run alone."""

    def __init__(self, workdir):
        self.bindir = pg_bindir()
        self.port = free_port()
        self.workdir = Path(workdir)
        # Its own directory, not under workdir: the server's OS user must be able to reach it.
        self.root = Path(tempfile.mkdtemp(prefix="kiln-chaos-pg-"))
        self.data = self.root / "data"
        self.log_path = self.root / "postgres.log"
        self.as_user = []
        if os.geteuid() == 0:  # initdb and postgres refuse to run as root
            self.as_user = ["runuser", "-u", PG_USER, "--"]
            pw = pwd.getpwnam(PG_USER)
            os.chown(self.root, pw.pw_uid, pw.pw_gid)

    @property
    def dsn(self):
        return f"host=127.0.0.1 port={self.port} user={PG_USER} dbname={DB_NAME} connect_timeout=3"

    @property
    def url(self):
        return f"postgresql+psycopg://{PG_USER}@127.0.0.1:{self.port}/{DB_NAME}"

    def _run(self, *args, timeout_s=120):
        done = subprocess.run([*self.as_user, os.path.join(self.bindir, args[0]), *args[1:]],
                              capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: "
                               f"{(done.stderr or done.stdout).strip()[-2000:]}")
        return done

    def start(self):
        """Create the cluster and the database, and start the server."""
        self._run("initdb", "-D", str(self.data), "-U", PG_USER, "--auth=trust", "-E", "UTF8",
                  "--no-sync")
        # fsync off: the run kills the server process, never the machine; what a committed
        # transaction wrote is in the OS page cache and survives, as crash recovery needs.
        settings = {"listen_addresses": "'127.0.0.1'", "port": self.port,
                    "unix_socket_directories": f"'{self.root}'", "max_connections": 300,
                    "fsync": "off", "full_page_writes": "off", "shared_buffers": "'64MB'",
                    "log_min_messages": "warning"}
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.writelines(f"{k} = {v}\n" for k, v in settings.items())
        self._pg_ctl("start")
        with psycopg.connect(self.dsn.replace(DB_NAME, "postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{DB_NAME}"')
        return self

    def _pg_ctl(self, *args):
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log_path), "-w", "-t", "60",
                  *args)

    def restart_immediate(self):
        """Stop the server without a shutdown checkpoint (as a crash would), then start it."""
        self._pg_ctl("restart", "-m", "immediate")

    def stop(self):
        """Stop the server, keep its log in the run's workdir, and remove the cluster."""
        if (self.data / "postmaster.pid").exists():
            try:
                self._pg_ctl("stop", "-m", "fast")
            except RuntimeError:
                self._pg_ctl("stop", "-m", "immediate")
        if self.log_path.exists():
            shutil.copy(self.log_path, self.workdir / "postgres.log")
        shutil.rmtree(self.root, ignore_errors=True)

    def log(self):
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def catalog_toml(meter_url, urls):
    """Return the catalog of a run: three models on the fake backends (README "Configuration")."""
    tokenize = meter_url.rsplit("/v1", 1)[0] + "/extras/tokenize/count"
    return f"""
[[models]]
id = "chaos-a"
context_window = 4096
max_output_tokens = 512
input = ["text"]
pricing = {{ input = "20", cached_input = "10", output = "60" }}
backends = [{{ url = "{urls[0]}", model = "upstream-a" }}]

[[models]]
id = "chaos-b"
context_window = 8192
max_output_tokens = 1024
input = ["text"]
pricing = {{ input = "3", cached_input = "1.5", output = "15" }}
backends = [{{ url = "{urls[1]}", model = "upstream-b", weight = 2 }},
            {{ url = "{urls[2]}", model = "upstream-b", weight = 1 }}]

[[models]]
id = "chaos-meter"
context_window = 4096
max_output_tokens = 256
input = ["text"]
pricing = {{ input = "0.7", cached_input = "0.35", output = "2.1" }}
backends = [{{ url = "{meter_url}", model = "upstream-meter", tokenize_url = "{tokenize}" }}]
"""


# Short lease TTL and sweep interval so that a run quiesces quickly; a short read timeout so
# that a hanging backend ends its request within the run (README "Configuration").
GATEWAY_SETTINGS = {
    "KILN_LEASE_TTL_S": "6", "KILN_SWEEP_INTERVAL_S": "2", "KILN_KEY_CACHE_TTL_S": "1",
    "KILN_MAINTENANCE_POLL_S": "0.5", "KILN_KEEPALIVE_S": "2",
    "KILN_UPSTREAM_READ_TIMEOUT_S": "4", "KILN_UPSTREAM_CONNECT_TIMEOUT_S": "2",
    "KILN_GRACEFUL_TIMEOUT": "15", "KILN_DB_POOL_SIZE": "5", "KILN_DB_MAX_OVERFLOW": "10",
}


class Database:
    """Plain SQL on the documented tables, surviving the run's Postgres restarts."""

    def __init__(self, dsn):
        self.dsn = dsn
        self._conn = None
        self._lock = threading.Lock()

    def query(self, sql, params=None):
        """Run one statement in autocommit; return its rows as dicts (raises psycopg.Error)."""
        with self._lock:
            try:
                if self._conn is None or self._conn.closed:
                    self._conn = psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row)
                cur = self._conn.execute(sql, params)
                return cur.fetchall() if cur.description else []
            except psycopg.OperationalError:
                if self._conn is not None:
                    self._conn.close()
                self._conn = None
                raise

    def query_retrying(self, sql, params=None, timeout_s=30):
        """As :meth:`query`, retried while the server is restarting."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.query(sql, params)
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def close(self):
        if self._conn is not None:
            self._conn.close()


class Kiln:
    """The ``kiln`` command on the run's database."""

    def __init__(self, env):
        self.env = {**os.environ, **env}
        self.exe = str(Path(sys.executable).with_name("kiln"))

    def __call__(self, *args, check=True, timeout_s=60):
        """Run ``kiln ARGS``; return the CompletedProcess (stdout, stderr as text)."""
        done = subprocess.run([self.exe, *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout_s)
        if check and done.returncode != 0:
            raise RuntimeError(f"kiln {' '.join(args)} exited {done.returncode}: "
                               f"{done.stderr.strip()}")
        return done


class Gateways:
    """Two gateway "hosts": gunicorn masters on their own ports, one database."""

    def __init__(self, env, workdir, count=2, workers=2):
        self.hosts = [Gateway({**GATEWAY_SETTINGS, **env}, workers=workers,
                              log_path=str(Path(workdir) / f"gateway-{i}.log"))
                      for i in range(count)]

    def start(self):
        for host in self.hosts:
            host.start(timeout_s=60)
        return self

    def stop(self):
        for host in self.hosts:
            host.stop(timeout_s=30)

    def port(self, index):
        return self.hosts[index].port

    def kill_worker(self, index, worker):
        """SIGKILL worker number ``worker`` (by pid order) of host ``index``; return its pid."""
        pids = sorted(self.hosts[index].worker_pids())
        if not pids:
            return None
        pid = pids[worker % len(pids)]
        os.kill(pid, signal.SIGKILL)
        return pid

    def reload(self, index):
        """HUP host ``index``: new workers start, old ones finish their requests."""
        self.hosts[index].signal(signal.SIGHUP)

    def alive(self):
        return all(h.proc.poll() is None for h in self.hosts)

    def logs(self):
        return [h.log() for h in self.hosts]

