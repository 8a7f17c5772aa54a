"""``POST /v1/chat/completions``: validate, admit, relay (JSON or SSE), settle.

The endpoint reference is the contract; DESIGN.md "Request lifecycle" gives the order:
auth, validation, maintenance, admission, upstream, relay, settlement.
"""
import json
import time

import gevent
from flask import Blueprint, Response, current_app, g, request
from gevent.queue import Empty

from . import limits, ops, upstream
from .auth import require_key
from .billing import Usage, hold_for
from .errors import Forbidden, GatewayError, PayloadTooLarge, UpstreamError
from .relay import (DATA, EOF, FAILED, GENERATION_HEADER, ClientGone, Generation, StreamFailed,
                    status_for)
from .sse import (DONE, KEEPALIVE, EventSplitter, StreamRules, apply_to_completion, dumps,
                  frame)
from .validation import parse_json_body, validate_chat

bp = Blueprint("chat", __name__)

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@bp.post("/chat/completions")
@require_key
def chat_completions():
    """Create a chat completion, metered and billed; JSON or an SSE stream."""
    services = current_app.extensions["kiln"]
    chat = validate_chat(_read_body(services.config), services.catalog, request.content_length
                         or len(request.get_data(cache=True)))
    if not g.principal.may_use(chat.entry.id):
        raise Forbidden(f"This API key may not use model '{chat.entry.id}'.", param="model",
                        code="model_not_allowed")
    ops.check_maintenance()
    gen = _admit(services, chat)
    try:
        gen.watch_client(request.environ.get("gunicorn.socket"))
        return _start_stream(gen) if chat.stream else _complete(gen)
    except BaseException:
        gen.finish("error", Usage(), 500, "internal error before the response began")
        raise


def _read_body(config):
    length = request.content_length
    if length is not None and length > config.max_body_bytes:
        raise PayloadTooLarge(f"Request body is larger than {config.max_body_bytes} bytes.")
    raw = request.stream.read(config.max_body_bytes + 1) if length is None else request.get_data()
    return parse_json_body(raw, request.content_type, config.max_body_bytes)


def _admit(services, chat):
    principal = g.principal
    hold = hold_for(chat.entry, chat.body_bytes, chat.n_messages,
                    (chat.max_tokens or chat.entry.max_output_tokens) * chat.n, chat.has_images)
    t0 = time.monotonic()
    gid = limits.admit(services.engine, services.catalog, principal, chat.entry.id,
                       chat.stream, hold, services.config.lease_ttl_s)
    services.metrics.admission.observe(time.monotonic() - t0)
    services.metrics.in_flight.inc()
    return Generation(services, principal, chat, gid, hold)


# -- non-stream ------------------------------------------------------------------------------

def _complete(gen):
    status, http_status, error, usage = "completed", 200, None, Usage()
    try:
        resp = gen.wait_for(gen.open_upstream())
        gen.resp = resp
        obj = _parse_completion(gen.wait_for(gevent.spawn(lambda: resp.content)))
        gen.mark_first_token()
        usage = _completion_usage(gen, obj)
        apply_to_completion(obj, gen.request.stop, gen.request.single_tool_call)
        obj["usage"] = obj.get("usage") or usage.to_openai()
        return Response(dumps(obj, gen.price(usage)), content_type="application/json",
                        headers={GENERATION_HEADER: gen.gid})
    except ClientGone:
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
        """Close the relay (running its ``finally``), then settle if it never ran."""
        self._iter.close()
        if not self.gen.opened_relay:
            self.gen.finish("client_cancelled", Usage(), 499, "closed before the stream began")


def _relay(gen, opener):
    gen.opened_relay = True
    rules = StreamRules(gen.request.include_usage, gen.request.stop,
                        gen.request.single_tool_call, gen.price)
    status, http_status, error, billable = "completed", 200, None, True
    pump = None
    try:
        yield b""  # headers leave now; the keepalive clock starts
        resp = yield from _await_status(gen, opener)
        gen.resp = resp
        pump = gevent.spawn(gen.pump, resp)
        yield from _relay_events(gen, rules)
        yield from _end_stream(gen, rules)
    except (ClientGone, GeneratorExit):
        status, http_status = "client_cancelled", 499
    except StreamFailed as failure:
        status, error = failure.status, str(failure)
        yield _error_event(error, failure.status)
    except GatewayError as err:
        status, error, billable = status_for(err), err.message, False
        yield _error_event(err.message, err.code)
    finally:
        try:
            _close_upstream(gen, opener, pump)
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
    config = gen.services.config
    splitter = EventSplitter()
    renew_every_s = config.lease_ttl_s / 3
    last_sent = time.monotonic()
    next_renew = last_sent + renew_every_s
    while True:
        now = time.monotonic()
        if now >= next_renew:
            gen.renew_lease(_progress(gen, rules))
            next_renew = now + renew_every_s
        try:
            kind, data = gen.events.get(timeout=max(0.0, last_sent + config.keepalive_s - now))
        except Empty:
            yield KEEPALIVE
            last_sent = time.monotonic()
            continue
        if kind is DATA:
            out, failure = _apply_all(gen, rules, splitter.feed(data))
            if out:
                yield out
                last_sent = time.monotonic()
            if failure is not None:
                raise failure
        elif kind is EOF:
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


def _end_stream(gen, rules):
    if not rules.done and not rules.finished:
        raise StreamFailed("The model backend ended the stream before it was complete.")
    if gen.request.include_usage and rules.usage is None:
        usage = _final_usage(gen, rules)
        chunk = {"id": rules.chunk_id, "object": "chat.completion.chunk",
                 "created": rules.created, "model": rules.model, "choices": [],
                 "usage": {**usage.to_openai(), "estimated": True}}
        yield frame(dumps(chunk, gen.price(usage)))
    yield frame(DONE)


def _final_usage(gen, rules):
    if gen.final_usage is None:
        if rules.usage is not None:
            gen.final_usage = Usage.from_openai(rules.usage)
        else:
            gen.final_usage = Usage(prompt=gen.estimate_prompt(), completion=rules.deltas,
                                    estimated=True)
    return gen.final_usage


def _progress(gen, rules):
    if rules.usage is not None:
        return Usage.from_openai(rules.usage, estimated=True)
    return Usage(prompt=0, completion=rules.deltas, estimated=True)


def _close_upstream(gen, opener, pump):
    if pump is not None:
        pump.kill(block=False)
    if not opener.ready():
        opener.kill(block=False)
    if gen.resp is not None:
        upstream.shutdown(gen.resp)


def _upstream_error_message(error):
    if isinstance(error, dict) and error.get("message"):
        return f"The model backend failed mid-stream: {error['message']}"
    return "The model backend failed mid-stream."


def _error_event(message, code):
    envelope = {"error": {"message": message, "type": "upstream_error", "param": None,
                          "code": code}}
    return frame(json.dumps(envelope).encode())
