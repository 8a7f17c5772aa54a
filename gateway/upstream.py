"""Calls to the model servers (backends): one reused ``requests.Session``, explicit timeouts,
and one table from upstream failures to gateway errors.
"""
import json

import requests
import urllib3
from requests.adapters import HTTPAdapter

from .errors import ServiceUnavailable, UpstreamError, UpstreamRejected, UpstreamTimeout

CHAT_PATH = "/chat/completions"
DOWN_COOLDOWN_S = 5.0  # a backend that refused a connection sits out this long (503 meanwhile)


def create_session(pool_size):
    """Return a ``requests.Session`` with a connection pool of ``pool_size`` per backend."""
    session = requests.Session()
    # Backends are named in the catalog: no proxy or netrc lookup from the environment, which
    # also spares a scan of os.environ on every request (requests' trust_env).
    session.trust_env = False
    adapter = HTTPAdapter(pool_connections=16, pool_maxsize=pool_size, max_retries=0)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    session.headers.update({"User-Agent": "kiln-gateway", "Accept-Encoding": "identity"})
    return session


def encode_body(body):
    """Serialise a request body (dict) as compact UTF-8 JSON; text UTF-8 cannot carry (a lone
    surrogate a client sent as ``\\ud800``) is forwarded intact as a JSON escape."""
    try:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return json.dumps(body, separators=(",", ":")).encode()


def open_chat(session, backend, payload, timeouts_s):
    """POST ``payload`` to ``backend``'s chat endpoint; return the response once its status is in.

    The body is not read (``stream=True``); the caller reads it, as a whole or event by event.

    :param payload: the JSON body (bytes) built for this backend (:func:`encode_body`).
    :param timeouts_s: ``(connect, read)`` seconds; read applies to every wait for bytes.
    :raises UpstreamError: unreachable, timed out, or 5xx (502, plain text).
    :raises UpstreamRejected: the backend refused the request (4xx, passed on as 400).
    :raises ServiceUnavailable: the backend is overloaded (429) (503).
    """
    try:
        resp = session.post(backend.url.rstrip("/") + CHAT_PATH, data=payload, stream=True,
                            timeout=timeouts_s, headers={"Content-Type": "application/json"})
    except requests.RequestException as err:
        if _unreachable(err):
            backend.health.mark_down(DOWN_COOLDOWN_S)
        if isinstance(err, requests.Timeout):
            raise UpstreamTimeout("The model backend did not answer in time.") from err
        raise UpstreamError("The model backend is unreachable.") from err
    backend.health.mark_up()
    if resp.status_code >= 400:
        try:
            raise error_for(resp.status_code, _read_small(resp))
        finally:
            resp.close()
    return resp


def _unreachable(err):
    """True when no connection could be made (refused, no route, connect timeout); a reset of
    an open connection is a backend error, not an absent backend."""
    reason = getattr(err.args[0], "reason", None) if err.args else None
    return isinstance(reason, urllib3.exceptions.ConnectTimeoutError)


def read_whole(resp, max_bytes):
    """Read a whole reply body, decoded (gzip, deflate), of at most ``max_bytes``.

    :raises UpstreamTimeout: no byte for the read timeout (502).
    :raises UpstreamError: the backend reset or closed the connection mid-body, or sent more
        than ``max_bytes`` (502).
    """
    try:
        data = resp.raw.read(max_bytes + 1, decode_content=True)
    except (urllib3.exceptions.ReadTimeoutError, TimeoutError) as err:
        raise UpstreamTimeout("The model backend stopped sending its reply (read "
                              "timeout).") from err
    except (urllib3.exceptions.HTTPError, OSError) as err:
        raise UpstreamError("The model backend failed while sending its reply.") from err
    if len(data) > max_bytes:
        raise UpstreamError(f"The model backend's reply is larger than {max_bytes} bytes.")
    return data


def error_for(status, body):
    """Map a backend error status and body (bytes) to a gateway error."""
    if status == 429:
        return ServiceUnavailable("The model backend is at capacity; retry with backoff.",
                                  headers={"Retry-After": "1"})
    if status in (400, 413, 422):
        return UpstreamRejected(upstream_message(body) or "The model server rejected the request.")
    return UpstreamError(f"The model backend returned an error (HTTP {status}).")


def upstream_message(body):
    """Extract a human message from a backend error body (OpenAI envelope, FastAPI, text)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:1000]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if "detail" in data:  # FastAPI (llama-cpp-python) validation errors
            return json.dumps(data["detail"])[:1000]
        if data.get("message"):
            return str(data["message"])
    return json.dumps(data)[:1000]


def _read_small(resp, limit=65536):
    try:
        return resp.raw.read(limit) or b""
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError):
        return b""


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
    except (AttributeError, OSError, RuntimeError):
        pass  # already closed, or already released to the pool: nothing left to abort
    resp.close()


def count_tokens(session, backend, text, timeout_s=2.0):
    """Return the backend's exact token count of ``text`` (llama.cpp ``/extras/tokenize/count``),
    or None when the backend has no tokenize endpoint or it fails."""
    if not backend.tokenize_url:
        return None
    try:
        resp = session.post(backend.tokenize_url, json={"input": text}, timeout=timeout_s)
        if resp.status_code == 200:
            data = resp.json()
            count = data.get("count") if isinstance(data, dict) else None
            return count if isinstance(count, int) and not isinstance(count, bool) else None
    except (requests.RequestException, ValueError):
        return None
    return None
