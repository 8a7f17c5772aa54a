"""Large request bodies parsed and checked in a child process, off the worker's interpreter.

Parsing JSON holds the GIL from start to end: a 16 MiB body of half a million small values
takes its worker's event loop for about a second to parse and a tenth of a second to free, and
a 16 MiB string for a tenth of a second (bench/RESULTS.md, "Isolation"). Every other request
of that worker waits meanwhile. So each worker keeps child processes: a large body is piped
to one, the child parses it and checks it against the whole contract
(:func:`gateway.contract.json_body.parse_json_body`, the dialect's codec, with the worker's
catalog file), and answers either the error the request gets or the parsed body with the
canonical request the codec built of it, pickled (catalog entries by their id: the worker puts
its own back in). A body the contract refuses never becomes Python objects in the worker; a
valid one costs the worker an unpickling (a copy, not a parse), and is not checked a second
time in its event loop. Each answer tells the CPU time the child spent on it, which is what
the parse budget charges the body's org.

Each child handles one body at a time, and a worker keeps :data:`gateway.api.intake.PARSERS`
of them (:class:`BodyProcesses`; its :class:`gateway.api.intake.ParseBudget` gives turns, one
org at a time per child); a child ends when its pipe closes (its worker exited). A child that
dies, hangs past ``timeout_s`` or answers garbage is killed; that request gets a 503 with
``Retry-After``, and the next large body starts a new child.

Wire format, both ways: a 12-byte head (``!QI``: payload bytes, text bytes), a text (to the
child: the dialect and the content type; from it: the CPU seconds spent) and the payload.
The first message to a new child is the catalog path and the body limit, pickled; it answers
:data:`READY` once the catalog is loaded.
"""
import io
import logging
import os
import pickle
import struct
import sys
import time

import gevent
from gevent import subprocess
from gevent.lock import Semaphore

from ..contract.catalog import ModelEntry
from ..errors import GatewayError, ServiceUnavailable

log = logging.getLogger(__name__)

HEAD = struct.Struct("!QI")
RETRY_AFTER_S = "1"
START_TIMEOUT_S = 30.0  # a new child imports the gateway and loads the catalog: under a second
READY = b"ready\n"  # the child's first words, once its catalog is loaded
# The child yields the CPU to request serving: parsing a large body waits on a busy host
# (about a tenth of a contended core at this niceness, Linux CFS weights) instead of slowing
# every worker's requests.
NICENESS = 10


class BodyProcess:
    """One worker's body checker (the parent side).

    :param models_path: the catalog file (``KILN_MODELS``) the child loads.
    :param max_body_bytes: the body limit (413 above it).
    :param timeout_s: the longest one check may take before the child is killed (once the
        child is running: :meth:`start`).
    """

    def __init__(self, models_path, max_body_bytes, timeout_s=60.0):
        self.models_path = models_path
        self.max_body_bytes = max_body_bytes
        self.timeout_s = timeout_s
        self._proc = None
        self._owner = None  # the pid that started the child (a forked worker starts its own)
        self._starting = Semaphore()  # one child, however many requests find none running
        self.last_cpu_s = 0.0  # CPU seconds the child spent on the last body it answered

    def check(self, parts, content_type, dialect="chat"):
        """Return the body (a dict) made of ``parts`` (bytes, or a list of bytes in order) if
        the contract of ``dialect`` (a codec's name, :data:`gateway.dialects.CODECS`) accepts it.

        :raises GatewayError: the error the contract gives it (400, 404, 413).
        :raises ServiceUnavailable: the child failed; 503 ``server_busy`` with ``Retry-After``.
        """
        return self.parse(parts, content_type, dialect, {})[0]

    def parse(self, parts, content_type, dialect, catalog):
        """Return ``(body, canonical request)`` as :meth:`check` does, the request being what
        ``dialect``'s codec built (``codec.parse``), its catalog entry taken from ``catalog``
        (a mapping of model ids to entries; an id it lacks: None).

        :raises GatewayError: as :meth:`check`.
        """
        self.start()
        proc, answered = self._proc, False
        timeout = gevent.Timeout(self.timeout_s)
        timeout.start()
        try:
            _send(proc.stdin, f"{dialect}\n{content_type}".encode(),
                  [parts] if isinstance(parts, bytes) else parts)
            cpu_s, raw = _read_message(proc.stdout)
            self.last_cpu_s = float(cpu_s or 0.0)
            kind, payload = _Unpickler(io.BytesIO(raw), catalog).load()
            answered = True
        except (OSError, EOFError, ValueError, pickle.UnpicklingError, struct.error) as err:
            raise self._failed(err) from None
        except gevent.Timeout as err:
            if err is not timeout:
                raise
            raise self._failed(f"no answer within {self.timeout_s:g} s") from None
        finally:
            timeout.close()
            if not answered:  # a half-sent or half-read exchange: the pipe is out of step
                self.stop()
        if kind == "error":
            raise payload
        if kind != "body":
            raise RuntimeError(f"the body process failed: {payload}")
        return payload

    def start(self):
        """Start the child if it is not running, and wait until it has loaded the catalog
        (about half a second, once per worker: outside the parse budget's turns).

        :raises ServiceUnavailable: it could not start.
        """
        timeout = gevent.Timeout(START_TIMEOUT_S)
        timeout.start()
        try:
            with self._starting:
                self._running()
        except (OSError, EOFError) as err:
            self.stop()
            raise self._failed(err) from None
        except gevent.Timeout as err:
            if err is not timeout:
                raise
            self.stop()
            raise self._failed(f"not started within {START_TIMEOUT_S:g} s") from None
        finally:
            timeout.close()

    def stop(self):
        """Kill the child, if any (the next check starts another)."""
        proc, self._proc = self._proc, None
        if proc is not None and self._owner == os.getpid():
            proc.kill()
            proc.wait()

    def _running(self):
        if self._proc is not None and self._owner == os.getpid() and self._proc.poll() is None:
            return self._proc
        self._proc = None
        proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)
        self._proc, self._owner = proc, os.getpid()
        _send(proc.stdin, b"", [pickle.dumps((self.models_path, self.max_body_bytes))])
        _read_exactly(proc.stdout, len(READY))
        return proc

    def _failed(self, why):
        log.error("body process failed (%s); the next large body starts a new one", why)
        return ServiceUnavailable("Kiln could not check this request body; retry with backoff.",
                                  code="server_busy", headers={"Retry-After": RETRY_AFTER_S})


