"""Small HTTP/1.1 + SSE client helpers shared by the stream benchmarks.

Nothing here blocks or owns a socket: :func:`build_chat_request` makes request
bytes and :class:`ResponseParser` is fed received bytes and reports SSE events,
so the same code serves the sequential probe and the asyncio stream holder.
"""

from __future__ import annotations

import json
import math
from urllib.parse import urlsplit


def split_base_url(base_url: str):
    """``http://host:port/v1`` -> ``(host, port, "/v1")``."""
    parts = urlsplit(base_url)
    if parts.scheme != "http":
        raise ValueError(f"only plain http targets are supported: {base_url}")
    return parts.hostname, parts.port or 80, parts.path.rstrip("/")


def chat_body(
    stream: bool,
    chunks: int = 64,
    gap_ms: float = 20.0,
    latency_ms: float = 0.0,
    model: str = "bench-model",
    distinct: bool = False,
) -> bytes:
    """A chat request; pacing travels in a message directive the fake reads.

    The directive sits in the user text so it survives gateways that strip
    unknown headers or body fields. ``distinct`` asks for numbered chunk texts
    (bench/fake_openai.py).
    """
    directive = f"[bench chunks={chunks} gap_ms={gap_ms:g} latency_ms={latency_ms:g}"
    directive += " distinct=1]" if distinct else "]"
    body = {
        "model": model,
        "max_tokens": max(16, chunks),
        "messages": [{"role": "user", "content": f"Count slowly. {directive}"}],
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body, separators=(",", ":")).encode()


def build_chat_request(base_url: str, api_key: str, body: bytes) -> bytes:
    """Raw ``POST {base}/chat/completions`` request bytes (keep-alive)."""
    host, port, prefix = split_base_url(base_url)
    lines = [
        f"POST {prefix}/chat/completions HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        "Accept: text/event-stream, application/json",
        f"Content-Length: {len(body)}",
        "Connection: keep-alive",
    ]
    if api_key:
        lines.append(f"Authorization: Bearer {api_key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class ResponseError(Exception):
    """The server's answer was not a well-formed HTTP response."""


class ResponseParser:
    """Incremental HTTP/1.1 response parser with SSE event splitting.

    Feed bytes with :meth:`feed`; it returns the SSE ``data:`` payloads (as
    ``bytes``) completed by those bytes.  ``status``, ``headers``, ``done``
    (body complete) and ``keep_alive`` are filled in as parsing progresses.
    Non-SSE bodies are collected in ``body``.
    """

    def __init__(self):
        self.buf = bytearray()
        self.status = None
        self.headers = {}
        self.done = False
        self.keep_alive = True
        self.body = bytearray()
        self._mode = None  # "chunked" | "length" | "close"
        self._remaining = 0
        self._sse = bytearray()

    def feed(self, data: bytes):
        self.buf += data
        if self.status is None and not self._parse_head():
            return []
        before = len(self.body)
        if self._mode == "chunked":
            self._parse_chunks()
        elif self._mode == "length":
            take = min(self._remaining, len(self.buf))
            self.body += self.buf[:take]
            del self.buf[:take]
            self._remaining -= take
            self.done = self._remaining == 0
        else:
            self.body += self.buf
            self.buf.clear()
        return self._sse_events(bytes(self.body[before:]))

    def eof(self):
        """The peer closed; for close-delimited bodies this completes them."""
        if self._mode == "close":
            self.done = True
        self.keep_alive = False

    def _parse_head(self) -> bool:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        del self.buf[: end + 4]
        try:
            version, status = lines[0].split(" ", 2)[:2]
            self.status = int(status)
        except ValueError as exc:
            raise ResponseError(f"bad status line {lines[0]!r}") from exc
        for line in lines[1:]:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        conn = self.headers.get("connection", "").lower()
        self.keep_alive = conn != "close" if version == "HTTP/1.1" else conn == "keep-alive"
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._mode = "chunked"
        elif "content-length" in self.headers:
            self._mode = "length"
            self._remaining = int(self.headers["content-length"])
            self.done = self._remaining == 0
        else:
            self._mode = "close"
            self.keep_alive = False
        return True

    def _parse_chunks(self):
        while not self.done:
            eol = self.buf.find(b"\r\n")
            if eol < 0:
                return
            size = int(bytes(self.buf[:eol]).split(b";")[0], 16)
            if size == 0:
                if self.buf.find(b"\r\n\r\n", eol) < 0:
                    return  # trailers not complete yet
                self.buf.clear()
                self.done = True
                return
            if len(self.buf) < eol + 2 + size + 2:
                return
            self.body += self.buf[eol + 2 : eol + 2 + size]
            del self.buf[: eol + 2 + size + 2]

    def _sse_events(self, data: bytes):
        if not data or not self.headers.get("content-type", "").startswith("text/event-stream"):
            return []
        self._sse += data.replace(b"\r\n", b"\n")
        events = []
        while True:
            end = self._sse.find(b"\n\n")
            if end < 0:
                return events
            block = bytes(self._sse[:end])
            del self._sse[: end + 2]
            payload = b"\n".join(
                line[5:].lstrip() for line in block.split(b"\n") if line.startswith(b"data:")
            )
            if payload:
                events.append(payload)


def is_content_event(payload: bytes) -> bool:
    """True for a chunk carrying non-empty assistant text."""
    if payload == b"[DONE]":
        return False
    try:
        chunk = json.loads(payload)
    except ValueError:
        return False
    for choice in chunk.get("choices") or ():
        if (choice.get("delta") or {}).get("content"):
            return True
    return False


def has_usage(payload: bytes) -> bool:
    """True for a chunk carrying a ``usage`` object."""
    return b'"usage"' in payload and b'"usage":null' not in payload


def percentile(values, pct: float):
    """Nearest-rank percentile; ``None`` for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def median(values):
    """Median of the non-``None`` values, or ``None``."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2
