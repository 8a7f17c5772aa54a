"""``make run`` (scripts/run-demo.sh) for real, with the llama.cpp server: however the demo ends
(a supervisor's TERM, a closed terminal's HUP, Ctrl-C, KILL, a server that fails to start or
dies), nothing it started is left running and both ports are free again."""
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import sqlalchemy as sa

from gateway_proc import ROOT, free_port

pytestmark = pytest.mark.llama

VENV = Path(sys.executable).parent.parent
UP_TIMEOUT_S = 240


def _ppid_map():
    """Return ``{pid: (ppid, state)}`` of every process, from /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            table[int(entry.name)] = (int(ppid), state)
    return table


def descendants(pid):
    """Return the pids of every live descendant of ``pid``."""
    table = _ppid_map()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, (ppid, _) in table.items() if ppid in frontier} - found
        found |= frontier
    return found


def alive(pid):
    """Tell whether ``pid`` runs (a zombie no longer does anything)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def port_free(port):
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Demo:
    """scripts/run-demo.sh in a session of its own (as a terminal's job), on free ports and a
    state directory of its own; every process it ever started is recorded while it runs."""

    def __init__(self, tmp_path, graceful_timeout_s=10):
        self.model_port, self.gateway_port = free_port(), free_port()
        self.state = tmp_path / "run"
        self.log_path = tmp_path / "run-demo.out"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
        self.env = {**env, "KILN_RUN_DIR": str(self.state),
                    "KILN_MODEL_PORT": str(self.model_port),
                    "KILN_BIND": f"127.0.0.1:{self.gateway_port}",
                    "KILN_GRACEFUL_TIMEOUT": str(graceful_timeout_s)}
        self.seen = set()
        self.proc = None

    def start(self):
        """Start the demo as a terminal starts a foreground job: in a session of its own, with
        the signals' default dispositions (a suite run under ``nohup`` or as a background job
        ignores HUP or INT, and bash cannot trap a signal ignored when it starts)."""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(["scripts/run-demo.sh", str(VENV)], cwd=ROOT,
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=default_signals)
        threading.Thread(target=self._record, daemon=True).start()
        return self

    def start_in_a_terminal(self):
        """Start the demo under a session leader that has a terminal (a pseudo-terminal: its
        controlling terminal) and keeps a hang-up to itself, as make does under tmux; return
        the terminal's master side, whose closing is the terminal going away."""
        master, slave = os.openpty()
        name = os.ttyname(slave)
        leader = ("import signal, subprocess, sys; signal.signal(signal.SIGHUP, lambda *a: None);"
                  "sys.exit(subprocess.call(sys.argv[1:]))")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", leader, "scripts/run-demo.sh", str(VENV)], cwd=ROOT,
                env=self.env, stdin=slave, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=lambda: (default_signals(),  # as start() says
                                    os.close(os.open(name, os.O_RDWR))))  # the controlling tty
        os.close(slave)
        threading.Thread(target=self._record, daemon=True).start()
        return master

    def _record(self):
        while self.proc.poll() is None:
            self.seen |= descendants(self.proc.pid)
            time.sleep(0.1)

    def output(self):
        return self.log_path.read_text(errors="replace")

    def wait_up(self):
        """Wait for the ready banner; return the demo key it prints."""
        deadline = time.monotonic() + UP_TIMEOUT_S
        while time.monotonic() < deadline:
            if match := re.search(r"API key: (kiln-\S+)", self.output()):
                time.sleep(0.5)  # a sample of the process tree as it runs
                return match.group(1)
            assert self.proc.poll() is None, self.output()
            time.sleep(0.2)
        raise AssertionError(f"the demo did not come up: {self.output()}")

    def server_pid(self, marker):
        """Return the pid of the server whose command line holds ``marker``."""
        for pid in descendants(self.proc.pid):
            try:
                if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
            except OSError:
                continue
        raise AssertionError(f"no {marker!r} process")

    def wait_end(self, timeout_s=60):
        return self.proc.wait(timeout_s)

    def assert_nothing_left(self, ports=None):
        """Every process the demo started has exited; its ports are free."""
        deadline = time.monotonic() + 5  # orphans reparented to init are reaped meanwhile
        while (left := [p for p in self.seen if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(self.seen) >= 4, self.seen  # the model server, gunicorn and its 2 workers
        assert left == [], [Path(f"/proc/{p}/cmdline").read_bytes() for p in left]
        for port in ports or (self.model_port, self.gateway_port):
            assert port_free(port), port

    def kill_leftovers(self):
        for pid in self.seen:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def default_signals():
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


@pytest.fixture
def demo(tmp_path):
    demo = Demo(tmp_path)
    yield demo
    if demo.proc is not None and demo.proc.poll() is None:
        os.killpg(demo.proc.pid, signal.SIGKILL)
    demo.kill_leftovers()


def test_term_stops_the_gateway_after_its_streams_then_the_model_server(demo):
    """A supervisor, or make forwarding its own TERM: a running stream still ends complete."""
    key = demo.start().wait_up()
    with openai.OpenAI(base_url=f"http://127.0.0.1:{demo.gateway_port}/v1", api_key=key,
                       max_retries=0, timeout=120) as client:
        stream = client.chat.completions.create(
            model="smollm2-135m", max_tokens=64, stream=True,
            messages=[{"role": "user", "content": "Count from one to thirty in words."}])
        chunks = [next(stream)]
        demo.proc.send_signal(signal.SIGTERM)
        chunks += list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert demo.wait_end() == 128 + signal.SIGTERM
    demo.assert_nothing_left()
    engine = sa.create_engine(f"sqlite:///{demo.state}/kiln.db")
    with engine.connect() as conn:
        statuses = conn.execute(sa.text("SELECT status FROM usage_events")).scalars().all()
    engine.dispose()
    assert statuses == ["completed"]


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT], ids=["HUP", "INT"])
def test_a_closed_terminal_or_ctrl_c_stops_everything(demo, sig):
    """The terminal signals its foreground job's process group (make and this script)."""
    demo.start().wait_up()
    os.killpg(demo.proc.pid, sig)
    assert demo.wait_end() == 128 + sig
    assert "stopping..." in demo.output()
    demo.assert_nothing_left()


