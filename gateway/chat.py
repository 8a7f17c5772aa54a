"""``POST /v1/chat/completions``: validate, admit, relay (JSON or SSE), settle.

The endpoint reference is the contract; DESIGN.md "Request lifecycle" gives the order:
auth, validation, maintenance, admission, upstream, relay, settlement.
"""
import json
import logging
import time

import gevent
from flask import Blueprint, Response, current_app, g, request
from gevent.queue import Empty

from . import limits, ops
from .auth import require_key
from .billing import Usage, hold_for, new_generation_id
from .errors import Forbidden, GatewayError, InvalidRequest, PayloadTooLarge, UpstreamError
from .relay import (DATA, EOF, FAILED, GENERATION_HEADER, ClientGone, Generation, StreamFailed,
                    status_for)
from .sse import (DONE, KEEPALIVE, EventSplitter, StreamRules, apply_to_completion, dumps,
                  frame)
from .validation import parse_json_body, validate_chat

bp = Blueprint("chat", __name__)
log = logging.getLogger(__name__)

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@bp.post("/chat/completions")
@require_key
def chat_completions():
    """Create a chat completion, metered and billed; JSON or an SSE stream."""
    services = current_app.extensions["kiln"]
    body, body_bytes = _read_body(services.config)
    chat = validate_chat(body, services.catalog, body_bytes)
    if not g.principal.may_use(chat.entry.id):
        raise Forbidden(f"This API key may not use model '{chat.entry.id}'.", param="model",
                        code="model_not_allowed")
    ops.check_maintenance()
    chat.backend = chat.entry.pick_backend()  # 503 when none is available, before any charge
    gen = _admit(services, chat)
    try:
        gen.watch_client(request.environ.get("gunicorn.socket"))
        return _start_stream(gen) if chat.stream else _complete(gen)
    except BaseException:
        gen.close_upstream()
        gen.finish("error", Usage(), 500, "internal error before the response began")
        raise


def _read_body(config):
    length = request.content_length
    if length is not None and length > config.max_body_bytes:
        raise PayloadTooLarge(f"Request body is larger than {config.max_body_bytes} bytes.")
    raw = request.stream.read(config.max_body_bytes + 1) if length is None else request.get_data()
    if length is not None and len(raw) < length:
        # The client went away mid-body: whatever parses from the part received was not sent.
        raise InvalidRequest(f"Request body ended after {len(raw)} of the {length} bytes "
                             f"announced by Content-Length.", code="incomplete_body")
    return parse_json_body(raw, request.content_type, config.max_body_bytes), len(raw)


def _admit(services, chat):
    principal = g.principal
    hold = hold_for(chat.entry, chat.body_bytes, chat.n_messages,
                    (chat.max_tokens or chat.entry.max_output_tokens) * chat.n, chat.has_images)
    t0 = time.monotonic()
    if not services.config.metering:  # benchmarks only: no lease, no hold, no usage event
        gid = new_generation_id()
    else:
        gid = limits.admit(services.engine, services.catalog, principal, chat.entry.id,
                           chat.stream, hold, services.config.lease_ttl_s)
    services.metrics.admission.observe(time.monotonic() - t0)
    services.metrics.in_flight.inc()
    gen = Generation(services, principal, chat, gid, hold)
    gen.client_addr = request.environ.get("kiln.client_addr")
    return gen


# -- non-stream ------------------------------------------------------------------------------

def _complete(gen):
    status, http_status, error, usage = "completed", 200, None, Usage()
    try:
        gen.wait_for(gen.open_upstream(read_body=True))
        obj = _parse_completion(gen.read_body())
        gen.mark_first_token()
        usage = _completion_usage(gen, obj)
        apply_to_completion(obj, gen.request.stop, gen.request.single_tool_call)
        obj["usage"] = obj.get("usage") or usage.to_openai()
        return Response(dumps(obj, gen.price(usage)), content_type="application/json",
                        headers={GENERATION_HEADER: gen.gid})
    except ClientGone:
        gen.close_upstream()
        status, http_status = "client_cancelled", 499
        usage = Usage(prompt=gen.estimate_prompt(), estimated=True)
        return Response(status=499)
    except GatewayError as err:
        status, http_status, error = status_for(err), err.status, err.message
        err.headers[GENERATION_HEADER] = gen.gid
        raise
    finally:
        gen.finish(status, usage, http_status, error)


