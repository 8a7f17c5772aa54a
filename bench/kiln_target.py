"""Kiln as a benchmark target, through its public interface only.

What this module relies on is what an operator relies on (README "Administration" and
"Configuration"): the ``kiln`` command (``db upgrade``, ``org create NAME --limit N``,
``credits grant``, ``key create``), gunicorn with ``deploy/gunicorn.conf.py`` serving
``gateway.wsgi:app`` as deploy/kiln-gateway.service does, ``KILN_*`` environment variables, and
the HTTP API. ``KILN_METERING=false`` turns metering off (no lease,
no hold, no usage event), the switch the benchmarks compare against.

The database holds one org for the one-org scenarios and ``org_count`` more, each with a key
of its own, for the scenario that spreads the load over many orgs. Making them takes a few
hundred ``kiln`` commands, minutes on two busy cores, so a freshly provisioned database is kept
as a Postgres template with its keys beside it; the next run clones it, runs ``kiln db
upgrade`` on the clone and checks every key over HTTP (``GET /v1/credits``), and provisions
anew when the migrations changed or anything does not answer as it should.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import targets as tg

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent

DB_NAME = "kiln_bench"
TEMPLATE_DB = "kiln_bench_template"  # the last freshly provisioned database, cloned by later runs
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
endpoints = ["chat", "completions", "embeddings"]
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


def psql(sql: str, database: str = "postgres") -> str:
    """Run one SQL statement as the Postgres superuser; return its unaligned output."""
    out = subprocess.run(
        ["psql", f"{PG_SERVER}/{database}", "-X", "-q", "-A", "-t", "-c", sql],
        check=True,
        capture_output=True,
        text=True,
        env=dict(os.environ, PGOPTIONS="--client-min-messages=warning"),
    )
    return out.stdout.strip()


def migrations_fingerprint() -> str:
    """Hash the schema's history (``migrations/``): a cached database is stale when it changes."""
    digest = hashlib.sha256()
    for path in sorted((REPO_DIR / "migrations").rglob("*.py")):
        digest.update(str(path.relative_to(REPO_DIR)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln") / "bench"


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

    def provision(self, fresh: bool = False) -> str:
        """Make the database: a clone of the last one when it still serves, else anew.

        Returns how, for the log: ``"cloned"`` or ``"provisioned"``.
        """
        if not fresh and self.restore():
            return "cloned"
        psql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        psql(f"CREATE DATABASE {DB_NAME}")
        self.cli("db", "upgrade")
        self.key = self.make_org("bench")
        names = [f"bench-org-{i:02d}" for i in range(1, self.org_count + 1)]
        with ThreadPoolExecutor(PROVISION_JOBS) as pool:
            self.org_keys = list(pool.map(self.make_org, names))
        self.save()
        return "provisioned"

    @property
    def keys_file(self) -> Path:
        return cache_dir() / f"{TEMPLATE_DB}.json"

    def save(self):
        """Keep the fresh database as the template of later runs, with its keys."""
        psql(f"DROP DATABASE IF EXISTS {TEMPLATE_DB} WITH (FORCE)")
        psql(f"CREATE DATABASE {TEMPLATE_DB} TEMPLATE {DB_NAME}")
        self.keys_file.parent.mkdir(parents=True, exist_ok=True)
        saved = {"migrations": migrations_fingerprint(), "key": self.key, "org_keys": self.org_keys}
        self.keys_file.write_text(json.dumps(saved))

    def restore(self) -> bool:
        """Clone the template if it is for these migrations and every key still answers."""
        try:
            saved = json.loads(self.keys_file.read_text())
        except (OSError, ValueError):
            return False
        exists = psql(f"SELECT 1 FROM pg_database WHERE datname = '{TEMPLATE_DB}'") == "1"
        if (
            not exists
            or saved.get("migrations") != migrations_fingerprint()
            or len(saved.get("org_keys", ())) < self.org_count
        ):
            return False
        psql(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        psql(f"CREATE DATABASE {DB_NAME} TEMPLATE {TEMPLATE_DB}")
        self.key, self.org_keys = saved["key"], saved["org_keys"][: self.org_count]
        try:
            self.cli("db", "upgrade")
            return self.keys_answer()
        except RuntimeError:
            return False

    def keys_answer(self) -> bool:
        """Start Kiln and ask for every key's credits: all must answer 200."""
        target = self.start(metering=False)
        try:
            return all(
                tg.http_status(f"{target.base_url}/credits", {"Authorization": f"Bearer {k}"})
                == 200
                for k in [self.key, *self.org_keys]
            )
        finally:
            target.stop()

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
