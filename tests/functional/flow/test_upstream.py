"""What a backend's error answer becomes for the client, through gunicorn and the official SDK:
one table from the backend's status (endpoint reference, "Errors"), the backend's status named in
every message, and its words quoted only when they are a short message, never an HTML page."""
import io
import json
import zlib

import openai
import pytest

from fake_upstream import Send, Status, error_reply, json_reply
from gateway_proc import balance_nanos, settled_event

MESSAGES = [{"role": "user", "content": "Hello"}]
NGINX_413 = (b"<html>\r\n<head><title>413 Request Entity Too Large</title></head>\r\n<body>\r\n"
             b"<center><h1>413 Request Entity Too Large</h1></center>\r\n<hr><center>nginx"
             b"</center>\r\n</body>\r\n</html>\r\n")
CONTEXT = "This model's maximum context length is 8192 tokens"


def raw_reply(status, body, content_type):
    return [Status(status, {"Content-Type": content_type, "Content-Length": str(len(body))},
                   chunked=False), Send(body)]


def compressed(encoding, data):
    """``data`` in the HTTP content coding ``encoding`` (RFC 9110, 8.4.1)."""
    packer = zlib.compressobj(wbits=31 if encoding == "gzip" else 15)
    return packer.compress(data) + packer.flush()


def compressed_reply(status, body, content_type, encoding):
    """A backend error answer compressed by a proxy although Kiln asked for identity."""
    data = compressed(encoding, body)
    return [Status(status, {"Content-Type": content_type, "Content-Encoding": encoding,
                            "Content-Length": str(len(data))}, chunked=False), Send(data)]


def coded_reply(status, data, encoding):
    """``data`` sent as it is, labelled with the content coding ``encoding``."""
    return [Status(status, {"Content-Type": "application/json", "Content-Encoding": encoding,
                            "Content-Length": str(len(data))}, chunked=False), Send(data)]


def envelope(message):
    return json.dumps({"error": {"message": message, "type": "invalid_request_error"}}).encode()


def fastapi_422():
    """llama-cpp-python's validation error: FastAPI's ``detail``, echoing the request body."""
    return json_reply({"detail": [{"type": "missing", "loc": ["body", "messages", 0, "content"],
                                   "msg": "Field required",
                                   "input": {"role": "user", "secret": "x" * 3000}}]}, 422)


