"""Calls to the model servers (backends): one reused ``requests.Session``, explicit timeouts,
and one table from upstream failures to gateway errors.
"""
import json
import unicodedata
from http import HTTPStatus

import orjson
import requests
import urllib3
from requests.adapters import HTTPAdapter

from ..endings import CONNECT_TIMEOUT, FIRST_BYTE_TIMEOUT, IDLE_TIMEOUT, UNREACHABLE
from ..errors import (ServiceUnavailable, UpstreamError, UpstreamRejected, UpstreamTimeout,
                      UpstreamTooLarge)

CHAT_PATH = "/chat/completions"


def create_session(pool_size):
    """Return a ``requests.Session`` with a connection pool of ``pool_size`` per backend."""
    session = requests.Session()
    # Backends are named in the catalog: no proxy or netrc lookup from the environment, which
    # also spares a scan of os.environ on every request (requests' trust_env).
    session.trust_env = False
    adapter = HTTPAdapter(pool_connections=16, pool_maxsize=pool_size, max_retries=0)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    session.headers.update({"User-Agent": "kiln-gateway", "Accept-Encoding": "identity",
                            "Content-Type": "application/json"})
    session.kiln_prepared = {}  # url -> a prepared POST to copy (post)
    return session


def auth_headers(backend):
    """The headers that carry ``backend``'s API key (catalog ``api_key_env`` or
    ``api_key_file``), for every request to it: ``Authorization: Bearer``, as OpenAI-compatible
    servers read it (vLLM's and SGLang's ``--api-key``, llama.cpp's ``--api-key``); none when
    it has no key."""
    return {"Authorization": "Bearer " + backend.api_key} if backend.api_key else {}


def post(session, url, payload, timeouts_s, api_key=None, headers=None):
    """POST ``payload`` to ``url`` through the session's adapter and return the response once
    its status line is in (the body is not read).

    The request is prepared once per URL and copied (``Session.request`` would merge settings,
    cookies, hooks and the environment again on every call); no redirects are followed. The
    backend's ``api_key`` and this request's own ``headers`` (a trace's ``traceparent``) go on
    the copy, never on the shared template.
    """
    template = session.kiln_prepared.get(url)
    if template is None:
        template = session.kiln_prepared[url] = session.prepare_request(
            requests.Request("POST", url))
    prepared = template.copy()
    prepared.body = payload
    prepared.headers["Content-Length"] = str(len(payload))
    if api_key:
        prepared.headers["Authorization"] = "Bearer " + api_key
    if headers:
        prepared.headers.update(headers)
    resp = session.get_adapter(url).send(prepared, stream=True, timeout=timeouts_s)
    # The request sent (its body, the prompt, and a headers dict) is not kept for the life of
    # the answer: a stream can stay open for minutes (bench/RESULTS.md, bursts).
    resp.request = None
    return resp


def encode_body(body):
    """Serialise a request body (dict) as compact UTF-8 JSON (its text is valid Unicode: the
    contract refuses lone surrogates, :func:`gateway.contract.json_body.parse_json_body`).
    orjson writes it; the standard library what orjson refuses, as
    :func:`gateway.backends.sse.dumps`."""
    try:
        return orjson.dumps(body)
    except TypeError:  # orjson.JSONEncodeError is one
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def open_chat(session, backend, payload, timeouts_s, path=CHAT_PATH, headers=None):
    """POST ``payload`` to ``backend``'s endpoint at ``path`` (under its base URL: chat
    completions unless told, ``/completions``, ``/embeddings``); return the response once its
    status is in. Every endpoint's failures map through the same table (README, "API").

    The body is not read (``stream=True``); the caller reads it, as a whole or event by event.

    :param payload: the JSON body (bytes) built for this backend (:func:`encode_body`).
    :param timeouts_s: ``(connect, read)`` seconds; read applies to every wait for bytes.
    :param headers: more request headers (W3C Trace Context, docs/TRACES.md), or None.
    :raises UpstreamError: unreachable (code :data:`UNREACHABLE`), timed out (connecting or
        waiting for the status line: :data:`CONNECT_TIMEOUT`, :data:`FIRST_BYTE_TIMEOUT`), or
        5xx (502, plain text).
    :raises UpstreamRejected: the backend refused the request (4xx, passed on as 400).
    :raises ServiceUnavailable: the backend is overloaded (429) (503).
    """
    try:
        resp = post(session, backend.url.rstrip("/") + path, payload, timeouts_s,
                    backend.api_key, headers)
    except requests.ConnectTimeout as err:
        raise UpstreamTimeout(f"The model backend did not accept the connection within "
                              f"{timeouts_s[0]:g} s (connect timeout).",
                              code=CONNECT_TIMEOUT) from err
    except requests.Timeout as err:
        raise UpstreamTimeout(f"The model backend sent no answer within {timeouts_s[1]:g} s "
                              f"(first byte timeout).", code=FIRST_BYTE_TIMEOUT) from err
    except requests.RequestException as err:
        if unreachable(err):
            raise UpstreamError("The model backend is unreachable.", code=UNREACHABLE) from err
        raise UpstreamError("The model backend closed the connection before answering.") \
            from err
    if resp.status_code >= 400:
        try:
            raise error_for(resp.status_code, _read_small(resp))
        finally:
            resp.close()
    return resp


