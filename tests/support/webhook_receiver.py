"""A real HTTP webhook receiver for tests: a threaded ``http.server`` on a loopback port that
records every POST, answers with a status the test chooses, can be taken down and brought back
on the same port, and can hold each request until another one arrives (to see two senders at
once).

Signatures are checked here as the Standard Webhooks specification says a receiver does
(https://www.standardwebhooks.com, ``spec/standard-webhooks.md``, "Verifying webhook
authenticity"), written apart from the gateway's own signing code.
"""
import base64
import hashlib
import hmac
import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gateway_proc import free_port

TOLERANCE_S = 5 * 60  # the specification's suggested timestamp tolerance


@dataclass
class Delivery:
    """One POST the receiver took: path, headers (lower-cased names), raw body, HTTP status
    answered."""

    path: str
    headers: dict
    body: bytes
    status: int

    @property
    def id(self):
        return self.headers["webhook-id"]

    @property
    def event(self):
        return json.loads(self.body)


def verify(secret, delivery, now=None):
    """Return the JSON payload of ``delivery`` if its signature is valid for ``secret`` and its
    timestamp within :data:`TOLERANCE_S` of ``now``; raise AssertionError otherwise."""
    key = base64.b64decode(secret.split("_", 1)[1] if secret.startswith("whsec_") else secret)
    msg_id = delivery.headers["webhook-id"]
    timestamp = delivery.headers["webhook-timestamp"]
    assert timestamp.isdigit(), timestamp
    now = time.time() if now is None else now
    assert abs(now - int(timestamp)) <= TOLERANCE_S, (now, timestamp)
    content = msg_id.encode() + b"." + timestamp.encode() + b"." + delivery.body
    expected = base64.b64encode(hmac.new(key, content, hashlib.sha256).digest())
    # A space-separated list of versioned signatures; any v1 that matches is enough.
    offered = [s.split(",", 1) for s in delivery.headers["webhook-signature"].split(" ")]
    assert any(version == "v1" and hmac.compare_digest(sig.encode(), expected)
               for version, sig in offered), delivery.headers
    return json.loads(delivery.body)


class Receiver:
    """The receiver on ``http://127.0.0.1:<port>``; :attr:`deliveries` in arrival order.

    :param status: the HTTP status answered (a test may change it).
    :param hold_for_pair_s: hold each request until another is being received at the same
        time (or this long), until two have been; 0: answer at once.
    """

    def __init__(self, status=204, hold_for_pair_s=0.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.status = status
        self.hold_for_pair_s = hold_for_pair_s
        self.deliveries = []
        self.most_at_once = 0
        self._at_once = 0
        self._cond = threading.Condition()
        self._server = None

    def start(self):
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                receiver._received(self, body)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self):
        """Stop answering: the port refuses connections until :meth:`start`."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _received(self, handler, body):
        with self._cond:
            self._at_once += 1
            self.most_at_once = max(self.most_at_once, self._at_once)
            self._cond.notify_all()
            if self.hold_for_pair_s and self.most_at_once < 2:
                self._cond.wait_for(lambda: self.most_at_once >= 2, self.hold_for_pair_s)
            status = self.status
            self.deliveries.append(Delivery(handler.path, {k.lower(): v for k, v in
                                                           handler.headers.items()},
                                            body, status))
        handler.send_response(status)
        handler.send_header("Content-Length", "0")
        handler.end_headers()
        with self._cond:
            self._at_once -= 1

    def at(self, path):
        """The deliveries taken at ``path``."""
        with self._cond:
            return [d for d in self.deliveries if d.path == path]

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
