"""Deployment files: the nginx site (deploy/nginx/kiln.conf) in a real nginx in front of a
stub upstream, and the systemd unit (deploy/kiln-gateway.service) through systemd-analyze.
"""
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import gateway
import nginx_proc
from gateway_proc import ROOT

SITE = ROOT / "deploy" / "nginx" / "kiln.conf"
UNIT = ROOT / "deploy" / "kiln-gateway.service"
ENV_EXAMPLE = ROOT / "deploy" / "kiln.env.example"

MiB = 1024 * 1024

_skip_without_nginx = pytest.mark.skipif(nginx_proc.find_nginx() is None,
                                         reason="nginx binary not installed")


def requires_nginx(test):
    return pytest.mark.nginx(_skip_without_nginx(test))


# --------------------------------------------------------------------------- stub upstream

class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive + chunked, as gunicorn speaks to nginx

    def setup(self):
        super().setup()
        self.server.track(self.connection)

    def finish(self):
        try:
            super().finish()
        finally:
            self.server.untrack(self.connection)

    def log_message(self, fmt, *args):  # keep test output quiet
        pass

    def _send(self, status, body, content_type="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _seen_headers(self):
        return {name: self.headers.get(name) for name in
                ("Host", "X-Forwarded-For", "X-Real-IP", "X-Forwarded-Proto", "Connection")}

    def do_GET(self):
        if self.path == "/healthz":
            self._send(200, {"status": "ok"})
        elif self.path.startswith("/metrics"):
            self._send(200, b"kiln_up 1\n", "text/plain; version=0.0.4")
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [], "seen": self._seen_headers()})
        else:
            self._send(404, {"error": {"message": "not found", "type": "invalid_request_error",
                                       "param": None, "code": "not_found"}})

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        if self.path != "/v1/chat/completions":
            self._send(404, {"error": {"message": "not found"}})
            return
        self.server.bodies.append(len(body))
        # SSE stream: first event, then hold until the client says it saw it (or give up),
        # then the rest. If nginx held the first event back, the client could not see it
        # before this handler finished, and `released_by_client` ends up False.
        # Framing: chunked, as gunicorn streams over HTTP/1.1; or, on request,
        # delimited by connection close, the framing where nginx's proxy buffering
        # (if it were on) visibly delays data.
        chunked = self.headers.get("X-Test-Framing", "chunked") == "chunked"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self._write(b'data: {"n": 1}\n\n', chunked)
        released = self.server.first_seen.wait(self.server.hold_s)
        self.server.released_by_client = released
        self._write(b": keepalive\n\n", chunked)
        time.sleep(0.05)
        self._write(b'data: {"n": 2}\n\n', chunked)
        self._write(b"data: [DONE]\n\n", chunked)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _write(self, data, chunked):
        if chunked:
            data = b"%x\r\n%s\r\n" % (len(data), data)
        self.wfile.write(data)
        self.wfile.flush()


class StubUpstream(ThreadingHTTPServer):
    """Threaded HTTP/1.1 server on 127.0.0.1 standing in for gunicorn."""

    daemon_threads = True
    hold_s = 10.0

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self._conns = set()
        self._lock = threading.Lock()
        self.bodies = []
        self.first_seen = threading.Event()
        self.released_by_client = None
        self._thread = threading.Thread(target=self.serve_forever, args=(0.05,),
                                        name="stub-upstream", daemon=True)

    @property
    def addr(self):
        host, port = self.server_address[:2]
        return f"{host}:{port}"

    def track(self, conn):
        with self._lock:
            self._conns.add(conn)

    def untrack(self, conn):
        with self._lock:
            self._conns.discard(conn)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        """Stop listening and cut the keep-alive connections nginx holds open."""
        if self._thread.is_alive():
            self.shutdown()
            self._thread.join(5)
        self.server_close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.first_seen.set()  # release a handler still holding a stream


# --------------------------------------------------------------------------- helpers

def _conn(nginx, timeout=15, source=None):
    return http.client.HTTPConnection(nginx.host, nginx.port, timeout=timeout,
                                      source_address=(source, 0) if source else None)


