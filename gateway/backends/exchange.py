"""The backend side of one generation: the tries (:meth:`gateway.backends.fleet.Route.open`), the
call in flight, the client watch, the pump that reads a stream, and whether the backend's answer
was taken (what it produced is then billed).

The flow (:mod:`gateway.flow`) owns the money side and drives this object through its methods;
nothing here knows about money or the client's dialect. The body each backend gets is built by
the flow and handed in as ``build_body(backend) -> bytes``.
"""
import json
import logging
import time

import gevent

from . import upstream
from ..errors import UpstreamTooLarge
from .client import ClientGone, ClientWatch
from .chunked import ChunkedBody, chunked_reader
from .reader import StreamReader
from .relay import READ_SIZE, Pump, UpstreamCall, keepalives_until_answered
from .spans import NO_SPANS

log = logging.getLogger("kiln.requests")


class Exchange:
    """One generation's traffic with the backends, from the first try to the last byte.

    :param services: the app's collaborators (``session``, ``metrics``, ``live``).
    :param route: the :class:`~gateway.backends.fleet.Route` holding a backend slot.
    :param timeouts: the model's :class:`~gateway.contract.catalog.Timeouts` (seconds).
    :param build_body: ``backend -> bytes``, the JSON body that backend is sent.
    :param stream: ask for an event stream (and watch the client while it is waited for).
    :param sock: the client's socket (``environ["gunicorn.socket"]``), or None.
    :param path: the endpoint under each backend's base URL (the request's: chat completions,
        ``/completions``, ``/embeddings``).
    :param max_reply_bytes: the largest whole (non-stream) reply read for this request; None:
        ``KILN_MAX_REPLY_BYTES`` (docs/RELIABILITY.md, "Big answers").
    :param spans: the request's spans (:mod:`gateway.backends.spans`): a client span per try,
        whose context the backend is sent as ``traceparent``.
    """

    def __init__(self, services, route, timeouts, build_body, stream, sock,
                 path=upstream.CHAT_PATH, max_reply_bytes=None, spans=NO_SPANS):
        self.services, self.route, self.timeouts = services, route, timeouts
        self.path, self.spans = path, spans
        self._attempt = None  # the span of the try that answered, and its HTTP status
        self.max_reply_bytes = max_reply_bytes or services.config.max_reply_bytes
        self.oversized_bytes = None  # a reply over the bound: the bytes read of it
        self.reply_bytes = 0         # the size of the whole reply read
        self._build_body, self._stream = build_body, stream
        self._sock = sock
        self.watch = None  # the client watch, from the stream's send on (a refusal needs none)
        self.call = self.pump = None
        self._early = None  # a whole reply's tries, sent before the flow asked (start)
        self._sent_at = None
        self.accepted = False   # the backend's answer was taken: what it produced is billed
        self._keep_alive = False  # the reply was read to its end: keep the connection
        self._greenlet = gevent.getcurrent()
        services.live.add(self)

    @property
    def backend(self):
        """The backend tried last: the one that served, once one answered."""
        return self.route.backend

    @property
    def attempts(self):
        """Every backend URL tried, in order (the usage event's ``attempts``)."""
        return self.route.tried

    def start(self):
        """Send the request now, from a greenlet of its own, while the flow does something else
        (admits it: docs/METERING.md, "Early send"); :meth:`send_and_read` and :meth:`send`
        then wait for this call instead of sending one. Nothing is read for the client until
        the flow asks, and :meth:`close` stops the backend if the flow never does."""
        if self._stream:
            self.send()
        else:
            self._sent_at = time.monotonic()
            self._early = gevent.spawn(self.route.open, self._try_whole, self._first_timeouts())

    # -- a whole reply -------------------------------------------------------------------------

    def send_and_read(self, parse):
        """Send the request from this greenlet (or wait for the one :meth:`start` sent) and
        return ``parse(body)`` of the 2xx reply's whole
        body (non-stream); the answer is taken once it parses. A reply that breaks off (a reset,
        the idle timeout) is retried on another backend like a failure before its status line:
        nothing of it reached the client, and it is not billed (docs/ROUTING.md). A reply
        larger than :attr:`max_reply_bytes` is taken (the backend generated it: it is billed,
        :attr:`oversized_bytes` says how much was read) and not retried.

        :raises GatewayError: every try failed, or ``parse`` refused the reply.
        :raises UpstreamTooLarge: the reply is over the bound.
        """
        sent = self._sent_at or time.monotonic()
        try:
            raw = self._early.get() if self._early is not None \
                else self.route.open(self._try_whole, self._first_timeouts())
        except UpstreamTooLarge as err:
            self.accepted, self.oversized_bytes = True, err.bytes_read
            raise
        finally:
            self._observe_answer(sent)
        parsed = parse(raw)
        self.accepted = True
        return parsed

    def _try_whole(self, backend, timeouts_s):
        resp = self._try(backend, timeouts_s)
        upstream.set_read_timeout(resp, self.timeouts.idle_s)
        try:
            raw = upstream.read_whole(resp, self.max_reply_bytes)
        except BaseException as err:
            upstream.shutdown(resp)
            self._attempt[0].end(error=err)
            raise
        upstream.close(resp)
        self._attempt[0].end(status=resp.status_code)
        self.reply_bytes = len(raw)
        return raw

    # -- a stream ------------------------------------------------------------------------------

    def send(self):
        """Send the request from its own greenlet (unless :meth:`start` did); a client that
        leaves meanwhile aborts it."""
        if self.call is None:
            self.watch = ClientWatch(self._sock)
            self.call = UpstreamCall(self._open)
            self.watch.on_gone(self._client_gone)

    def wait(self, timeout_s):
        """Wait up to ``timeout_s`` for the backend's status line; return whether it answered.

        :raises ClientGone: the client left first.
        """
        return self.call.wait(timeout_s, self.watch.gone)

    def keepalives(self, keepalive_s, keepalive):
        """Yield ``keepalive`` (bytes) every ``keepalive_s`` until the backend answers.

        :raises ClientGone: the client left first.
        """
        return keepalives_until_answered(self.call, self.watch.gone, keepalive_s, keepalive)

    def answer(self):
        """Return the call's 2xx response (raise its error), counting the backend's latency;
        from now on each read waits up to the idle timeout."""
        try:
            resp = self.call.result()
            upstream.set_read_timeout(resp, self.timeouts.idle_s)
            return resp
        finally:
            self._observe_answer(self.call.sent_at)

    def take(self):
        """Take the stream's answer (:meth:`answer`): what the backend produces from now on is
        billed. Return what reads its body: a chunked body (the usual stream) in the relay's
        own greenlet (:class:`~gateway.backends.reader.StreamReader`), any other in the call's
        (:class:`~gateway.backends.relay.Pump`)."""
        self.accepted = True
        resp = self.call.response
        fp = chunked_reader(resp)
        if fp is not None:
            self.pump = StreamReader(self.call, ChunkedBody(resp, fp, READ_SIZE),
                                     self.timeouts.idle_s)
        else:
            self.pump = Pump(self.call, self.timeouts.idle_s)
        return self.pump

    def finish(self, keep_connection):
        """The relay is over: stop the backend now (a generation Kiln cut stops generating);
        a reply read to its end (``keep_connection``) gives its connection back to the pool."""
        self._keep_alive = keep_connection
        self._abort()

    # -- both ----------------------------------------------------------------------------------

    def _first_timeouts(self):
        return self.timeouts.connect_s, self.timeouts.first_byte_s

    def _open(self):
        return self.route.open(self._try, self._first_timeouts())

    def _try(self, backend, timeouts_s):
        attempt = self.spans.backend_try(backend)
        try:
            resp = upstream.open_chat(self.services.session, backend, self._build_body(backend),
                                      timeouts_s, self.path, attempt.headers())
            resp = upstream.event_stream(resp) if self._stream else resp
        except BaseException as err:
            attempt.end(error=err)
            raise
        self._attempt = attempt, resp.status_code
        return resp

    def _observe_answer(self, sent):
        """Count the time from sending to the backend's answer (a stream's status line, a
        whole non-stream reply, or the failure)."""
        m = self.services.metrics
        m.child(m.upstream_latency, self.route.entry.id).observe(time.monotonic() - sent)

    def _client_gone(self):
        if self.pump is not None:
            self.pump.stop(reason=ClientGone())  # the relay wakes and ends as cancelled
        self._abort()  # the model server stops generating

    def _abort(self):
        """Stop reading the backend, then close its request (the model stops generating)."""
        if self.pump is not None:
            self.pump.stop()  # first: closing a response inside another greenlet's read fails
        if self.call is not None:
            self.call.close(complete=self._keep_alive)
        if self._early is not None and not self._early.ready():
            self._early.kill()  # its try shuts its response down (_try_whole)

    def count_tokens(self, text):
        """The serving backend's tokenizer count of ``text``, or None: it has no tokenize
        endpoint, or the endpoint gave no count in time (then logged as ``tokenize_failed``
        and counted in ``kiln_tokenize_failures_total``: the bill falls back to the bound)."""
        try:
            return upstream.count_tokens(self.services.session, self.backend, text)
        except upstream.TokenizeFailed as err:
            model = self.route.entry.id
            m = self.services.metrics
            m.child(m.tokenize_failures, model, err.reason).inc()
            log.warning(json.dumps({"event": "tokenize_failed", "model": model,
                                    "backend": self.backend.url, "reason": err.reason}))
            return None

    def interrupt(self, reason):
        """End this generation early with ``reason`` (an exception; see
        :func:`gateway.ops.lifecycle.end_generations`): a relaying stream ends with an error
        event, anything else gets it raised where it waits. It is settled as any generation is."""
        if self.pump is not None:
            self.pump.stop(reason=reason)
        else:
            self._greenlet.kill(reason, block=False)

    def close(self):
        """Stop watching the client, stop the backend (unless its reply was read to its end)
        and give the backend slot back. Called once, by the flow's ``finally``."""
        self.services.live.discard(self)
        if self.watch is not None:
            self.watch.stop()
        self._abort()
        self.route.release()
        if self._attempt is not None:  # a stream's try ends with its relay
            self._attempt[0].end(status=self._attempt[1])
