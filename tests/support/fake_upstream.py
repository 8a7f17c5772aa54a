"""Scripted fake OpenAI-compatible upstream for fault-injection tests.

A plain-threads HTTP/1.1 server on raw sockets that gives tests exact control of
the bytes sent and of their timing. Every request runs a *script*: a list of steps

    Status(code, headers, chunked)  status line + headers
    Send(data)                      bytes; one HTTP chunk each when chunked
    Sleep(seconds)                  pause (watching for the client going away)
    Reset()                         abort with RST (SO_LINGER on, timeout 0)
    Close()                         FIN, without the chunked terminator
    Hang()                          send nothing more until the client closes
    Finish()                        end the response normally (implicit at the end)
    Gate(event)                     send nothing more until the test sets ``event``

A ``Send`` before any ``Status`` writes raw bytes (for malformed status lines).
Framing picked by ``Status``: ``chunked=True`` adds ``Transfer-Encoding: chunked``;
``chunked=False`` with a ``Content-Length`` header keeps the connection alive, as does one with
a ``Transfer-Encoding`` header (the script's Sends then frame the chunks themselves);
``chunked=False`` without either adds ``Connection: close`` and closes after the body.

Scripts come from ``FakeUpstream.enqueue`` (FIFO, per path) or, when none is
queued, from the settable ``FakeUpstream.default(record) -> script``.

Run standalone: ``python tests/support/fake_upstream.py --port N [--stream-delay S]
[--chunks K] [--hold S]``; prints ``ready`` on stdout once listening.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from http import HTTPStatus
from typing import Any, Self

from requests.structures import CaseInsensitiveDict

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
# llama.cpp's token count route (llama-cpp-python's server), outside /v1 as there.
TOKENIZE_PATH = "/extras/tokenize/count"
POLL_S = 0.02  # client-close polling interval while sleeping/hanging, seconds
WORDS = ("Hello", " from", " the", " fake", " upstream!")


# ---------------------------------------------------------------- script steps


@dataclasses.dataclass(frozen=True)
class Status:
    """Status line + headers. code: HTTP status; headers: {name: value}."""

    code: int = 200
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    chunked: bool = True
    reason: str | None = None  # default: the standard phrase for ``code``


@dataclasses.dataclass(frozen=True)
class Send:
    """Bytes to write; one HTTP chunk when the response is chunked."""

    data: bytes


@dataclasses.dataclass(frozen=True)
class Sleep:
    """Pause for ``seconds``; ends the script early if the client goes away."""

    seconds: float


@dataclasses.dataclass(frozen=True)
class Reset:
    """Abort the connection with a TCP RST."""


@dataclasses.dataclass(frozen=True)
class Close:
    """Close the connection with a FIN, leaving any chunked body unterminated."""


@dataclasses.dataclass(frozen=True)
class Hang:
    """Send nothing more; wait until the client closes the connection."""


@dataclasses.dataclass(frozen=True)
class Finish:
    """End the response (chunk terminator if chunked) and keep the connection."""


@dataclasses.dataclass(frozen=True)
class Gate:
    """Send nothing more until ``opened`` is set (or the client closes): the test paces the
    response by what it has received, with no clock involved."""

    opened: threading.Event


Step = Status | Send | Sleep | Reset | Close | Hang | Finish | Gate
Script = Sequence[Step]


# ---------------------------------------------------------------- builders


def _compact(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def make_usage(prompt: int = 10, completion: int = 5) -> dict:
    """OpenAI usage object: {prompt_tokens, completion_tokens, total_tokens}."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def json_reply(obj: Any, status: int = 200, headers: Mapping | None = None) -> list:
    """Script: a Content-Length JSON response (connection kept alive)."""
    body = _compact(obj)
    head = {"Content-Type": "application/json", "Content-Length": str(len(body))}
    return [Status(status, {**head, **(headers or {})}, chunked=False), Send(body)]