class BodyProcesses:
    """A worker's body checkers: ``count`` children, each used by one parse at a time (the
    parse budget hands out their indexes, :meth:`gateway.api.intake.ParseBudget.run`), each
    started at its first body."""

    def __init__(self, models_path, max_body_bytes, count):
        self.processes = [BodyProcess(models_path, max_body_bytes) for _ in range(count)]

    def parse(self, index, parts, content_type, dialect, catalog):
        """:meth:`BodyProcess.parse` with child ``index``."""
        return self.processes[index].parse(parts, content_type, dialect, catalog)

    def start(self, index):
        """:meth:`BodyProcess.start` child ``index``."""
        self.processes[index].start()

    def cpu_s(self, index):
        """The CPU seconds child ``index`` spent on the last body it answered."""
        return self.processes[index].last_cpu_s

    def stop(self):
        """Kill every child."""
        for process in self.processes:
            process.stop()


class _Pickler(pickle.Pickler):
    """Catalog entries go by their id (the worker's own are put back in)."""

    def persistent_id(self, obj):
        return ("entry", obj.id) if isinstance(obj, ModelEntry) else None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, catalog):
        super().__init__(file)
        self.catalog = catalog

    def persistent_load(self, pid):
        kind, model_id = pid
        if kind != "entry":
            raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")
        return self.catalog.get(model_id)


def _dumps(answer):
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(answer)
    return out.getvalue()


def _send(pipe, text, parts):
    pipe.write(HEAD.pack(sum(map(len, parts)), len(text)) + text)
    for part in parts:
        pipe.write(part)
    pipe.flush()


def _read_exactly(pipe, size):
    data = pipe.read(size)
    if len(data) != size:
        raise EOFError(f"the body process closed its pipe ({len(data)} of {size} bytes)")
    return data


def _read_message(pipe):
    """Return ``(text, payload)`` of the next message.

    :raises EOFError: the pipe ended first.
    """
    head = pipe.read(HEAD.size)
    if len(head) != HEAD.size:
        raise EOFError("the pipe ended before a message")
    size, text_size = HEAD.unpack(head)
    text = _read_exactly(pipe, text_size).decode()
    return text, _read_exactly(pipe, size)


def check_body(raw, content_type, catalog, max_body_bytes, dialect="chat"):
    """The child's work: parse ``raw`` and check it as the worker would, with ``dialect``'s
    codec; return ``(body, canonical request)``."""
    from ..contract.json_body import parse_json_body
    from ..contract.validation import refuse_unfit_before_parsing
    from ..dialects import CODECS
    refuse_unfit_before_parsing(raw, catalog)  # cheaper than any parse
    body = parse_json_body(raw, content_type, max_body_bytes)
    return body, CODECS[dialect].parse(body, catalog, len(raw))


def main():
    """The child: answer each body on stdin until stdin closes."""
    from ..contract.catalog import load_catalog
    os.nice(NICENESS)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers goes down the pipe
    _, setup = _read_message(stdin)
    models_path, max_body_bytes = pickle.loads(setup)
    catalog = load_catalog(models_path)  # bodies only: no backend is called, no key read
    from .. import dialects  # noqa: F401 - imported before READY, so no check pays for it
    from ..contract import json_body, validation  # noqa: F401
    stdout.write(READY)
    stdout.flush()
    while True:
        try:
            head, raw = _read_message(stdin)
            dialect, _, content_type = head.partition("\n")
        except EOFError:
            return  # the worker exited
        cpu_started = time.process_time()
        try:
            answer = ("body", check_body(raw, content_type, catalog, max_body_bytes, dialect))
        except GatewayError as err:
            answer = ("error", err)
        except Exception as err:  # noqa: BLE001 - told to the worker, which answers 500
            answer = ("failed", repr(err)[:500])
        del raw
        try:
            payload = _dumps(answer)
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            payload = _dumps(("failed", f"the answer could not be pickled: {err!r}"[:500]))
        _send(stdout, f"{time.process_time() - cpu_started:.6f}".encode(), [payload])
        del answer


if __name__ == "__main__":
    main()
