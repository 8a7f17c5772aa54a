"""Webhook delivery: the Standard Webhooks signature, the URL check, and each worker's
deliverer greenlet (docs/WEBHOOKS.md).

Signing follows the Standard Webhooks specification (https://www.standardwebhooks.com,
github.com/standard-webhooks/standard-webhooks, ``spec/standard-webhooks.md``): a secret is
``whsec_`` + base64 of random bytes; each message carries ``webhook-id`` (the same on every
attempt), ``webhook-timestamp`` (integer seconds since the epoch, of this attempt) and
``webhook-signature``: ``v1,`` + base64 of HMAC-SHA256 over ``{id}.{timestamp}.{body}`` keyed
with the secret's decoded bytes.

The deliverer runs in every worker of every host (Postgres only), never on a request's path:
each round it claims due events (``gateway.ledger.outbox.claim``: ``FOR UPDATE SKIP LOCKED``,
so an event is taken by one worker at a time), posts them, and records each attempt; a failure
is tried again after a backoff that doubles (``KILN_WEBHOOK_BACKOFF_S`` up to
``KILN_WEBHOOK_BACKOFF_MAX_S``), for at most ``KILN_WEBHOOK_MAX_ATTEMPTS`` attempts, then the
event is marked failed. Delivery is at least once: a worker that dies after a receiver took
an event but before recording it leaves it to be sent again, under the same ``webhook-id``.
"""
import base64
import hashlib
import hmac
import ipaddress
import logging
import secrets
import socket
import time
from urllib.parse import urlsplit

import gevent
import requests
from gevent.pool import Pool

from ..db import is_postgres
from ..ledger import outbox

log = logging.getLogger(__name__)

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32  # the specification asks for 24 to 64
USER_AGENT = "Kiln-Webhooks/1"
MAX_ERROR_CHARS = 500


def new_secret():
    """Return a new secret: ``whsec_`` + base64 of :data:`SECRET_BYTES` random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def sign(secret, msg_id, timestamp, body):
    """Return the ``webhook-signature`` header value for one message.

    :param secret: ``whsec_<base64>`` (the prefix is optional).
    :param msg_id: the ``webhook-id``.
    :param timestamp: integer seconds since the epoch (the ``webhook-timestamp``).
    :param body: the exact bytes sent.
    :raises ValueError: the secret is not base64.
    """
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX), validate=True)
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def headers(secret, msg_id, body, timestamp=None):
    """Return the headers of one attempt (``timestamp``: now, unless given)."""
    timestamp = int(time.time()) if timestamp is None else timestamp
    return {"webhook-id": msg_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(secret, msg_id, timestamp, body),
            "Content-Type": "application/json", "User-Agent": USER_AGENT}


class UnsafeURL(ValueError):
    """A webhook URL Kiln will not post to: not http(s), or a private address."""


def check_url(url, allow_private=False, resolve=socket.getaddrinfo):
    """Refuse ``url`` unless it is ``http`` or ``https`` with a host, and (unless
    ``allow_private``) every address its host resolves to is public: not loopback, private
    (RFC 1918, RFC 4193), link-local, shared (RFC 6598), multicast, reserved or unspecified.

    :raises UnsafeURL: why it is refused.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UnsafeURL(f"{url!r}: a webhook URL is http:// or https:// with a host")
    if allow_private:
        return
    try:
        infos = resolve(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80),
                        proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as err:
        raise UnsafeURL(f"{url!r}: its host does not resolve ({err})") from err
    for info in infos:
        address = ipaddress.ip_address(info[4][0].split("%")[0])
        if address.version == 6 and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if not address.is_global or address.is_multicast:
            raise UnsafeURL(f"{url!r}: {parts.hostname} is a private or loopback address "
                            f"({address}); allow it with --allow-private")