def error_reply(status: int, message: str, plain: bool = False,
                err_type: str | None = None) -> list:
    """Script: OpenAI error envelope JSON, or ``message`` as text/plain if ``plain``."""
    if plain:
        body = message.encode()
        head = {"Content-Type": "text/plain; charset=utf-8", "Content-Length": str(len(body))}
        return [Status(status, head, chunked=False), Send(body)]
    kind = err_type or ("invalid_request_error" if status < 500 else "server_error")
    error = {"message": message, "type": kind, "param": None, "code": None}
    return json_reply({"error": error}, status=status)


def sse_event(event: Mapping | bytes | str) -> bytes:
    """One SSE frame: a dict becomes ``data: {compact json}\\n\\n``; bytes/str go as is."""
    if isinstance(event, bytes):
        return event
    if isinstance(event, str):
        return event.encode()
    return b"data: " + _compact(event) + b"\n\n"


def sse(events: Sequence, delay_s: float = 0.0, done: bool = True, status: int = 200,
        headers: Mapping | None = None) -> list:
    """Script: chunked text/event-stream, one chunk per event, ``delay_s`` apart.

    events: dicts (serialised) or raw bytes (sent exactly); ``done`` appends
    ``data: [DONE]``.
    """
    head = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    steps: list = [Status(status, {**head, **(headers or {})}, chunked=True)]
    frames = [sse_event(e) for e in events] + ([b"data: [DONE]\n\n"] if done else [])
    for i, frame in enumerate(frames):
        if i and delay_s > 0:
            steps.append(Sleep(delay_s))
        steps.append(Send(frame))
    return steps


def chat_chunk(content: str | None = None, tool_calls: list | None = None,
               finish_reason: str | None = None, index: int = 0,
               usage: dict | None = None, choices: bool = True, role: str | None = None,
               model: str = "fake-model", completion_id: str = "chatcmpl-fake") -> dict:
    """A ``chat.completion.chunk``; ``choices=False`` gives ``choices: []`` (usage chunk)."""
    delta: dict = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    chunk = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [choice] if choices else [],
    }
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def chat_completion(content: str | None, usage: dict | None = None,
                    finish_reason: str = "stop", tool_calls: list | None = None,
                    model: str = "fake-model", completion_id: str = "chatcmpl-fake") -> dict:
    """A ``chat.completion`` object; usage defaults to ``make_usage()`` (10/5/15)."""
    message: dict = {"role": "assistant", "content": content}
    if tool_calls is not None:
        message["tool_calls"] = tool_calls
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": finish_reason}],
        "usage": usage if usage is not None else make_usage(),
    }


def text_chunk(text: str | None = None, finish_reason: str | None = None, index: int = 0,
               usage: dict | None = None, choices: bool = True) -> dict:
    """One ``text_completion`` stream chunk (OpenAI's legacy completions)."""
    chunk: dict = {"id": "cmpl-fake", "object": "text_completion", "created": 1,
                   "model": "upstream-fake",
                   "choices": [{"index": index, "text": text or "", "logprobs": None,
                                "finish_reason": finish_reason}] if choices else []}
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def text_completion(text: str, usage: dict | None = None, finish_reason: str = "stop") -> dict:
    """A whole ``text_completion`` object."""
    out: dict = {"id": "cmpl-fake", "object": "text_completion", "created": 1,
                 "model": "upstream-fake",
                 "choices": [{"index": 0, "text": text, "logprobs": None,
                              "finish_reason": finish_reason}]}
    if usage is not None:
        out["usage"] = usage
    return out


def embeddings_list(count: int, dims: int = 4, usage: dict | None = None) -> dict:
    """An embeddings list of ``count`` vectors of ``dims`` floats (vector i is all i + 0.5)."""
    out: dict = {"object": "list", "model": "upstream-embed",
                 "data": [{"object": "embedding", "index": i, "embedding": [i + 0.5] * dims}
                          for i in range(count)]}
    if usage is not None:
        out["usage"] = usage
    return out


def models_list(*ids: str) -> dict:
    """A ``/v1/models`` list object (default: one ``fake-model``)."""
    data = [{"id": i, "object": "model", "created": 0, "owned_by": "fake"}
            for i in ids or ("fake-model",)]
    return {"object": "list", "data": data}


