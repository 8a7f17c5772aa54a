"""Kiln as a benchmark target, through its public interface only.

What this module relies on is what an operator relies on (README "Administration" and
"Configuration"): the ``kiln`` command (``db upgrade``, ``org create NAME --limit N``,
``credits grant``, ``key create``), gunicorn with ``deploy/gunicorn.conf.py``, ``KILN_*``
environment variables, and the HTTP API. ``KILN_METERING=false`` turns metering off (no lease,
no hold, no usage event), the switch the benchmarks compare against.

The database is made once per run: one org for the one-org scenarios and ``org_count`` more,
each with a key of its own, for the scenario that spreads the load over many orgs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import targets as tg

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent

DB_NAME = "kiln_bench"
PG_SERVER = "postgresql://postgres@127.0.0.1:5432"
DATABASE_URL = f"postgresql+psycopg://postgres@127.0.0.1:5432/{DB_NAME}"
WORKERS = 2  # same as LiteLLM's --num_workers and the floor's workers
ORG_LIMIT = 1_000_000  # in-flight limit: high enough never to refuse a benchmark request
ORG_CREDIT_USD = "1000000"
PROVISION_JOBS = 4  # kiln commands run at once while making the many orgs

CATALOG_TEMPLATE = """\
[[models]]
id = "bench-model"
context_window = 32768
max_output_tokens = 8192
input = ["text"]
pricing = {{ input = "0.10", cached_input = "0.05", output = "0.30" }}
backends = [{{ url = "{upstream_url}", model = "bench-model" }}]
"""


def kiln_version() -> str:
    """The checkout being measured, as ``git describe`` names it."""
    out = subprocess.run(
        ["git", "-C", str(REPO_DIR), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or "unknown"


def psql(sql: str, database: str = "postgres") -> None:
    """Run one SQL statement as the Postgres superuser."""
    subprocess.run(
        ["psql", f"{PG_SERVER}/{database}", "-X", "-q", "-c", sql],
        check=True,
        env=dict(os.environ, PGOPTIONS="--client-min-messages=warning"),
    )


class KilnBench:
    """Provisions the benchmark database once and starts Kiln on it as often as asked."""

    def __init__(self, upstream_url: str, workdir: Path, org_count: int):
        self.workdir = workdir
        self.org_count = org_count
        catalog = workdir / "models.toml"
        catalog.write_text(CATALOG_TEMPLATE.format(upstream_url=upstream_url))
        self.env = dict(
            os.environ,
            KILN_DATABASE_URL=DATABASE_URL,
            KILN_MODELS=str(catalog),
            KILN_WORKERS=str(WORKERS),
        )
        self.key = ""  # the one org's key
        self.org_keys = []  # one key per org of the many-orgs scenario
        self.version = kiln_version()

    def cli(self, *args: str) -> str:
        """Run ``kiln ARGS``; return its stdout."""
        kiln = Path(sys.executable).parent / "kiln"
        out = subprocess.run(
            [str(kiln), *args],
            env=self.env,
            cwd=REPO_DIR,
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode:
            raise RuntimeError(f"kiln {' '.join(args)} failed: {out.stderr[-800:]}")
        return out.stdout

    def make_org(self, name: str) -> str:
        """Create org ``name`` with ample credit and no practical in-flight cap; return a key."""
        self.cli("org", "create", name, "--limit", str(ORG_LIMIT))
        self.cli("credits", "grant", name, ORG_CREDIT_USD)
        return self.cli("key", "create", name).strip().splitlines()[-1]

    def provision(self) -> float:
        """Make a fresh database with its orgs and keys; return the seconds it took."""
        t0 = time.monotonic()
        psql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        psql(f"CREATE DATABASE {DB_NAME}")
        self.cli("db", "upgrade")
        self.key = self.make_org("bench")
        names = [f"bench-org-{i:02d}" for i in range(1, self.org_count + 1)]
        with ThreadPoolExecutor(PROVISION_JOBS) as pool:
            self.org_keys = list(pool.map(self.make_org, names))
        return time.monotonic() - t0

    def start(self, metering: bool) -> tg.Target:
        """Start Kiln under gunicorn (``deploy/gunicorn.conf.py``) on the provisioned database."""
        name = "kiln" if metering else "kiln-nometer"
        env = dict(self.env, KILN_METERING="true" if metering else "false")
        port = tg.free_port()
        argv = [
            str(Path(sys.executable).parent / "gunicorn"),
            "-c", "deploy/gunicorn.conf.py",
            "--bind", f"127.0.0.1:{port}",
            "--workers", str(WORKERS),
            "gateway.wsgi:app",
        ]  # fmt: skip
        svc = tg.Service(name, argv, self.workdir, env=env, cwd=REPO_DIR)
        try:
            startup = tg.wait_http(
                f"http://127.0.0.1:{port}/v1/models",
                svc,
                120,
                headers={"Authorization": f"Bearer {self.key}"},
            )
        except RuntimeError:
            svc.stop()
            raise
        return tg.Target(
            name,
            f"http://127.0.0.1:{port}/v1",
            self.key,
            [svc.pid],
            svc.stop,
            startup_s=startup,
            version=self.version,
            db_name=DB_NAME,
            org_keys=self.org_keys,
        )
