"""Clients of a chaos run: each scheduled action played on a raw socket, and what it saw.

A raw HTTP/1.1 client (one connection per request, ``Connection: close``) gives exact control
of what a misbehaving client does: stop sending mid-body, leave before the headers or after any
byte, read a few bytes at a time through a small receive buffer. Every request ends as one
:class:`Observation`. "Complete" is what a client would take as a finished, billed answer: a
non-stream 200 whose JSON has ``usage.cost``, or a stream that ends in ``data: [DONE]`` after a
usage chunk with ``usage.cost``. Amounts are parsed as exact decimals (``parse_float=Decimal``).
"""
import json
import socket
import struct
import threading
import time
from dataclasses import dataclass
from decimal import Decimal

from chaos_upstream import marker

GENERATION_HEADER = "x-neocloud-generation-id"
REQUEST_TIMEOUT_S = 40.0   # a client gives up after this long in all
READ_TIMEOUT_S = 20.0      # ... or after this long without a byte (keepalives count)
SLOW_RCVBUF = 4096


@dataclass
class Observation:
    """What one request saw. Times are ``time.monotonic()`` seconds."""

    action: int
    sub: int
    kind: str
    org: int
    stream: bool
    key_kind: str                   # "current", "revoked" or "unknown"
    key_revoked_at: float = None    # when the revocation of the key used had finished
    upstream: str = ""              # the backend behaviour planned for it (chaos_plan.Upstream)
    bad_body: str = ""              # the contract breach sent, for "bad_body" actions
    t_start: float = 0.0
    t_headers: float = None
    t_end: float = None
    status: int = None
    outcome: str = ""
    complete: bool = False
    gen_id: str = None
    cost: Decimal = None
    error_code: str = None
    detail: str = ""
    gateway: int = None             # the index of the host it was sent to


class Keys:
    """Each org's current key and the keys revoked so far (shared with the fault injector)."""

    def __init__(self, current):
        self._lock = threading.Lock()
        self._current = dict(current)
        self._revoked = {org: [] for org in current}

    def current(self, org):
        with self._lock:
            return self._current[org]

    def replace(self, org, new_key, revoke):
        """Make ``new_key`` current, then run ``revoke(old key)``; record when it finished."""
        with self._lock:
            old, self._current[org] = self._current[org], new_key
        revoke(old)
        with self._lock:
            self._revoked[org].append((old, time.monotonic()))
        return old

    def last_revoked(self, org):
        """Return ``(key, revoked at)`` of the org's latest revoked key, or None."""
        with self._lock:
            return self._revoked[org][-1] if self._revoked[org] else None


# -- wire -----------------------------------------------------------------------------------


class _Closed(Exception):
    """The client closed the connection on purpose (the action's disconnect point)."""


class _Conn:
    """One client connection; counts the bytes it received."""

    def __init__(self, port, rcvbuf=None):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(READ_TIMEOUT_S)
        self.sock.connect(("127.0.0.1", port))
        self.buf = b""
        self.received = 0
        self.deadline = time.monotonic() + REQUEST_TIMEOUT_S
        self.limit = None         # close once this many bytes were received
        self.read_size = 65536
        self.pause_s = 0.0

    def close(self, reset=False):
        if reset:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def _fill(self):
        if time.monotonic() > self.deadline:
            raise socket.timeout("request deadline")
        if self.pause_s:
            time.sleep(self.pause_s)
        size = self.read_size
        if self.limit is not None:
            size = min(size, max(1, self.limit - self.received))
        data = self.sock.recv(size)
        if not data:
            raise EOFError()
        self.received += len(data)
        self.buf += data
        if self.limit is not None and self.received >= self.limit:
            raise _Closed()

    def until(self, sep):
        while (end := self.buf.find(sep)) < 0:
            self._fill()
        out, self.buf = self.buf[:end], self.buf[end + len(sep):]
        return out

    def exact(self, n):
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def rest(self):
        try:
            while True:
                self._fill()
        except EOFError:
            pass
        out, self.buf = self.buf, b""
        return out

    def head(self):
        """Read the status line and headers: ``(status, {lower-case name: value})``."""
        lines = self.until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return status, headers

    def body_pieces(self, headers):
        """Yield the body as it arrives (chunked, by length, or up to close)."""
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int(self.until(b"\r\n").split(b";")[0], 16):
                yield self.exact(size)
                self.until(b"\r\n")
            return
        if "content-length" in headers:
            yield self.exact(int(headers["content-length"]))
            return
        yield self.rest()


def _request_bytes(port, path, headers, body, content_length=None):
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close",
             f"Content-Length: {len(body) if content_length is None else content_length}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode(), body


# -- requests ---------------------------------------------------------------------------------