def fake_token_count(text: str) -> int:
    """The fake's tokenizer: one token per whitespace-separated word (far below the UTF-8
    bytes of any text of words, so a count that fell back to bytes shows)."""
    return len(text.split())


def default_script(record: RequestRecord, chunks: int = 5, delay_s: float = 0.0,
                   hold_s: float = 0.0) -> list:
    """Built-in responder.

    GET .../models -> models_list(); POST /extras/tokenize/count -> ``{"count": N}``,
    N the :func:`fake_token_count` of its ``input``; POST .../chat/completions ->
    chat_completion (usage 10/5/15) or, with ``"stream": true``, an SSE stream of ``chunks`` content
    chunks ``delay_s`` seconds apart + finish chunk (+ usage chunk if
    ``stream_options.include_usage``) + ``[DONE]``; anything else -> 404.
    ``hold_s`` seconds pass before the status line.
    """
    steps: list = [Sleep(hold_s)] if hold_s > 0 else []
    path = record.path.split("?", 1)[0]
    if record.method == "GET" and path.endswith("/models"):
        return steps + json_reply(models_list())
    if record.method == "POST" and path == TOKENIZE_PATH:
        text = (record.json or {}).get("input") if isinstance(record.json, dict) else None
        if not isinstance(text, str):
            return steps + error_reply(422, "input must be a string")
        return steps + json_reply({"count": fake_token_count(text)})
    if record.method != "POST" or not path.endswith("/chat/completions"):
        return steps + error_reply(404, f"no route for {record.method} {path}")
    req = record.json if isinstance(record.json, dict) else {}
    model = req.get("model") or "fake-model"
    if not req.get("stream"):
        return steps + json_reply(chat_completion("".join(WORDS), model=model))
    pieces = [WORDS[i % len(WORDS)] for i in range(chunks)]
    events = [chat_chunk(p, role="assistant" if i == 0 else None, model=model)
              for i, p in enumerate(pieces)]
    events.append(chat_chunk(finish_reason="stop", model=model))
    if (req.get("stream_options") or {}).get("include_usage"):
        events.append(chat_chunk(choices=False, usage=make_usage(completion=chunks), model=model))
    return steps + sse(events, delay_s=delay_s)


# ---------------------------------------------------------------- recording


@dataclasses.dataclass
class RequestRecord:
    """One received request. Times are ``time.monotonic()`` seconds."""

    method: str
    path: str  # request target, query string included
    headers: CaseInsensitiveDict
    body: bytes
    json: Any  # parsed body, or None
    received_at: float
    conn_id: int  # same value == same TCP connection
    closed_at: float | None = None  # client closed/reset during or after the response
    completed: bool = False  # the script ran to its end
    sent_at: list = dataclasses.field(default_factory=list)  # when each body Send went out


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None


class _PeerClosed(Exception):
    """The client closed the connection mid-read."""


class _Reader:
    """Buffered HTTP/1.1 request reader on one socket."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise _PeerClosed()
        self.buf += data

    def _until(self, sep: bytes) -> bytes:
        while (end := self.buf.find(sep)) < 0:
            self._fill()
        out = bytes(self.buf[:end])
        del self.buf[:end + len(sep)]
        return out

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def _chunked(self) -> bytes:
        body = bytearray()
        while size := int(self._until(b"\r\n").split(b";")[0], 16):
            body += self._exact(size)
            self._until(b"\r\n")
        while self._until(b"\r\n"):  # trailers
            pass
        return bytes(body)

    def read_request(self) -> tuple[str, str, CaseInsensitiveDict, bytes]:
        """Next request as (method, target, headers, body); raises _PeerClosed."""
        lines = self._until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        method, target, _version = lines[0].split(" ", 2)
        headers = CaseInsensitiveDict()
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            return method, target, headers, self._chunked()
        return method, target, headers, self._exact(int(headers.get("content-length", 0)))


# ---------------------------------------------------------------- wire helpers


def _head(step: Status, framing: str) -> bytes:
    """Status line + headers; framing: "chunked" | "length" | "close"."""
    try:
        reason = step.reason or HTTPStatus(step.code).phrase
    except ValueError:
        reason = "Unknown"
    headers = dict(step.headers)
    if framing == "chunked":
        headers["Transfer-Encoding"] = "chunked"
    elif framing == "close":
        headers["Connection"] = "close"
    lines = [f"HTTP/1.1 {step.code} {reason}"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _framing(step: Status) -> str:
    if step.chunked:
        return "chunked"
    # A Content-Length, or a Transfer-Encoding the script frames itself (raw chunks in its
    # Sends), delimits the body: the connection stays open after it.
    framed = any(k.lower() in ("content-length", "transfer-encoding") for k in step.headers)
    return "length" if framed else "close"


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _peer_gone(sock: socket.socket) -> bool:
    """True if the client has closed/reset; never consumes data. Waits ≤ POLL_S."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
    if not poller.poll(POLL_S * 1000):
        return False
    try:
        if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
            return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    time.sleep(POLL_S)  # unread request data pending: don't spin
    return False


