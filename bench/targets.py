"""Start and stop the services the benchmark talks to.

Every service runs in its own process group on loopback, with its output in a
log file under the run's work directory.  A :class:`Target` is what the
scenarios need: a base URL (``http://127.0.0.1:PORT/v1``), an API key, the PIDs
whose memory counts as the target's, and a ``stop`` callable.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from httpio import chat_body, split_base_url

BENCH_DIR = Path(__file__).resolve().parent
LITELLM_MASTER_KEY = "sk-bench-litellm-master"


@dataclass
class Target:
    """One thing to measure."""

    name: str
    base_url: str
    api_key: str = ""
    pids: list = field(default_factory=list)
    stop: Callable[[], None] = lambda: None
    startup_s: float | None = None
    version: str = ""
    db_name: str = ""  # Postgres database whose connections to count
    org_keys: list = field(default_factory=list)  # one key per org, for the many-orgs scenario


class Service:
    """A child process in its own process group, logging to a file."""

    def __init__(self, name: str, argv, logdir: Path, env=None, cwd=None):
        self.name = name
        self.log_path = logdir / f"{name}.log"
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE if name == "upstream" else self.log,
            stderr=self.log,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 15.0):
        """SIGTERM the group, then SIGKILL it if it lingers."""
        if self.proc.poll() is None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=timeout)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.log.close()

    def tail(self, lines: int = 30) -> str:
        self.log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_status(url: str, headers=None, timeout: float = 2.0):
    """Status of ``GET url`` or ``None`` if unreachable."""
    host_port, _, path = url.removeprefix("http://").partition("/")
    host, _, port = host_port.partition(":")
    conn = http.client.HTTPConnection(host, int(port or 80), timeout=timeout)
    try:
        conn.request("GET", "/" + path, headers=headers or {})
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


def wait_http(url: str, service: Service, timeout: float, headers=None) -> float:
    """Poll ``url`` until it answers 200; return seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if service.proc.poll() is not None:
            raise RuntimeError(f"{service.name} exited early:\n{service.tail()}")
        if http_status(url, headers) == 200:
            return time.monotonic() - start
        time.sleep(0.1)
    raise RuntimeError(f"{service.name} not ready after {timeout}s:\n{service.tail()}")


# --------------------------------------------------------------------------
# Fake upstream
# --------------------------------------------------------------------------


def start_upstream(logdir: Path, workers: int = 1, gap_ms: float = 20, chunks: int = 64):
    """Start bench/fake_openai.py; return ``(Target, Service)``."""
    argv = [
        sys.executable,
        str(BENCH_DIR / "fake_openai.py"),
        "--port",
        "0",
        "--workers",
        str(workers),
        "--gap-ms",
        str(gap_ms),
        "--chunks",
        str(chunks),
    ]
    svc = Service("upstream", argv, logdir)
    line = svc.proc.stdout.readline().decode().strip()
    if not line.startswith("ready "):
        svc.stop()
        raise RuntimeError(f"fake upstream failed to start: {line!r}\n{svc.tail()}")
    svc.proc.stdout.close()
    url = line.split()[1]
    target = Target("direct", url, "", [svc.pid], svc.stop, version="fake_openai.py")
    return target, svc


# --------------------------------------------------------------------------
# LiteLLM
# --------------------------------------------------------------------------