def chat_body(action, sub):
    """Return the JSON body of a request of ``action`` (its marker in the first message)."""
    text = marker(action.id, sub, action.org) + " Say something. " + "filler " * (
        action.filler // 7)
    body = {"model": action.model, "messages": [{"role": "user", "content": text}]}
    if action.max_tokens is not None:
        body["max_tokens"] = action.max_tokens
    if action.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def bad_request(action, key):
    """Return ``(headers, body bytes, Content-Length to announce or None, send half-closed)``."""
    good = chat_body(action, 0)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    variant = action.bad_body
    if variant == "no_auth":
        del headers["Authorization"]
    if variant == "wrong_content_type":
        headers["Content-Type"] = "text/plain"
    bodies = {
        "not_json": b'{"model": "chaos-a", "messages": [',
        "empty_messages": {**good, "messages": []},
        "messages_not_list": {**good, "messages": "hello"},
        "bad_stream_flag": {**good, "stream": "maybe"},
        "unknown_model": {**good, "model": "no-such-model"},
        "negative_max_tokens": {**good, "max_tokens": -5},
    }
    body = bodies.get(variant, good)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    if variant == "truncated":
        return headers, raw, len(raw) + 100, True
    if variant == "too_large":
        return headers, raw[:100], 17 * 1024 * 1024, True
    return headers, raw, None, False


def play(port, action, sub, keys, kind_of_key="current"):
    """Send one request of ``action`` to the gateway on ``port``; return its Observation."""
    key, revoked_at = _key_for(action, keys, kind_of_key)
    obs = Observation(action.id, sub, action.kind, action.org, action.stream, kind_of_key,
                      revoked_at, action.upstream.kind, action.bad_body)
    if kind_of_key == "revoked" and key is None:
        obs.key_kind, key = "unknown", "kiln-" + "u" * 43
    obs.t_start = time.monotonic()
    try:
        _exchange(port, action, sub, key, obs)
    except _Closed:
        obs.outcome = "disconnected"
    except (socket.timeout, TimeoutError):
        obs.outcome = "timeout"
    except (EOFError, ConnectionError, OSError) as err:
        obs.outcome = "cut" if obs.status == 200 else "conn_error"
        obs.detail = type(err).__name__
    finally:
        obs.t_end = time.monotonic()
    return obs


def _key_for(action, keys, kind_of_key):
    if kind_of_key == "revoked":
        found = keys.last_revoked(action.org)
        return (found[0], found[1]) if found else (None, None)
    return keys.current(action.org), None


def _exchange(port, action, sub, key, obs):
    half_close = False
    content_length = None
    if action.kind == "bad_body":
        headers, body, content_length, half_close = bad_request(action, key)
    else:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        body = json.dumps(chat_body(action, sub)).encode()
    slow = action.kind == "slow_reader"
    conn = _Conn(port, rcvbuf=SLOW_RCVBUF if slow else None)
    reset = action.disconnect_bytes % 2 == 1
    try:
        head, payload = _request_bytes(port, "/v1/chat/completions", headers, body,
                                       content_length)
        if action.disconnect_at == "mid_send":
            conn.sock.sendall(head + payload[:len(payload) // 2])
            time.sleep(action.disconnect_delay_s)
            raise _Closed()
        conn.sock.sendall(head + payload)
        if half_close:
            conn.sock.shutdown(socket.SHUT_WR)
        if action.disconnect_at == "before_headers":
            time.sleep(action.disconnect_delay_s)
            raise _Closed()
        if action.disconnect_at == "after_bytes":
            conn.limit = max(1, action.disconnect_bytes)
        if slow:
            conn.read_size, conn.pause_s = action.read_bytes, action.read_pause_s
        _read_response(conn, obs)
    finally:
        conn.close(reset=reset and action.kind == "disconnect")


def _read_response(conn, obs):
    obs.status, headers = conn.head()
    obs.t_headers = time.monotonic()
    obs.gen_id = headers.get(GENERATION_HEADER)
    event_stream = headers.get("content-type", "").startswith("text/event-stream")
    if obs.status == 200 and event_stream:
        _read_stream(conn, headers, obs)
        return
    raw = b"".join(conn.body_pieces(headers))
    obj = _json(raw)
    if obs.status != 200:
        error = obj.get("error") if isinstance(obj, dict) else None
        obs.error_code = error.get("code") if isinstance(error, dict) else None
        obs.outcome = f"http_{obs.status}"
        return
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if isinstance(usage, dict) and "cost" in usage:
        obs.cost, obs.complete, obs.outcome = _decimal(usage["cost"]), True, "complete"
    else:
        obs.outcome, obs.detail = "no_usage", raw[:200].decode("utf-8", "replace")


def _read_stream(conn, headers, obs):
    buf, payloads = b"", []
    try:
        for piece in conn.body_pieces(headers):
            buf += piece
            *events, buf = buf.split(b"\n\n")
            payloads += [p for p in map(_data, events) if p is not None]
    except EOFError:
        obs.outcome = "cut"
    usage_cost, error = None, None
    for payload in payloads:
        obj = _json(payload)
        if not isinstance(obj, dict):
            continue
        if "error" in obj:
            error = obj["error"]
        usage = obj.get("usage")
        if isinstance(usage, dict) and "cost" in usage:
            usage_cost = _decimal(usage["cost"])
    done = bool(payloads) and payloads[-1] == b"[DONE]"
    if done and usage_cost is not None:
        obs.cost, obs.complete, obs.outcome = usage_cost, True, "complete"
    elif error is not None:
        obs.outcome = "stream_error"
        obs.error_code = error.get("code") if isinstance(error, dict) else None
    elif done:
        obs.outcome = "no_usage"
    else:
        obs.outcome = obs.outcome or "cut"


def _data(event):
    lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


def _json(raw):
    try:
        return json.loads(raw, parse_float=Decimal)
    except (ValueError, UnicodeDecodeError):
        return None


def _decimal(value):
    if isinstance(value, Decimal):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return Decimal(value)
    return None


def play_burst(port, action, keys):
    """Send ``action.size`` requests of one org at once; return their Observations."""
    barrier = threading.Barrier(action.size)
    results = [None] * action.size

    def one(sub):
        try:
            barrier.wait(timeout=10)
        except threading.BrokenBarrierError:
            pass
        results[sub] = play(port, action, sub, keys)
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(action.size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results
