"""Every error envelope comes from the error classes (gateway/errors.py), rendered by the one
handler set: the view's failures, Flask's own, the database's, and the stream's last event
(README, "API"). Plain Flask app, no gateway, no database."""
import json
import re
from types import SimpleNamespace

import pytest
from flask import Flask
from sqlalchemy import exc as sa_exc

from gateway.errors import InvalidRequest, UpstreamError, register_error_handlers
from gateway.endings import Status
from gateway.dialects.chat import ChatStream
from gateway.flow.outcomes import Outcome, stream_error
from gateway_proc import ROOT

pytestmark = pytest.mark.unit

GATEWAY = ROOT / "gateway"


class Boom(Exception):
    pass


def error_event(outcome, exc):
    """The chat dialect's last event of a stream that ``exc`` ended with ``outcome``."""
    return ChatStream(SimpleNamespace(include_usage=False)).error(stream_error(outcome, exc))


RAISES = {
    "/invalid": InvalidRequest("Invalid 'x'.", param="x", code="invalid_value"),
    "/busy": sa_exc.TimeoutError("QueuePool limit reached"),
    "/down": sa_exc.OperationalError("SELECT 1", {}, Exception("connection refused")),
    "/boom": Boom("secret internals"),
    "/upstream": UpstreamError("The model backend returned an error (HTTP 500)."),
}


@pytest.fixture
def client():
    app = Flask(__name__)
    register_error_handlers(app)

    def view(path):
        def raise_it():
            raise RAISES[path]
        return raise_it
    for path in RAISES:
        app.add_url_rule(path, path, view(path))
    return app.test_client()


def envelope(message, type_, code, param=None):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@pytest.mark.parametrize("method,path,status,body,retry_after", [
    ("GET", "/invalid", 400, envelope("Invalid 'x'.", "invalid_request_error", "invalid_value",
                                      "x"), None),
    ("GET", "/busy", 503, envelope("Kiln's database connections are all busy; retry with "
                                   "backoff.", "service_unavailable", "database_busy"), "1"),
    ("GET", "/down", 503, envelope("Kiln cannot reach its database; retry with backoff.",
                                   "service_unavailable", "database_unavailable"), "5"),
    ("GET", "/boom", 500, envelope("Internal error.", "server_error", "internal_error"), None),
    ("GET", "/nowhere", 404, envelope(
        "The requested URL was not found on the server. If you entered the URL manually please "
        "check your spelling and try again.", "invalid_request_error", "not_found"), None),
    ("DELETE", "/invalid", 405, envelope("The method is not allowed for the requested URL.",
                                         "invalid_request_error", "method_not_allowed"), None),
])
def test_every_failure_leaves_in_the_envelope(client, method, path, status, body, retry_after):
    r = client.open(path, method=method)
    assert (r.status_code, r.mimetype, r.get_json()) == (status, "application/json", body)
    assert r.headers.get("Retry-After") == retry_after


def test_a_backend_failure_is_plain_text(client):
    r = client.get("/upstream")
    assert (r.status_code, r.mimetype) == (502, "text/plain")
    assert r.get_data(as_text=True) == "The model backend returned an error (HTTP 500).\n"


@pytest.mark.parametrize("outcome,expected", [
    (Outcome(Status.TIMEOUT, 200, "upstream_idle_timeout", "The backend went silent."),
     envelope("The backend went silent.", "upstream_error", "upstream_idle_timeout")),
    (Outcome(Status.UPSTREAM_ERROR, 200, "upstream_error"),
     envelope("The model backend failed mid-stream.", "upstream_error", "upstream_error")),
    (Outcome(Status.ERROR, 200, "internal_error", "secret internals"),
     envelope("The gateway failed while relaying the stream.", "server_error",
              "internal_error")),
    (Outcome(Status.ERROR, 200, None),
     envelope("The gateway failed while relaying the stream.", "server_error", None)),
])
def test_a_failed_stream_ends_with_one_error_event(outcome, expected):
    event = error_event(outcome, Boom())
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[len(b"data: "):]) == expected


def test_a_stream_kiln_ends_on_purpose_is_told_in_its_own_words():
    from gateway.errors import ShuttingDown
    exc = ShuttingDown()
    event = error_event(Outcome(Status.ERROR, 200, "server_shutting_down", exc.message), exc)
    error = json.loads(event[len(b"data: "):])["error"]
    assert error["code"] == "server_shutting_down" and error["message"] == exc.message


def test_no_module_builds_an_envelope_by_hand():
    built = re.compile(r"""\{\s*["']error["']\s*:\s*\{\s*["'](message|type|code|param)["']""")
    found = [f"{p.name}:{n}" for p in GATEWAY.rglob("*.py") if p.name != "errors.py"
             for n, line in enumerate(p.read_text().splitlines(), 1) if built.search(line)]
    assert found == []