def test_a_terminal_that_goes_away_without_a_hang_up_stops_everything(demo):
    """tmux kill-session signals the pane's process (make) alone, and make does not pass the
    hang-up on: the demo notices its terminal is gone."""
    terminal = demo.start_in_a_terminal()
    demo.wait_up()
    os.close(terminal)
    assert demo.wait_end() == 129
    assert "stopping..." in demo.output()
    demo.assert_nothing_left()


def test_kill_of_the_script_still_stops_both_servers(demo):
    demo.start().wait_up()
    demo.proc.kill()
    assert demo.wait_end() == -signal.SIGKILL
    demo.assert_nothing_left()


@pytest.mark.parametrize("which", ["gateway", "model server"])
def test_a_port_in_use_is_refused_before_anything_starts(demo, which):
    """A second demo (or anything else) on one of the ports would answer the readiness checks
    in place of this run's servers and print a key that does not work: refused up front."""
    port = demo.gateway_port if which == "gateway" else demo.model_port
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        demo.start()
        assert demo.wait_end(timeout_s=60) == 1
        assert f"127.0.0.1:{port} is already in use" in demo.output()
        assert "starting the" not in demo.output()  # neither server was started
        other = demo.model_port if which == "gateway" else demo.gateway_port
        assert port_free(other)


def test_a_server_that_dies_takes_the_demo_down_in_order(demo):
    demo.start().wait_up()
    os.kill(demo.server_pid(b"llama_cpp.server"), signal.SIGKILL)
    assert demo.wait_end() != 0
    assert "a server exited" in demo.output()
    demo.assert_nothing_left()