def _request(nginx, method, path, body=None, headers=None, source=None):
    """Send one request; return (status, headers dict (lower-case names), body bytes)."""
    conn = _conn(nginx, source=source)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()


def _assert_envelope(headers, body, code):
    assert headers.get("content-type", "").split(";")[0].strip() == "application/json", headers
    doc = json.loads(body)
    assert set(doc) == {"error"}, doc
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] is None
    assert err["code"] == code
    return err


def _loopback_alias_usable(addr="127.0.0.2"):
    try:
        with socket.socket() as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------- fixtures

@pytest.fixture
def upstream():
    server = StubUpstream().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nginx(upstream, tmp_path):
    handle = nginx_proc.start_nginx(SITE, nginx_proc.free_port(), upstream.addr,
                                    tmp_path / "nginx")
    try:
        yield handle
    finally:
        handle.stop()


# --------------------------------------------------------------------------- nginx: config

def test_render_site_substitutes_exactly_the_shipped_lines():
    text = SITE.read_text()
    rendered = nginx_proc.render_site(text, 18080, "127.0.0.1:18001")
    live = [ln.strip() for ln in rendered.splitlines() if not ln.lstrip().startswith("#")]
    assert "listen 127.0.0.1:18080;" in live
    assert "server 127.0.0.1:18001;" in live
    assert not any(re.match(r"listen\s+(\[::\]:)?80\s*;", ln) for ln in live)
    assert "server 127.0.0.1:8000;" not in live
    with pytest.raises(nginx_proc.NginxError):
        nginx_proc.render_site(text.replace("server 127.0.0.1:8000;", "server 10.0.0.1:9;"),
                               18080, "127.0.0.1:18001")


def test_site_settings_that_matter():
    live = "\n".join(ln.split("#", 1)[0] for ln in SITE.read_text().splitlines())
    for directive in ("proxy_http_version 1.1;", 'proxy_set_header Connection "";',
                      "client_max_body_size 16m;", "proxy_cache off;", "keepalive 64;",
                      "upstream kiln_gateway {", "proxy_set_header X-Forwarded-Proto $scheme;",
                      "proxy_set_header X-Real-IP $remote_addr;"):
        assert directive in live, directive
    chat = re.search(r"location = /v1/chat/completions \{(.*?)\n    \}", live, re.DOTALL).group(1)
    assert "proxy_buffering off;" in chat
    assert "proxy_request_buffering off;" in chat
    read_s = int(re.search(r"proxy_read_timeout (\d+)s;", chat).group(1))
    assert read_s > 3 * 10      # three SSE keepalive intervals (KILN_KEEPALIVE_S=10)
    assert read_s > 300         # above the gateway's own upstream read timeout


@requires_nginx
def test_nginx_accepts_the_site(tmp_path):
    result = nginx_proc.check_config(SITE, nginx_proc.free_port(), "127.0.0.1:9",
                                     tmp_path / "nginx")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "syntax is ok" in out and "test is successful" in out
    assert "[warn]" not in out and "[emerg]" not in out, out


# --------------------------------------------------------------------------- nginx: behaviour

@requires_nginx
def test_healthz_proxied_with_client_identity_headers(nginx):
    status, _, body = _request(nginx, "GET", "/healthz")
    assert status == 200 and json.loads(body) == {"status": "ok"}

    # A planted X-Forwarded-For is replaced by the real peer address, never passed on.
    status, _, body = _request(nginx, "GET", "/v1/models",
                               headers={"X-Forwarded-For": "203.0.113.7",
                                        "X-Real-IP": "203.0.113.7"})
    assert status == 200
    seen = json.loads(body)["seen"]
    assert seen["X-Forwarded-For"] == "127.0.0.1"
    assert seen["X-Real-IP"] == "127.0.0.1"
    assert seen["X-Forwarded-Proto"] == "http"
    assert seen["Host"] == "127.0.0.1"  # $host: the client's Host without the port
    assert seen["Connection"] in (None, "")  # upstream keep-alive: no `Connection: close`


@requires_nginx
def test_gateway_errors_pass_through_untouched(nginx):
    status, _, body = _request(nginx, "GET", "/nope")
    assert status == 404
    assert json.loads(body)["error"]["message"] == "not found"


