#!/usr/bin/env python3
"""Fast fake OpenAI-compatible upstream for benchmarks.

A stdlib-only HTTP/1.1 server built on ``asyncio.Protocol`` with keep-alive,
pipelining-safe request parsing and optional multi-process serving through
``SO_REUSEPORT``.  It answers:

* ``POST /v1/chat/completions`` -- non-stream: one JSON completion with usage
  after ``latency_ms``; stream: ``chunks`` SSE events spaced ``gap_ms`` apart
  (the first after ``latency_ms``), a usage chunk when
  ``stream_options.include_usage`` is true, then ``data: [DONE]``.
* ``POST /v1/completions`` -- the same for a legacy text completion: a
  ``text_completion`` object, or a stream of ``text_completion`` chunks.
* ``POST /v1/embeddings`` -- one ``EMBEDDING_DIMS``-float vector per input (the
  same for every input, floats whatever ``encoding_format`` asks) with usage,
  after ``latency_ms``.
* ``GET /v1/models`` -- a one-model list.
* ``GET /health`` -- ``ok``.
* ``GET /bench/stats`` -- counters summed over all processes: ``requests``,
  ``streams_started`` and ``active_streams`` (lets a benchmark check traffic
  really reached the upstream and that a gateway stops upstream streams whose
  clients went away).

Per-request overrides of ``latency_ms``, ``gap_ms``, ``chunks`` and ``distinct``
(first match wins):

1. headers ``X-Bench-Latency-Ms``, ``X-Bench-Gap-Ms``, ``X-Bench-Chunks``,
   ``X-Bench-Distinct``;
2. top-level body fields ``bench_latency_ms``, ``bench_gap_ms``,
   ``bench_chunks``, ``bench_distinct``;
3. a directive anywhere in the last message's text, e.g.
   ``[bench gap_ms=1 chunks=64 latency_ms=0]`` -- this one survives gateways
   that drop unknown headers and body fields.

``gap_ms=0`` writes the chunks back to back, as fast as the process can.
``distinct=1`` numbers each chunk's text (``tok0 ``, ``tok1 ``...) instead of
repeating ``tok ``: a model does not repeat one token for long, and LiteLLM
ends a stream that repeats one chunk 100 times.

Prints ``ready <base_url>`` on stdout once every process listens.

    python bench/fake_openai.py --port 0 --workers 1 --gap-ms 20 --chunks 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

try:  # uvloop is optional; the stdlib loop is the default.
    import uvloop  # type: ignore
except ImportError:  # pragma: no cover - depends on the environment
    uvloop = None

MODEL_ID = "bench-model"
MODELS = {
    "object": "list",
    "data": [{"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "bench"}],
}
TOKEN_TEXT = "tok "
NONSTREAM_TEXT = "This is a fixed benchmark answer from the fake upstream."
NONSTREAM_TOKENS = 12
EMBEDDING_DIMS = 384  # a small sentence-embedding model's size
# Serialised once: writing 384 floats as JSON would cost the fake more than a chat answer.
EMBEDDING_JSON = json.dumps([round(math.sin(i + 1) / 20, 8) for i in range(EMBEDDING_DIMS)],
                            separators=(",", ":")).encode()
MAX_HEADER_BYTES = 64 * 1024
DIRECTIVE_RE = re.compile(r"\[bench ([^\]]*)\]")
OVERRIDE_KEYS = ("latency_ms", "gap_ms", "chunks", "distinct")

REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


@dataclass
class Settings:
    """Default pacing; each request may override it."""

    latency_ms: float = 0.0
    gap_ms: float = 20.0
    chunks: int = 64
    distinct: bool = False  # number each chunk's text instead of repeating TOKEN_TEXT


class Stats:
    """Counters in shared memory, one row per serving process."""

    FIELDS = ("requests", "streams_started", "active_streams")

    def __init__(self, processes: int):
        self.cells = multiprocessing.RawArray("q", processes * len(self.FIELDS))
        self.row = 0  # set in each process after fork

    def add(self, field: str, delta: int = 1):
        self.cells[self.row * len(self.FIELDS) + self.FIELDS.index(field)] += delta

    def totals(self) -> dict:
        n = len(self.FIELDS)
        return {f: sum(self.cells[i::n]) for i, f in enumerate(self.FIELDS)}


STATS = Stats(1)


@dataclass
class Request:
    """One parsed HTTP request."""

    method: str
    path: str
    headers: dict
    body: bytes
    keep_alive: bool


# --------------------------------------------------------------------------
# HTTP parsing
# --------------------------------------------------------------------------


class ParseError(Exception):
    """The client sent something that is not HTTP/1.x we understand."""


def _decode_chunked(buf: bytearray, start: int):
    """Decode a chunked body beginning at ``start``.

    Returns ``(body, end_offset)`` or ``None`` when more bytes are needed.
    """
    pos, body = start, bytearray()
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        try:
            size = int(bytes(buf[pos:eol]).split(b";")[0], 16)
        except ValueError as exc:
            raise ParseError("bad chunk size") from exc
        pos = eol + 2
        if size == 0:
            end = buf.find(b"\r\n\r\n", pos - 2)
            if end < 0:
                return None
            return bytes(body), end + 4
        if len(buf) < pos + size + 2:
            return None
        body += buf[pos : pos + size]
        pos += size + 2


def parse_request(buf: bytearray):
    """Parse one request from the front of ``buf``.

    Returns ``(Request, consumed_bytes)`` or ``None`` if incomplete.
    """
    head_end = buf.find(b"\r\n\r\n")
    if head_end < 0:
        if len(buf) > MAX_HEADER_BYTES:
            raise ParseError("headers too large")
        return None
    lines = bytes(buf[:head_end]).decode("latin-1").split("\r\n")
    try:
        method, path, version = lines[0].split(" ", 2)
    except ValueError as exc:
        raise ParseError("bad request line") from exc
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    body_start = head_end + 4
    if "chunked" in headers.get("transfer-encoding", "").lower():
        decoded = _decode_chunked(buf, body_start)
        if decoded is None:
            return None
        body, end = decoded
    else:
        length = int(headers.get("content-length", "0") or 0)
        end = body_start + length
        if len(buf) < end:
            return None
        body = bytes(buf[body_start:end])
    conn = headers.get("connection", "").lower()
    keep_alive = conn != "close" if version == "HTTP/1.1" else conn == "keep-alive"
    return Request(method, path.split("?", 1)[0], headers, body, keep_alive), end


# --------------------------------------------------------------------------
# Response building
# --------------------------------------------------------------------------


def http_head(status: int, headers: dict, keep_alive: bool) -> bytes:
    """Serialize a status line plus headers."""
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines.append("connection: keep-alive" if keep_alive else "connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def json_response(status: int, payload, keep_alive: bool) -> bytes:
    """A complete JSON response."""
    return json_bytes_response(status, json.dumps(payload, separators=(",", ":")).encode(),
                               keep_alive)


def json_bytes_response(status: int, body: bytes, keep_alive: bool) -> bytes:
    """A complete response of JSON ``body``."""
    head = http_head(
        status,
        {"content-type": "application/json", "content-length": str(len(body))},
        keep_alive,
    )
    return head + body


def error_response(status: int, message: str, keep_alive: bool) -> bytes:
    """An OpenAI-style error body."""
    err = {"error": {"message": message, "type": "invalid_request_error", "code": None}}
    return json_response(status, err, keep_alive)


def sse_chunk(event: bytes) -> bytes:
    """Wrap one SSE event as one HTTP chunk."""
    return b"%x\r\n%s\r\n" % (len(event), event)


def sse_event(payload) -> bytes:
    """``data: {...}\\n\\n``."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def prompt_tokens(messages) -> int:
    """Rough token estimate: one token per four characters of text."""
    chars = 0
    for msg in messages or ():
        content = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return max(1, chars // 4)


def usage(prompt: int, completion: int) -> dict:
    """OpenAI ``usage`` object."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def completion_body(model: str, prompt: int) -> dict:
    """Non-stream chat completion."""
    return {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": "fake-openai",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": NONSTREAM_TEXT},
                "finish_reason": "stop",
            }
        ],
        "usage": usage(prompt, NONSTREAM_TOKENS),
    }


def chunk_body(model: str, created: int, delta: dict, finish=None) -> dict:
    """One streamed ``chat.completion.chunk``."""
    return {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": "fake-openai",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def chat_piece(model: str, created: int, i: int, text: str) -> dict:
    """The ``i``-th token chunk of a chat stream, ``text`` (the first names the role)."""
    delta = {"role": "assistant", "content": text} if i == 0 else {"content": text}
    return chunk_body(model, created, delta)


def chat_last(model: str, created: int) -> dict:
    """The chunk that ends a chat stream."""
    return chunk_body(model, created, {}, "stop")


def text_tokens(value) -> int:
    """Rough token estimate of a ``prompt`` or an embeddings ``input``: one token per four
    characters of a string, a token array as long as it is, and their sum in a list."""
    if isinstance(value, str):
        return max(1, len(value) // 4)
    if isinstance(value, list):
        return max(1, sum(1 if type(v) is int else text_tokens(v) for v in value))
    return 1


def text_completion_body(model: str, prompt: int) -> dict:
    """Non-stream legacy text completion."""
    return {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": "fake-openai",
        "choices": [
            {"index": 0, "text": NONSTREAM_TEXT, "logprobs": None, "finish_reason": "stop"}
        ],
        "usage": usage(prompt, NONSTREAM_TOKENS),
    }


def text_chunk_body(model: str, created: int, text: str, finish=None) -> dict:
    """One streamed ``text_completion`` chunk."""
    return {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": "fake-openai",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }


@dataclass(frozen=True)
class Api:
    """How a generating endpoint reads its request and writes its answers."""

    prompt: Callable[[dict], int]  # request body -> prompt tokens
    answer: Callable[[str, int], dict]  # (model, prompt tokens) -> the non-stream answer
    piece: Callable[[str, int, int, str], dict]  # (model, created, i, text) -> i-th chunk
    last: Callable[[str, int], dict]  # (model, created) -> the chunk that ends the stream


CHAT = Api(lambda body: prompt_tokens(body.get("messages")), completion_body, chat_piece,
           chat_last)
TEXT = Api(
    lambda body: text_tokens(body.get("prompt")),
    text_completion_body,
    lambda model, created, i, text: text_chunk_body(model, created, text),
    lambda model, created: text_chunk_body(model, created, "", "stop"),
)
GENERATE = {  # path -> the endpoint answering it
    "/v1/chat/completions": CHAT, "/chat/completions": CHAT,
    "/v1/completions": TEXT, "/completions": TEXT,
}  # fmt: skip
EMBEDDINGS_PATHS = ("/v1/embeddings", "/embeddings")


def embedding_inputs(value) -> list:
    """The inputs of an embeddings ``input``: a string or a token array, or a list of them."""
    if isinstance(value, list) and value and type(value[0]) is not int:
        return value
    return [value]


def embeddings_body(model: str, inputs: list) -> bytes:
    """A list of embeddings, one per input, with usage, as JSON."""
    tokens = text_tokens(inputs)
    payload = {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": None} for i in range(len(inputs))
        ],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    text = json.dumps(payload, separators=(",", ":")).encode()
    return text.replace(b'"embedding":null', b'"embedding":' + EMBEDDING_JSON)


# --------------------------------------------------------------------------
# Per-request settings
# --------------------------------------------------------------------------


def _last_message_text(body: dict) -> str:
    messages = body.get("messages") or []
    if not messages or not isinstance(messages[-1], dict):
        return ""
    content = messages[-1].get("content")
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def request_settings(req: Request, body: dict, defaults: Settings) -> Settings:
    """Apply header, body-field and message-directive overrides."""
    found = {}
    match = DIRECTIVE_RE.search(_last_message_text(body))
    if match:
        for item in match.group(1).split():
            key, _, value = item.partition("=")
            if key in OVERRIDE_KEYS:
                found[key] = value
    for key in OVERRIDE_KEYS:
        if f"bench_{key}" in body:
            found[key] = body[f"bench_{key}"]
        header = "x-bench-" + key.replace("_", "-")
        if header in req.headers:
            found[key] = req.headers[header]
    return Settings(
        latency_ms=float(found.get("latency_ms", defaults.latency_ms)),
        gap_ms=float(found.get("gap_ms", defaults.gap_ms)),
        chunks=max(1, int(found.get("chunks", defaults.chunks))),
        distinct=bool(int(found.get("distinct", defaults.distinct))),
    )


# --------------------------------------------------------------------------
# Connection handling
# --------------------------------------------------------------------------


class Connection(asyncio.Protocol):
    """One client connection; requests are answered strictly in order."""

    def __init__(self, defaults: Settings):
        self.defaults = defaults
        self.buf = bytearray()
        self.transport = None
        self.busy = False  # a delayed or streamed response is in flight
        self.closed = False
        self.stream_task = None

    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc):
        self.closed = True
        if self.stream_task is not None:
            self.stream_task.cancel()  # stop pacing a stream nobody reads

    def data_received(self, data):
        self.buf += data
        if not self.busy:
            self.process()

    def process(self):
        """Answer every complete request in the buffer that can be answered now."""
        while not self.closed and not self.busy:
            try:
                parsed = parse_request(self.buf)
            except (ParseError, ValueError) as exc:
                self.transport.write(error_response(400, str(exc), False))
                self.transport.close()
                return
            if parsed is None:
                return
            req, consumed = parsed
            del self.buf[:consumed]
            self.dispatch(req)

    def finish(self, keep_alive: bool):
        """Called after an async response is fully written."""
        self.busy = False
        if self.closed:
            return
        if not keep_alive:
            self.transport.close()
            return
        self.process()

    def reply(self, data: bytes, keep_alive: bool):
        self.transport.write(data)
        if not keep_alive:
            self.transport.close()
            self.closed = True

    def dispatch(self, req: Request):
        STATS.add("requests")
        if req.path in GENERATE or req.path in EMBEDDINGS_PATHS:
            if req.method != "POST":
                return self.reply(error_response(405, "use POST", req.keep_alive), req.keep_alive)
            api = GENERATE.get(req.path)
            return self.generate(req, api) if api else self.embed(req)
        if req.path in ("/v1/models", "/models") and req.method == "GET":
            return self.reply(json_response(200, MODELS, req.keep_alive), req.keep_alive)
        if req.path == "/bench/stats":
            return self.reply(json_response(200, STATS.totals(), req.keep_alive), req.keep_alive)
        if req.path == "/health":
            return self.reply(json_response(200, {"status": "ok"}, req.keep_alive), req.keep_alive)
        return self.reply(error_response(404, "not found", req.keep_alive), req.keep_alive)

    def read_body(self, req: Request):
        """``(body, settings)`` of a POST, or ``None`` once a 400 is sent."""
        try:
            body = json.loads(req.body or b"{}")
            if not isinstance(body, dict):
                raise TypeError("body must be a JSON object")
            return body, request_settings(req, body, self.defaults)
        except (TypeError, ValueError) as exc:
            self.reply(error_response(400, str(exc), req.keep_alive), req.keep_alive)
            return None

    def generate(self, req: Request, api: Api):
        """A chat or text completion: one JSON answer, or a stream."""
        read = self.read_body(req)
        if read is None:
            return None
        body, settings = read
        model = str(body.get("model") or MODEL_ID)
        prompt = api.prompt(body)
        if body.get("stream"):
            self.busy = True
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            self.stream_task = asyncio.ensure_future(
                self.stream(req, settings, model, prompt, include_usage, api)
            )
            return None
        payload = json_response(200, api.answer(model, prompt), req.keep_alive)
        return self.answer(payload, settings, req.keep_alive)

    def embed(self, req: Request):
        """A list of embeddings, one per input."""
        read = self.read_body(req)
        if read is None:
            return None
        body, settings = read
        model = str(body.get("model") or MODEL_ID)
        inputs = embedding_inputs(body.get("input"))
        payload = json_bytes_response(200, embeddings_body(model, inputs), req.keep_alive)
        return self.answer(payload, settings, req.keep_alive)

    def answer(self, payload: bytes, settings: Settings, keep_alive: bool):
        """Send a whole JSON answer after the request's ``latency_ms``."""
        if settings.latency_ms <= 0:
            return self.reply(payload, keep_alive)
        self.busy = True
        loop = asyncio.get_running_loop()
        loop.call_later(settings.latency_ms / 1000, self._delayed, payload, keep_alive)
        return None

    def _delayed(self, payload: bytes, keep_alive: bool):
        if not self.closed:
            self.transport.write(payload)
        self.finish(keep_alive)

    async def stream(self, req, settings: Settings, model, prompt, include_usage, api: Api):
        """Write the SSE stream on an absolute schedule so gaps do not drift."""
        keep_alive = req.keep_alive
        loop = asyncio.get_running_loop()
        created = int(time.time())
        head = http_head(
            200,
            {
                "content-type": "text/event-stream",
                "cache-control": "no-cache",
                "transfer-encoding": "chunked",
            },
            keep_alive,
        )
        start = loop.time() + settings.latency_ms / 1000
        gap = settings.gap_ms / 1000
        STATS.add("streams_started")
        STATS.add("active_streams")
        try:
            if settings.latency_ms > 0:
                await asyncio.sleep(settings.latency_ms / 1000)
            self.transport.write(head)
            for i in range(settings.chunks):
                delay = start + i * gap - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                if self.closed:
                    return
                text = f"tok{i} " if settings.distinct else TOKEN_TEXT
                self.transport.write(sse_chunk(sse_event(api.piece(model, created, i, text))))
            last = api.last(model, created)
            tail = sse_chunk(sse_event(last))
            if include_usage:
                last = {**last, "choices": [], "usage": usage(prompt, settings.chunks)}
                tail += sse_chunk(sse_event(last))
            tail += sse_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
            if not self.closed:
                self.transport.write(tail)
        finally:
            STATS.add("active_streams", -1)
            self.stream_task = None
            self.finish(keep_alive)


# --------------------------------------------------------------------------
# Serving
# --------------------------------------------------------------------------


def make_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket with SO_REUSEPORT so several processes can share a port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.setblocking(False)
    return sock


async def serve(sock: socket.socket, defaults: Settings, on_ready=None):
    """Serve forever on ``sock``."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Connection(defaults), sock=sock, backlog=4096)
    if on_ready:
        on_ready()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def run_loop(coro, use_uvloop: bool):
    if use_uvloop and uvloop is not None:
        uvloop.install()
    asyncio.run(coro)


def spawn_children(host: str, port: int, count: int, defaults: Settings, use_uvloop: bool):
    """Fork ``count`` extra serving processes on the same port; return their PIDs."""
    pids = []
    for row in range(1, count + 1):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            STATS.row = row

            def ready(fd=write_fd):
                os.write(fd, b"1")
                os.close(fd)

            try:
                run_loop(serve(make_socket(host, port), defaults, ready), use_uvloop)
            finally:
                os._exit(0)
        os.close(write_fd)
        os.read(read_fd, 1)  # wait until the child listens
        os.close(read_fd)
        pids.append(pid)
    return pids


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--workers", type=int, default=1, help="processes sharing the port")
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--gap-ms", type=float, default=20.0)
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--uvloop", action="store_true", help="use uvloop if installed")
    return p.parse_args(argv)


def main(argv=None):
    global STATS
    args = parse_args(argv)
    STATS = Stats(args.workers)
    defaults = Settings(args.latency_ms, args.gap_ms, args.chunks)
    sock = make_socket(args.host, args.port)
    port = sock.getsockname()[1]
    children = spawn_children(args.host, port, args.workers - 1, defaults, args.uvloop)

    def ready():
        print(f"ready http://{args.host}:{port}/v1", flush=True)

    try:
        run_loop(serve(sock, defaults, ready), args.uvloop)
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGTERM)
                os.waitpid(pid, 0)
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main())