# (backend answer, text the client's message must hold, texts it must not hold)
REJECTED = [
    pytest.param(raw_reply(413, NGINX_413, "text/html"), "HTTP 413",
                 ["<", "nginx", "center"], id="nginx-413-page"),
    pytest.param(raw_reply(400, b"<!DOCTYPE html><html><body>Bad</body></html>", "text/html"),
                 "HTTP 400", ["<", "DOCTYPE"], id="html-400"),
    pytest.param(error_reply(400, CONTEXT), f"HTTP 400 Bad Request): {CONTEXT}", [],
                 id="openai-envelope"),
    pytest.param(error_reply(400, "plain words from the backend", plain=True),
                 "HTTP 400 Bad Request): plain words from the backend", [], id="plain-text"),
    pytest.param(fastapi_422(),
                 "HTTP 422 Unprocessable Entity): body.messages.0.content: Field required",
                 ["xxxx", "secret"], id="fastapi-422"),
    pytest.param(error_reply(400, "y" * 5000), "HTTP 400 Bad Request).", ["yyyy"],
                 id="long-message"),
    pytest.param(raw_reply(400, b"z" * 200_000, "text/plain"), "HTTP 400 Bad Request).",
                 ["zzzz"], id="huge-body"),
    pytest.param(raw_reply(413, b"", "text/plain"), "HTTP 413", [], id="empty-body"),
    pytest.param(raw_reply(400, b"\xff\xfe\x00 not text", "application/octet-stream"),
                 "HTTP 400 Bad Request).", ["\x00", "\ufffd", "not text"], id="binary-body"),
    pytest.param(compressed_reply(400, envelope(CONTEXT), "application/json", "gzip"),
                 f"HTTP 400 Bad Request): {CONTEXT}", ["\ufffd"], id="gzip-envelope"),
    pytest.param(compressed_reply(400, envelope(CONTEXT), "application/json", "deflate"),
                 f"HTTP 400 Bad Request): {CONTEXT}", ["\ufffd"], id="deflate-envelope"),
    pytest.param(compressed_reply(413, NGINX_413, "text/html", "gzip"),
                 "HTTP 413 Request Entity Too Large).", ["<", "nginx", "center", "\ufffd"],
                 id="gzip-nginx-413-page"),
    pytest.param(compressed_reply(413, NGINX_413, "text/html", "deflate"),
                 "HTTP 413 Request Entity Too Large).", ["<", "nginx", "center", "\ufffd"],
                 id="deflate-nginx-413-page"),
    pytest.param(compressed_reply(400, b"z" * 5_000_000, "text/plain", "gzip"),
                 "HTTP 400 Bad Request).", ["zzzz"], id="gzip-huge-body"),
    pytest.param(coded_reply(400, b"\x1f\x8bthis is not gzip data", "gzip"),
                 "HTTP 400 Bad Request).", ["gzip data", "\ufffd"], id="corrupt-gzip"),
    pytest.param(coded_reply(400, b"\x1f\x9dnot quoted as it is", "compress"),
                 "HTTP 400 Bad Request).", ["quoted", "\ufffd"], id="unknown-coding"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("script,holds,lacks", REJECTED)
def test_backend_rejections_are_400_with_a_message_fit_to_quote(client, fake, org, engine,
                                                                 script, holds, lacks, stream):
    fake.enqueue(script)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=stream)
    body = err.value.body
    assert body["type"] == "invalid_request_error" and body["code"] == "upstream_rejected"
    assert "The model server rejected the request (" in body["message"]
    assert holds in body["message"]
    assert not any(bad in body["message"] for bad in lacks), body["message"]
    assert len(body["message"]) < 700
    assert balance_nanos(engine, org.id) == (10 * 10**9, 0, 0)


def test_a_backend_message_with_control_characters_is_quoted_clean_and_settled(client, fake,
                                                                               org, engine):
    # Postgres refuses NUL in text: the usage event's error must still be written.
    fake.enqueue(raw_reply(400, json.dumps({"error": {"message": "bad\u0000 value\n\there"}})
                           .encode(), "application/json"))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.with_raw_response.create(model="fake-model", messages=MESSAGES)
    assert err.value.body["message"].endswith("(HTTP 400 Bad Request): bad value here")
    gid = err.value.response.headers["X-Neocloud-Generation-Id"]
    event = settled_event(engine, gid)
    assert event["status"] == "rejected" and event["http_status"] == 400
    assert "bad value here" in event["error"]


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_a_compressed_backend_message_is_stored_decoded(client, fake, org, engine, encoding):
    fake.enqueue(compressed_reply(400, envelope(CONTEXT), "application/json", encoding))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.with_raw_response.create(model="fake-model", messages=MESSAGES)
    gid = err.value.response.headers["X-Neocloud-Generation-Id"]
    event = settled_event(engine, gid)
    assert event["status"] == "rejected" and event["http_status"] == 400
    assert event["error"].endswith(f"(HTTP 400 Bad Request): {CONTEXT}")


# (backend answer, status the client gets, text its body must hold)
FAILED = [
    pytest.param(raw_reply(500, b"<html><body><h1>500 Internal Server Error</h1></body></html>",
                           "text/html"), 502, "HTTP 500 Internal Server Error", id="html-500"),
    pytest.param(error_reply(503, "Loading model"), 502, "HTTP 503 Service Unavailable",
                 id="503"),
    pytest.param(error_reply(401, "invalid backend token"), 502, "HTTP 401 Unauthorized",
                 id="401"),
    pytest.param(error_reply(404, "The model `upstream-fake` does not exist."), 502,
                 "HTTP 404 Not Found", id="404"),
    pytest.param(raw_reply(599, b"odd", "text/plain"), 502, "HTTP 599", id="599"),
    pytest.param(error_reply(429, "Too many requests"), 503, "HTTP 429 Too Many Requests",
                 id="429"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("script,status,holds", FAILED)
def test_other_backend_statuses_map_by_the_table(client, fake, org, engine, script, status,
                                                 holds, stream):
    fake.enqueue(script)
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="fake-model", messages=MESSAGES, stream=stream)
    resp = err.value.response
    assert resp.status_code == status
    assert holds in resp.text and "<" not in resp.text
    if status == 502:  # the endpoint reference: plain text
        assert resp.headers["content-type"].startswith("text/plain")
        for word in ("Loading model", "invalid backend token", "does not exist", "odd"):
            assert word not in resp.text
    else:
        assert resp.headers["retry-after"] == "1"
        assert err.value.body["type"] == "service_unavailable"
    assert balance_nanos(engine, org.id) == (10 * 10**9, 0, 0)


def test_shutdown_of_a_reply_holding_no_socket_still_closes_it():
    # urllib3 raises ValueError from shutdown() when the reply has no socket to shut down
    # (seen when a client leaves while its backend call is being set up).

    import requests
    import urllib3

    from gateway.backends import upstream

    raw = urllib3.HTTPResponse(body=io.BytesIO(b"data: {}\n\n"), preload_content=False)
    with pytest.raises(ValueError):
        raw.shutdown()
    resp = requests.Response()
    resp.raw = raw
    upstream.shutdown(resp)
    assert raw.closed