def unreachable(err):
    """True when no connection could be made (refused, no route, connect timeout); a reset of
    an open connection is a backend error, not an absent backend."""
    reason = getattr(err.args[0], "reason", None) if err.args else None
    return isinstance(reason, urllib3.exceptions.ConnectTimeoutError)


def set_read_timeout(resp, timeout_s):
    """Wait up to ``timeout_s`` for each read of ``resp``'s body from now on (a stream's idle
    gap, which may differ from the time allowed for its first byte)."""
    try:
        resp.raw.connection.sock.settimeout(timeout_s)
    except AttributeError:
        pass  # no socket left: the next read fails and says so


EVENT_STREAM = "text/event-stream"


def event_stream(resp):
    """Return ``resp`` if it is an event stream; a backend that answered a stream request with
    anything else (a JSON error with status 200) failed: 502, nothing billed.

    :raises UpstreamError: not ``text/event-stream``.
    """
    kind = resp.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if kind != EVENT_STREAM:
        shutdown(resp)
        raise UpstreamError(f"The model backend answered a stream request with "
                            f"{kind or 'no content type'}, not an event stream.")
    return resp


def read_whole(resp, max_bytes):
    """Read a whole reply body, decoded (gzip, deflate), of at most ``max_bytes``.

    :raises UpstreamTimeout: no byte for the read timeout (502).
    :raises UpstreamError: the backend reset or closed the connection mid-body (502).
    :raises UpstreamTooLarge: the backend sent more than ``max_bytes`` (502): its answer, too
        large to relay, not a failure to answer (docs/RELIABILITY.md, "Big answers").
    """
    try:
        data = resp.raw.read(max_bytes + 1, decode_content=True)
    except (urllib3.exceptions.ReadTimeoutError, TimeoutError) as err:
        raise UpstreamTimeout("The model backend stopped sending its reply (idle "
                              "timeout).", code=IDLE_TIMEOUT) from err
    except (urllib3.exceptions.HTTPError, OSError) as err:
        raise UpstreamError("The model backend failed while sending its reply.") from err
    if len(data) > max_bytes:
        raise UpstreamTooLarge(f"The model backend's reply is larger than {max_bytes} bytes, "
                               f"the most Kiln relays for this request.",
                               bytes_read=len(data))
    return data


def error_for(status, body):
    """Map a backend error status and body (bytes) to a gateway error, by :data:`BACKEND_STATUS`.

    The client learns the backend's status in every case; the backend's own words only when
    they are a short message (:func:`upstream_message`), never its HTML error page.
    """
    return BACKEND_STATUS.get(status, _backend_failed)(status, body)


def _rejected(status, body):
    """The backend judged the request (context window, parameters): 400 with its message."""
    message = upstream_message(body)
    text = f"The model server rejected the request (HTTP {_status_line(status)})"
    return UpstreamRejected(f"{text}: {message}" if message else f"{text}.")


def _at_capacity(status, body):
    """The backend is full: 503 with Retry-After; the client retries, nothing was charged."""
    return ServiceUnavailable(f"The model backend is at capacity (HTTP {_status_line(status)}); "
                              f"retry with backoff.", headers={"Retry-After": "1"})


def _backend_failed(status, body):
    """Anything else (5xx, 401/403/404 of a misconfigured backend, ...): 502, plain text."""
    return UpstreamError(f"The model backend returned an error (HTTP {_status_line(status)}).")


# Backend status -> gateway error (README, "API"): 400 "the model server rejected
# the request"; 503 when it is at capacity; every other status, 502 "backend error".
BACKEND_STATUS = {400: _rejected, 413: _rejected, 422: _rejected, 429: _at_capacity}
MAX_QUOTED_CHARS = 500  # a longer backend message is not quoted: it is a page, a dump or an echo


def _status_line(status):
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return str(status)


def upstream_message(body):
    """Return the backend's message from an error body (bytes), fit to quote to the client, or
    None: an HTML page, bytes that are not UTF-8 (binary, or still compressed), an empty or
    oversized body, or a message longer than :data:`MAX_QUOTED_CHARS` is not quoted.

    Understands the OpenAI envelope (vLLM, SGLang, llama.cpp), FastAPI's ``detail``
    (llama-cpp-python's validation errors, whose ``input`` echo is left out) and plain text.
    Control characters become spaces, so the message is also storable in the usage event.
    """
    try:
        data = json.loads(body)
    except ValueError:  # includes bytes that are not UTF-8
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            return None
    else:
        text = _json_message(data)
    text = _clean(text or "")
    if not text or len(text) > MAX_QUOTED_CHARS or _looks_like_markup(text):
        return None
    return text