def _parse_completion(raw):
    try:
        obj = json.loads(raw)
    except ValueError as err:
        raise UpstreamError("The model backend sent a reply that is not JSON.") from err
    if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
        raise UpstreamError("The model backend sent a reply that is not a chat completion.")
    return obj


def _completion_usage(gen, obj):
    if isinstance(obj.get("usage"), dict):
        return Usage.from_openai(obj["usage"])
    text = "".join((c.get("message") or {}).get("content") or "" for c in obj["choices"]
                   if isinstance(c, dict))
    return Usage(prompt=gen.estimate_prompt(), completion=max(1, len(text.encode()) // 4),
                 estimated=True)


# -- stream ----------------------------------------------------------------------------------

def _start_stream(gen):
    """Wait for the upstream status line (up to one keepalive interval), then start the stream.

    An upstream error known before our headers leave is a JSON error with its own status;
    after that, a failure can only be told as an SSE error event (DESIGN.md).
    """
    opener = gen.open_upstream()
    gevent.wait([opener, gen.gone], count=1, timeout=gen.services.config.keepalive_s)
    if opener.ready() and not opener.successful() and isinstance(opener.exception, GatewayError):
        err = opener.exception
        gen.finish(status_for(err), Usage(), err.status, err.message)
        err.headers[GENERATION_HEADER] = gen.gid
        raise err
    headers = {**STREAM_HEADERS, GENERATION_HEADER: gen.gid}
    return Response(StreamBody(gen, opener), headers=headers, content_type="text/event-stream")


class StreamBody:
    """The WSGI body of a stream; ``close()`` settles even if iteration never started."""

    def __init__(self, gen, opener):
        self.gen = gen
        self._iter = _relay(gen, opener)

    def __iter__(self):
        return self._iter

    def close(self):
        """Close the relay (running its ``finally``), then settle if it never ran.

        The server calls this when the response ends, also when writing the headers failed
        before the first ``next()``: then the upstream request is still open.
        """
        try:
            self._iter.close()
        finally:
            if not self.gen.opened_relay:
                self.gen.close_upstream()
                self.gen.finish("client_cancelled", _cancelled_usage(self.gen), 499,
                                "closed before the stream began")


def _relay(gen, opener):
    """Yield the stream's bytes; settle exactly once in ``finally``, whatever ends it."""
    gen.opened_relay = True
    rules = StreamRules(gen.request.include_usage, gen.request.stop,
                        gen.request.single_tool_call, gen.price,
                        collect_text=bool(gen.backend.tokenize_url))
    # Anything not listed below (a bug, the worker killing greenlets at shutdown) is an error.
    status, http_status, error, billable = "error", 500, "the relay stopped unexpectedly", True
    try:
        yield b""  # headers leave now; the keepalive clock starts
        gen.start_pump((yield from _await_status(gen, opener)))
        yield from _relay_events(gen, rules)
        _check_complete(rules)
        status, http_status, error = "completed", 200, None
        yield _end_of_stream(gen, rules)
    except (ClientGone, GeneratorExit):
        if status != "completed":  # gone while [DONE] was written: the generation is whole
            status, http_status, error = "client_cancelled", 499, None
    except StreamFailed as failure:
        status, http_status, error = failure.status, 200, str(failure)
        yield _error_event(error, _STREAM_CODES.get(failure.status, "upstream_error"))
    except GatewayError as err:
        status, http_status, error, billable = status_for(err), 200, err.message, False
        yield _error_event(err.message, err.code, err.type)
    except Exception:  # noqa: BLE001 - the settlement guard: tell the client, settle, log
        status, http_status = "error", 500
        log.exception("stream relay failed for %s", gen.gid)
        yield _error_event("The gateway failed while relaying the stream.", "internal_error",
                           "server_error")
    finally:
        try:
            gen.close_upstream()
        finally:
            gen.finish(status, _final_usage(gen, rules) if billable else Usage(), http_status,
                       error)


def _await_status(gen, opener):
    while True:
        gevent.wait([opener, gen.gone], count=1, timeout=gen.services.config.keepalive_s)
        if gen.gone.is_set():
            raise ClientGone()
        if opener.ready():
            return opener.get()
        yield KEEPALIVE


def _relay_events(gen, rules):
    """Relay upstream events as they arrive; a keepalive after each silent interval."""
    keepalive_s = gen.services.config.keepalive_s
    renew_every_s = gen.services.config.lease_ttl_s / 3
    splitter = EventSplitter()
    now = time.monotonic()
    next_keepalive, next_renew = now + keepalive_s, now + renew_every_s
    while True:
        now = time.monotonic()
        if now >= next_renew:
            gen.renew_lease(_progress(gen, rules))
            next_renew = now + renew_every_s
        try:
            kind, data = gen.events.get(timeout=max(0.0, min(next_keepalive, next_renew) - now))
        except Empty:
            if time.monotonic() >= next_keepalive:
                yield KEEPALIVE
                next_keepalive = time.monotonic() + keepalive_s
            continue
        if kind is DATA:
            out, failure = _apply_all(gen, rules, splitter.feed(data))
            if out:
                yield out
                next_keepalive = time.monotonic() + keepalive_s
            if failure is not None:
                raise failure
        elif kind is EOF:
            rules.done = rules.done or splitter.pending == b"data: " + DONE  # no final blank line
            return
        elif kind is FAILED:
            raise data
        else:
            raise ClientGone()


def _apply_all(gen, rules, payloads):
    """Apply the rules to ``payloads``; return ``(bytes to send, StreamFailed or None)``."""
    out, failure = [], None
    for payload in payloads:
        framed = rules.apply(payload)
        if rules.error is not None:
            failure = StreamFailed(_upstream_error_message(rules.error))
            break
        if framed is not None:
            out.append(framed)
    if out and rules.deltas:
        gen.mark_first_token()
    return b"".join(out), failure


def _check_complete(rules):
    if not rules.done and not rules.finished:
        raise StreamFailed("The model backend ended the stream before it was complete.")


def _end_of_stream(gen, rules):
    """Return the last bytes of a complete stream: the usage chunk if owed, and ``[DONE]``."""
    if not (gen.request.include_usage and rules.usage is None):
        return frame(DONE)
    usage = _final_usage(gen, rules)
    chunk = {"id": rules.chunk_id, "object": "chat.completion.chunk",
             "created": rules.created, "model": rules.model, "choices": [],
             "usage": {**usage.to_openai(), "estimated": True}}
    return frame(dumps(chunk, gen.price(usage))) + frame(DONE)


def _final_usage(gen, rules):
    if gen.final_usage is None:
        if rules.usage is not None:
            gen.final_usage = Usage.from_openai(rules.usage)
        else:
            gen.final_usage = Usage(prompt=gen.estimate_prompt(),
                                    completion=gen.count_completion(rules), estimated=True)
    return gen.final_usage


def _cancelled_usage(gen):
    # The prompt went to the model server, which may have run its prefill: bill it, estimated.
    return Usage(prompt=gen.estimate_prompt(), estimated=True)


def _progress(gen, rules):
    if rules.usage is not None:
        return Usage.from_openai(rules.usage, estimated=True)
    # No call to the backend here: a llama.cpp server answers tokenize only between generations.
    return Usage(prompt=gen.estimate_prompt(exact=False), completion=rules.deltas,
                 estimated=True)


def _upstream_error_message(error):
    if isinstance(error, dict) and error.get("message"):
        return f"The model backend failed mid-stream: {error['message']}"
    return "The model backend failed mid-stream."


_STREAM_CODES = {"timeout": "upstream_timeout", "upstream_error": "upstream_error"}


def _error_event(message, code, kind="upstream_error"):
    """Return the one SSE event that ends a failed stream: the error envelope, no ``[DONE]``."""
    envelope = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return frame(json.dumps(envelope).encode())