# ---------------------------------------------------------------- server


class FakeUpstream:
    """Scripted HTTP/1.1 upstream on 127.0.0.1; use as a context manager.

    Attributes: port, base_url ("http://127.0.0.1:PORT/v1"), default (record ->
    script), requests (list[RequestRecord] snapshot), active, max_active, errors
    (tracebacks from responders, as strings).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 default: Callable[[RequestRecord], Script] | None = None):
        self.host = host
        self.port = port
        self.default = default or default_script
        self.active = 0
        self.max_active = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._queue: list[tuple[str | None, Script]] = []
        self._records: list[RequestRecord] = []
        self._socks: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._conn_ids = itertools.count(1)
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None

    # -- lifecycle

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> Self:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(1024)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"fake-upstream-{self.port}")
        self._acceptor.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop accepting, cut live connections, join handler threads (≤ timeout_s each)."""
        self._stopping.set()
        if self._acceptor:
            self._acceptor.join(timeout_s)
        if self._listener:
            self._listener.close()
        with self._lock:
            socks, threads = list(self._socks), list(self._threads)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            thread.join(timeout_s)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- scripting and inspection

    def enqueue(self, script: Script, path: str | None = CHAT_PATH) -> None:
        """Queue ``script`` for the next request to ``path`` (any path if None), FIFO."""
        with self._lock:
            self._queue.append((path, list(script)))

    @property
    def requests(self) -> list[RequestRecord]:
        with self._lock:
            return list(self._records)

    def clear(self) -> None:
        """Drop queued scripts and recorded requests."""
        with self._lock:
            self._queue.clear()
            self._records.clear()

    def reset_stats(self) -> None:
        """Restart the ``max_active`` high-water mark from the current ``active``."""
        with self._lock:
            self.max_active = self.active

    def wait_for(self, predicate: Callable[[list[RequestRecord]], Any],
                 timeout: float = 5.0) -> Any:
        """Poll ``predicate(requests)`` every 10 ms until truthy; return its value.

        Raises TimeoutError after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while not (result := predicate(self.requests)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"condition not met in {timeout}s; requests={self.requests}")
            time.sleep(0.01)
        return result

    # -- connection handling

    def _accept_loop(self) -> None:
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(50):
                continue
            try:
                sock, _addr = self._listener.accept()
            except OSError:
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            thread = threading.Thread(target=self._serve, args=(sock, next(self._conn_ids)),
                                      daemon=True)
            with self._lock:
                self._socks.add(sock)
                self._threads.add(thread)
            thread.start()

    def _serve(self, sock: socket.socket, conn_id: int) -> None:
        """Serve requests on one connection until either side closes it."""
        reader, record = _Reader(sock), None
        try:
            while not self._stopping.is_set():
                try:
                    request = reader.read_request()
                except (_PeerClosed, OSError):
                    self._mark_closed(record)
                    return
                record = self._record(request, conn_id)
                if not self._respond(sock, record):
                    return
        except Exception:  # noqa: BLE001 -- responder bug: report, drop connection
            self.errors.append(traceback.format_exc())
            traceback.print_exc()
        finally:
            sock.close()
            with self._lock:
                self._socks.discard(sock)
                self._threads.discard(threading.current_thread())

    def _record(self, request: tuple, conn_id: int) -> RequestRecord:
        method, path, headers, body = request
        record = RequestRecord(method, path, headers, body, _parse_json(body),
                               time.monotonic(), conn_id)
        with self._lock:
            self._records.append(record)
        return record

    def _script_for(self, record: RequestRecord) -> Script:
        path = record.path.split("?", 1)[0]
        with self._lock:
            for i, (want, script) in enumerate(self._queue):
                if want is None or want == path:
                    del self._queue[i]
                    return script
        return list(self.default(record))

    def _mark_closed(self, record: RequestRecord | None) -> None:
        if record and record.closed_at is None and not self._stopping.is_set():
            record.closed_at = time.monotonic()

    def _watch(self, sock: socket.socket, seconds: float) -> bool:
        """Wait ``seconds`` (or until stop); True if the client went away meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self._stopping.is_set():
            if _peer_gone(sock):
                return True
        return False

    def _wait_gate(self, sock: socket.socket, opened: threading.Event) -> bool:
        """Wait until ``opened`` is set; False if the client went away (or the fake stops)."""
        while not opened.wait(POLL_S):
            if self._stopping.is_set() or _peer_gone(sock):
                return False
        return True

    def _respond(self, sock: socket.socket, record: RequestRecord) -> bool:
        """Run the script for ``record``; True to keep the connection for another request."""
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            return self._run(sock, record, self._script_for(record))
        except OSError:  # failed send: the client closed or reset
            self._mark_closed(record)
            return False
        finally:
            with self._lock:
                self.active -= 1

    def _run(self, sock: socket.socket, record: RequestRecord, script: Script) -> bool:
        framing = None  # set by Status: "chunked" | "length" | "close"
        for step in script:
            if self._stopping.is_set():
                return False
            if isinstance(step, Status):
                framing = _framing(step)
                sock.sendall(_head(step, framing))
            elif isinstance(step, Send):
                if framing != "chunked":
                    sock.sendall(step.data)
                elif step.data:  # an empty chunk would terminate the body
                    sock.sendall(b"%x\r\n%s\r\n" % (len(step.data), step.data))
                if framing is not None:
                    record.sent_at.append(time.monotonic())
            elif isinstance(step, Sleep):
                if self._watch(sock, step.seconds):
                    self._mark_closed(record)
                    return False
            elif isinstance(step, Hang):
                while not self._stopping.is_set():
                    if self._watch(sock, 1.0):
                        self._mark_closed(record)
                        break
                return False
            elif isinstance(step, (Reset, Close)):
                if isinstance(step, Reset):
                    _reset(sock)
                record.completed = True
                return False
            elif isinstance(step, Gate):
                if not self._wait_gate(sock, step.opened):
                    self._mark_closed(record)
                    return False
            elif isinstance(step, Finish):
                break
            else:
                raise TypeError(f"unknown script step {step!r}")
        if framing == "chunked":
            sock.sendall(b"0\r\n\r\n")
        record.completed = True
        wants_close = record.headers.get("connection", "").lower() == "close"
        return framing in ("chunked", "length") and not wants_close


# ---------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> None:
    """Serve the default responder until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(description="Fake OpenAI-compatible upstream.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--stream-delay", type=float, default=0.0,
                        help="seconds between SSE chunks")
    parser.add_argument("--chunks", type=int, default=len(WORDS),
                        help="content chunks per streamed reply")
    parser.add_argument("--hold", type=float, default=0.0,
                        help="seconds to wait before the status line")
    args = parser.parse_args(argv)
    responder = functools.partial(default_script, chunks=args.chunks,
                                  delay_s=args.stream_delay, hold_s=args.hold)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with FakeUpstream(args.host, args.port, default=responder) as fake:
        print(f"listening on {fake.base_url}", file=sys.stderr, flush=True)
        print("ready", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


def fail_on_fake_errors(fake, since=0):
    """Fail the test if ``fake`` recorded errors past the first ``since``."""
    if len(fake.errors) > since:
        import pytest
        pytest.fail("the fake upstream failed:\n" + "\n".join(fake.errors[since:]),
                    pytrace=False)


if __name__ == "__main__":
    main()