def litellm_bin() -> Path:
    """Create or reuse the LiteLLM virtualenv; return its bin directory."""
    out = subprocess.run(
        ["bash", str(BENCH_DIR / "litellm_env.sh")],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def litellm_version(bindir: Path) -> str:
    out = subprocess.run(
        [
            str(bindir / "python"),
            "-c",
            "import importlib.metadata as m; print(m.version('litellm'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def write_litellm_config(upstream_url: str, workdir: Path) -> Path:
    """Fill the placeholders of bench/litellm_config.yaml."""
    text = (BENCH_DIR / "litellm_config.yaml").read_text()
    text = text.replace("${UPSTREAM_BASE}", upstream_url)
    text = text.replace("${MASTER_KEY}", LITELLM_MASTER_KEY)
    path = workdir / "litellm_config.yaml"
    path.write_text(text)
    return path


def start_litellm(
    upstream_url: str, workdir: Path, workers: int = 2, conn_limit: int = 0, timeout: float = 180
) -> Target:
    """Start the LiteLLM proxy (no database) in front of ``upstream_url``.

    ``conn_limit`` > 0 replaces LiteLLM's default cap on upstream connections
    (1000 total, 500 per host, per worker), which otherwise queues streams
    beyond 500 per worker.
    """
    bindir = litellm_bin()
    config = write_litellm_config(upstream_url, workdir)
    port = free_port()
    env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", LITELLM_LOG="ERROR")
    if conn_limit > 0:
        env["AIOHTTP_CONNECTOR_LIMIT"] = env["AIOHTTP_CONNECTOR_LIMIT_PER_HOST"] = str(conn_limit)
    env.pop("DATABASE_URL", None)
    argv = [
        str(bindir / "litellm"),
        "--config",
        str(config),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--num_workers",
        str(workers),
    ]
    svc = Service("litellm", argv, workdir, env=env, cwd=workdir)
    try:
        startup = wait_http(f"http://127.0.0.1:{port}/health/readiness", svc, timeout)
    except RuntimeError:
        svc.stop()
        raise
    return Target(
        "litellm",
        f"http://127.0.0.1:{port}/v1",
        LITELLM_MASTER_KEY,
        [svc.pid],
        svc.stop,
        startup_s=startup,
        version=litellm_version(bindir),
    )


# --------------------------------------------------------------------------
# The stack's floor
# --------------------------------------------------------------------------

FLOOR_WORKERS = 2


def start_floor(upstream_url: str, workdir: Path, gunicorn: Path, timeout: float = 60) -> Target:
    """Start bench/floor_app.py under gunicorn's gevent worker in front of ``upstream_url``.

    Same worker class, worker count, connections per worker and keep-alive as Kiln's
    deploy/gunicorn.conf.py, so that the two differ only in the app.
    """
    port = free_port()
    argv = [
        str(gunicorn), "--worker-class", "gevent", "--workers", str(FLOOR_WORKERS),
        "--worker-connections", "10000", "--keep-alive", "5", "--no-control-socket",
        "--bind", f"127.0.0.1:{port}", "--chdir", str(BENCH_DIR), "floor_app:create_app()",
    ]  # fmt: skip
    env = dict(os.environ, FLOOR_UPSTREAM_URL=upstream_url)
    svc = Service("floor", argv, workdir, env=env)
    try:
        startup = wait_http(f"http://127.0.0.1:{port}/health", svc, timeout)
    except RuntimeError:
        svc.stop()
        raise
    return Target(
        "floor",
        f"http://127.0.0.1:{port}/v1",
        "",
        [svc.pid],
        svc.stop,
        startup_s=startup,
        version=f"bench/floor_app.py, gunicorn gevent × {FLOOR_WORKERS}",
    )


# --------------------------------------------------------------------------
# Sanity check
# --------------------------------------------------------------------------


def check_chat(target: Target) -> dict:
    """One non-stream completion through ``target``; raise unless it is the fake's."""
    host, port, prefix = split_base_url(target.base_url)
    conn = http.client.HTTPConnection(host, port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if target.api_key:
        headers["Authorization"] = f"Bearer {target.api_key}"
    try:
        conn.request("POST", f"{prefix}/chat/completions", chat_body(False), headers)
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    if resp.status != 200:
        raise RuntimeError(f"{target.name}: HTTP {resp.status}: {body[:300]!r}")
    data = json.loads(body)
    text = data["choices"][0]["message"]["content"]
    if "fake upstream" not in text:
        raise RuntimeError(f"{target.name}: answer did not come from the fake: {text!r}")
    return {"usage": data.get("usage")}
