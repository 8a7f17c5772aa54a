"""Fixtures of the flow's end-to-end tests: the real model server."""
import sys
import tempfile
from pathlib import Path

import pytest

from gateway_proc import free_port
from model_server import start_model_server, stop, wait_ready


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