def _json_message(data):
    if not isinstance(data, dict):
        return data if isinstance(data, str) else None
    error = data.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    if isinstance(error, str):
        return error
    detail = data.get("detail")
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):  # FastAPI: [{"loc": [...], "msg": "...", "input": ...}]
        return "; ".join(_fastapi_item(d) for d in detail if isinstance(d, dict)) or None
    return data["message"] if isinstance(data.get("message"), str) else None


def _fastapi_item(item):
    loc = ".".join(str(p) for p in item.get("loc") or ())
    msg = str(item.get("msg", ""))
    return f"{loc}: {msg}" if loc else msg


def _clean(text):
    """Return ``text`` on one line: control characters (NUL, newlines) as spaces, lone
    surrogates as U+FFFD, runs of spaces as one."""
    chars = (" " if unicodedata.category(c) == "Cc" else
             "\ufffd" if unicodedata.category(c) == "Cs" else c for c in text)
    return " ".join("".join(chars).split())


def _looks_like_markup(text):
    lowered = text[:200].lower()
    return lowered.startswith("<") or "<html" in lowered or "<!doctype" in lowered


def _read_small(resp, limit=65536):
    """Return at most ``limit`` bytes of an error body, decoded (gzip, deflate): a proxy may
    compress it although Kiln asks for identity. The bound is on the decoded bytes (urllib3
    inflates no more than it is asked for), so a compressed bomb is not inflated whole. A body
    that cannot be read or decoded, or in a coding urllib3 does not know, is empty (unquoted).
    """
    if not _decodable(resp.headers.get("Content-Encoding", "")):
        return b""
    try:
        return resp.raw.read(limit, decode_content=True) or b""
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError):
        return b""  # urllib3's DecodeError (a corrupt compressed body) is an HTTPError


def _decodable(content_encoding):
    codings = [c.strip() for c in content_encoding.lower().split(",") if c.strip()]
    known = urllib3.HTTPResponse.CONTENT_DECODERS
    return all(c == "identity" or c in known for c in codings)


def close(resp):
    """Give the connection of a reply read to its end back to the pool (kept alive)."""
    try:
        resp.raw.release_conn()
    except (AttributeError, OSError):
        pass


def shutdown(resp):
    """Abort ``resp`` at once, also from another greenlet: the backend sees the connection close
    and stops generating."""
    try:
        resp.raw.shutdown()
    except (AttributeError, OSError, RuntimeError, ValueError):
        # Already closed or released to the pool; urllib3 raises ValueError when the
        # response holds no socket to shut down. Closing it below still drops the connection.
        pass
    resp.close()


class TokenizeFailed(Exception):
    """The backend's tokenize endpoint gave no count; ``reason`` says why in a word
    (``timeout``, ``unreachable``, ``http_<status>``, ``malformed``)."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


def count_tokens(session, backend, text, timeout_s=2.0):
    """Return the backend's exact token count of ``text``, or None when the backend has no
    tokenize endpoint (catalog ``tokenize_url``).

    The endpoint's shape follows the backend's family: llama.cpp's own server (``llama.cpp``)
    takes ``POST /tokenize`` ``{"content": text}`` and answers ``{"tokens": [id, ...]}``, with
    no BOS or other special token added (llama.cpp ``tools/server/README.md``); every other
    family is asked as llama-cpp-python's ``POST /extras/tokenize/count`` ``{"input": text}``,
    answering ``{"count": n}``.

    :raises TokenizeFailed: the endpoint did not answer with a count within ``timeout_s``.
    """
    if not backend.tokenize_url:
        return None
    server_tokenize = backend.server == "llama.cpp"
    body = {"content": text} if server_tokenize else {"input": text}
    try:
        resp = session.post(backend.tokenize_url, json=body, timeout=timeout_s,
                            headers=auth_headers(backend))
    except requests.Timeout as err:
        raise TokenizeFailed("timeout") from err
    except requests.RequestException as err:
        raise TokenizeFailed("unreachable") from err
    if resp.status_code != 200:
        raise TokenizeFailed(f"http_{resp.status_code}")
    try:
        data = resp.json()
    except ValueError as err:
        raise TokenizeFailed("malformed") from err
    count = _tokens_of(data) if server_tokenize else _count_of(data)
    if count is None:
        raise TokenizeFailed("malformed")
    return count


def _count_of(data):
    count = data.get("count") if isinstance(data, dict) else None
    valid = isinstance(count, int) and not isinstance(count, bool) and count >= 0
    return count if valid else None


def _tokens_of(data):
    tokens = data.get("tokens") if isinstance(data, dict) else None
    return len(tokens) if isinstance(tokens, list) else None