@requires_nginx
def test_oversized_body_gets_413_json_envelope(nginx, upstream):
    body = b"x" * (17 * MiB)
    status, headers, data = _request(nginx, "POST", "/v1/chat/completions", body=body,
                                     headers={"Content-Type": "application/json"})
    assert status == 413
    _assert_envelope(headers, data, "request_too_large")
    assert upstream.bodies == []  # never reached the gateway

    # Just under the limit still goes through (and streams straight through).
    upstream.first_seen.set()
    ok_body = b"{" + b" " * (16 * MiB - 2) + b"}"
    status, headers, data = _request(nginx, "POST", "/v1/chat/completions", body=ok_body,
                                     headers={"Content-Type": "application/json"})
    assert status == 200
    assert upstream.bodies == [16 * MiB]


@requires_nginx
def test_an_oversized_header_gets_a_json_envelope_not_html(nginx, upstream):
    status, headers, data = _request(nginx, "POST", "/v1/chat/completions", body=b"{}",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": "Bearer " + "k" * 20_000})
    assert status == 400  # nginx answers header errors with 400, whatever the page says
    _assert_envelope(headers, data, "request_header_too_large")
    assert upstream.bodies == []  # never reached the gateway


@requires_nginx
def test_a_request_that_is_not_http_gets_a_json_envelope(nginx, upstream):
    with socket.create_connection(("127.0.0.1", nginx.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: kiln\r\nContent-Length: x"
                     b"\r\n\r\n")
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.split(b" ")[1] == b"400"
    headers = {k.strip().lower(): v.strip() for k, _, v in
               (line.decode().partition(":") for line in head.split(b"\r\n")[1:])}
    _assert_envelope(headers, body, "bad_request")
    assert upstream.bodies == []


@requires_nginx
def test_upstream_down_gets_502_json_envelope(nginx, upstream):
    status, _, _ = _request(nginx, "GET", "/healthz")  # leaves a keep-alive connection
    assert status == 200
    upstream.stop()
    for method, path, body in (("GET", "/healthz", None), ("GET", "/v1/models", None),
                               ("POST", "/v1/chat/completions", b"{}")):
        status, headers, data = _request(nginx, method, path, body=body,
                                         headers={"Content-Type": "application/json"})
        assert status == 502, (method, path, data)
        err = _assert_envelope(headers, data, "bad_gateway")
        assert err["type"] == "server_error"


APP = "https://chat.example.com"
ALLOW_APP = '    # "https://chat.example.com" $http_origin;\n'
ALLOW_ANY = '    # "~." "*";\n'


def _site_with(tmp_path, line):
    """The shipped site with one commented line of the CORS map switched on."""
    text = SITE.read_text()
    assert text.count(line) == 1, line
    path = tmp_path / "kiln.conf"
    path.write_text(text.replace(line, line.replace("# ", "", 1)))
    return path


def _oversized(nginx, origin):
    """A POST announcing 17 MiB (nginx answers 413 from Content-Length alone)."""
    conn = _conn(nginx)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        for name, value in (("Content-Type", "application/json"),
                            ("Content-Length", str(17 * MiB)), ("Origin", origin)):
            conn.putheader(name, value)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@requires_nginx
@pytest.mark.parametrize("line,origin,allowed", [(ALLOW_APP, APP, APP),
                                                 (ALLOW_APP, "https://other.example", None),
                                                 (ALLOW_ANY, "https://other.example", "*")])
def test_nginx_error_pages_name_an_allowed_origin(upstream, tmp_path, line, origin, allowed):
    nginx = nginx_proc.start_nginx(_site_with(tmp_path, line), nginx_proc.free_port(),
                                   upstream.addr, tmp_path / "nginx")
    try:
        status, headers, data = _oversized(nginx, origin)
        assert status == 413
        _assert_envelope(headers, data, "request_too_large")
        assert headers.get("access-control-allow-origin") == allowed
        # A response of the gateway passes with its own headers: nginx adds none to it,
        # so an allowed origin is never named twice.
        status, headers, _ = _request(nginx, "GET", "/nope", headers={"Origin": origin})
        assert status == 404 and "access-control-allow-origin" not in headers
        upstream.stop()
        status, headers, data = _request(nginx, "POST", "/v1/chat/completions", body=b"{}",
                                         headers={"Content-Type": "application/json",
                                                  "Origin": origin})
        assert status == 502
        _assert_envelope(headers, data, "bad_gateway")
        assert headers.get("access-control-allow-origin") == allowed
    finally:
        nginx.stop()


@requires_nginx
def test_nginx_error_pages_carry_no_cors_header_as_shipped(nginx):
    status, headers, _ = _oversized(nginx, APP)
    assert status == 413 and "access-control-allow-origin" not in headers


@requires_nginx
def test_metrics_allowed_from_loopback_address(nginx):
    status, _, body = _request(nginx, "GET", "/metrics")
    assert status == 200 and body == b"kiln_up 1\n"
    # Judged by the TCP peer, not by a header the client controls.
    status, _, body = _request(nginx, "GET", "/metrics",
                               headers={"X-Forwarded-For": "203.0.113.7",
                                        "X-Real-IP": "203.0.113.7"})
    assert status == 200 and body == b"kiln_up 1\n"


@requires_nginx
@pytest.mark.skipif(not _loopback_alias_usable(), reason="cannot bind a source address 127.0.0.2")
def test_metrics_denied_to_other_addresses(nginx):
    # 127.0.0.2 is loopback to the kernel but not an allowed address to nginx: it stands in
    # for a client on another host. Spoofed headers naming 127.0.0.1 must not help.
    src = "127.0.0.2"
    status, _, _ = _request(nginx, "GET", "/healthz", source=src)
    assert status == 200  # the rest of the API is open to it
    for path in ("/metrics", "/metrics/", "/metrics?name[]=kiln_up", "/%6Detrics",
                 "/v1/../metrics"):
        status, headers, body = _request(nginx, "GET", path, source=src,
                                         headers={"X-Forwarded-For": "127.0.0.1",
                                                  "X-Real-IP": "127.0.0.1"})
        assert status == 403, path
        _assert_envelope(headers, body, "forbidden")


@requires_nginx
@pytest.mark.parametrize("framing", ["chunked", "close"])
def test_stream_is_not_buffered(nginx, upstream, framing):
    conn = _conn(nginx)
    try:
        conn.request("POST", "/v1/chat/completions", body=b'{"stream": true}',
                      headers={"Content-Type": "application/json", "X-Test-Framing": framing})
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.getheader("Content-Type").startswith("text/event-stream")
        first = b""
        deadline = time.monotonic() + upstream.hold_s / 2
        while b"\n\n" not in first and time.monotonic() < deadline:
            piece = resp.read1(65536)
            if not piece:
                break
            first += piece
        # The upstream is still holding the rest of the stream at this point.
        assert first == b'data: {"n": 1}\n\n'
        upstream.first_seen.set()
        rest = resp.read()
    finally:
        conn.close()
    assert upstream.released_by_client is True
    assert rest == b': keepalive\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'


# --------------------------------------------------------------------------- systemd

def _systemd_analyze():
    return shutil.which("systemd-analyze") or next(
        (p for p in ("/usr/bin/systemd-analyze", "/bin/systemd-analyze")
         if Path(p).is_file()), None)


def _verifiable_copy(tmp_path):
    """The unit with its /opt/kiln commands pointed at an existing binary and the
    EnvironmentFile made optional: the only things missing on a build machine."""
    text = UNIT.read_text()
    text, n_exec = re.subn(r"^(Exec\w*=[-@:+!]*)/opt/kiln/venv/bin/\S+.*$", r"\1/bin/true",
                           text, flags=re.MULTILINE)
    text, n_env = re.subn(r"^EnvironmentFile=(?!-)", "EnvironmentFile=-", text, flags=re.MULTILINE)
    assert n_exec == 3 and n_env == 1, (n_exec, n_env)
    copy = tmp_path / UNIT.name
    copy.write_text(text)
    return copy


def test_unit_settings_that_matter():
    settings = {}
    for line in UNIT.read_text().splitlines():
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())

    def one(key):
        assert len(settings.get(key, [])) == 1, key
        return settings[key][0]

    assert one("User") == one("Group") == "kiln"
    assert one("EnvironmentFile") == "/etc/kiln/kiln.env"
    assert one("WorkingDirectory") == "/opt/kiln"
    assert one("ExecStartPre") == "/opt/kiln/venv/bin/kiln db upgrade"
    assert one("ExecStart") == ("/opt/kiln/venv/bin/gunicorn -c /opt/kiln/deploy/gunicorn.conf.py "
                                "gateway.wsgi:app")
    # The catalog is checked before the HUP: a bad one fails the reload, nothing is loaded.
    assert settings["ExecReload"] == ["/opt/kiln/venv/bin/kiln catalog check",
                                      "/bin/kill -HUP $MAINPID"]
    assert one("KillMode") == "mixed"
    assert int(one("TimeoutStopSec")) > 120
    assert one("Type") == "notify"
    assert one("LimitNOFILE") == "65536"
    assert "kiln/metrics" in one("RuntimeDirectory").split()
    assert "PROMETHEUS_MULTIPROC_DIR=/run/kiln/metrics" in settings["Environment"]
    assert set(one("RestrictAddressFamilies").split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "PrivateDevices",
                "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
                "ProtectControlGroups", "RestrictNamespaces", "LockPersonality"):
        assert one(key) == "yes", key
    assert one("ProtectSystem") == "strict"


def test_the_reload_refuses_a_bad_catalog(tmp_path):
    """The unit's first ExecReload= line, run as systemd runs it (KILN_MODELS from the
    environment file): 0 for a valid catalog, so the HUP follows; 1 for a bad one, so it
    does not."""
    reloads = [line.partition("=")[2].split() for line in UNIT.read_text().splitlines()
               if line.startswith("ExecReload=")]
    check = reloads[0]
    command = [str(Path(sys.executable).with_name(Path(check[0]).name)), *check[1:]]
    bad = tmp_path / "bad.toml"
    bad.write_text('[[models]]\nid = "m"\nrouting = "fastest"\n')
    for catalog, status, said in (
            (Path(gateway.__file__).with_name("demo_models.toml"), 0, ""),
            (bad, 1, "Error: catalog entry 'm'"),
            (tmp_path / "missing.toml", 1, "missing.toml: [Errno 2]")):
        result = subprocess.run(command, env={**os.environ, "KILN_MODELS": str(catalog)},
                                capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == status, (catalog, result.stdout, result.stderr)
        assert said in result.stderr and "Traceback" not in result.stderr
    assert reloads[1] == ["/bin/kill", "-HUP", "$MAINPID"]


def test_gunicorn_sends_sd_notify_ready():
    # Type=notify is only right if the installed gunicorn's arbiter reports READY=1.
    import gunicorn.arbiter
    source = Path(gunicorn.arbiter.__file__).read_text()
    assert re.search(r"sd_notify\(\s*[\"']READY=1", source)


def test_systemd_analyze_verify(tmp_path):
    analyze = _systemd_analyze()
    if analyze is None:
        pytest.skip("systemd-analyze not installed")
    copy = _verifiable_copy(tmp_path)
    result = subprocess.run([analyze, "verify", "--man=no", str(copy)],
                            check=False, capture_output=True, text=True,
                            timeout=60)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    # Unknown keys and unparsable values are only warnings (exit code stays 0): any line
    # about this unit is a failure.
    about_unit = [ln for ln in out.splitlines() if UNIT.name in ln or str(copy) in ln]
    assert about_unit == [], out
    assert not re.search(r"unknown|ignoring|failed to parse", out, re.IGNORECASE), out


def test_systemd_analyze_verify_catches_a_bad_key(tmp_path):
    # The check above would be worthless if typos passed silently.
    analyze = _systemd_analyze()
    if analyze is None:
        pytest.skip("systemd-analyze not installed")
    copy = _verifiable_copy(tmp_path)
    copy.write_text(copy.read_text().replace("LockPersonality=yes", "LockPersonalty=yes"))
    result = subprocess.run([analyze, "verify", "--man=no", str(copy)],
                            check=False, capture_output=True, text=True,
                            timeout=60)
    assert "LockPersonalty" in result.stdout + result.stderr