def deliver(session, row, timeout_s, allow_private=False):
    """Post one claimed event; return its outcome: ``delivered`` (a 2xx answer),
    ``status_code`` (None: no answer), ``error`` (text or None), ``duration_ms``. Redirects
    are not followed (a 3xx is a failure); a URL whose host now resolves to a private address
    fails, unless the webhook (``allow_private``) or the setting allows it."""
    started = time.monotonic()
    body = row["payload"].encode()
    status, error = None, None
    try:
        check_url(row["url"], allow_private or row["allow_private"])
        response = session.post(row["url"], data=body, timeout=timeout_s,
                                headers=headers(row["secret"], f"msg_{row['id']}", body),
                                allow_redirects=False, stream=True)
        status = response.status_code
        response.close()  # the answer's body is never read: a receiver cannot make it cost
        if not 200 <= status < 300:
            error = f"HTTP {status}"
    except (requests.RequestException, UnsafeURL, ValueError) as err:
        error = f"{type(err).__name__}: {err}"[:MAX_ERROR_CHARS]
    return {"delivered": error is None, "status_code": status, "error": error,
            "duration_ms": round((time.monotonic() - started) * 1000)}


class Deliverer:
    """One worker's webhook deliveries: :meth:`run` forever (a background greenlet).

    :param engine: the Postgres engine.
    :param config: the :class:`gateway.config.Config` (``webhook_*``).
    :param metrics: the :class:`gateway.ops.metrics.Metrics`, or None.
    """

    def __init__(self, engine, config, metrics=None):
        self.engine, self.config, self.metrics = engine, config, metrics
        self.session = requests.Session()
        self.pool = Pool(max(1, config.webhook_batch))
        self._expiring_at = 0.0

    @property
    def retry(self):
        c = self.config
        return c.webhook_max_attempts, c.webhook_backoff_s, c.webhook_backoff_max_s

    def run(self):
        """Deliver due events every ``webhook_poll_s`` seconds, forever; raise what the
        database raises (the greenlet is restarted and ``/readyz`` names it meanwhile)."""
        while True:
            if not self.round():
                gevent.sleep(self.config.webhook_poll_s)

    def round(self):
        """Claim and deliver one batch; return how many events were claimed."""
        self._scan_expiring()
        c = self.config
        # A claim outlasts the attempt: the receiver's timeout, and time to record it.
        rows, given_up = outbox.claim(self.engine, c.webhook_batch,
                                      2 * c.webhook_timeout_s + 30, c.webhook_max_attempts)
        if given_up and self.metrics is not None:
            self.metrics.webhooks_failed.labels("unknown").inc(given_up)
        attempts = [self.pool.spawn(self._attempt, row) for row in rows]
        gevent.joinall(attempts)
        for attempt in attempts:
            if attempt.exception is not None:  # recording it failed: the claim lapses, and
                raise attempt.exception        # the greenlet is restarted (and /readyz says so)
        if self.metrics is not None:
            self.metrics.webhook_outbox_depth.set(outbox.depth(self.engine))
        return len(rows)

    def _attempt(self, row):
        outcome = deliver(self.session, row, self.config.webhook_timeout_s,
                          self.config.webhook_allow_private)
        status = outbox.finish(self.engine, row, outcome, self.retry)
        if outcome["error"] is not None:
            log.warning("webhook msg_%s (%s) attempt %d to %s failed: %s", row["id"],
                        row["event_type"], row["attempts"], urlsplit(row["url"]).netloc,
                        outcome["error"])
        if self.metrics is None:
            return
        if status == "delivered":
            self.metrics.webhooks_delivered.labels(row["event_type"]).inc()
        elif status == "failed":
            self.metrics.webhooks_failed.labels(row["event_type"]).inc()
        elif outcome["error"] is not None:
            self.metrics.webhook_attempts_failed.labels(row["event_type"]).inc()

    def _scan_expiring(self):
        now = time.monotonic()
        if now < self._expiring_at:
            return
        self._expiring_at = now + self.config.webhook_expiring_scan_s
        outbox.scan_expiring(self.engine, self.config.webhook_key_expiring_s)


def start_deliverer(app):
    """Start this worker's deliverer greenlet (once; Postgres only: on SQLite there is none).
    ``app`` is what gunicorn serves: an app that is not Kiln's (a test's own WSGI app under
    the same gunicorn config) has none either."""
    services = getattr(app, "extensions", {}).get("kiln")
    if services is None or not is_postgres(services.engine):
        return
    state = app.extensions.setdefault("kiln.webhooks", {})
    if state.get("deliverer") is not None:
        return
    deliverer = state["deliverer"] = Deliverer(services.engine, services.config,
                                               services.metrics)
    services.background.spawn("webhooks", deliverer.run)
