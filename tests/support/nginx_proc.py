"""Run nginx in a private prefix with the shipped site file, for tests.

The site file (``deploy/nginx/kiln.conf``) is kept directly usable by an operator:
it says ``listen 80;`` / ``listen [::]:80;`` and ``server 127.0.0.1:8000;``.
:func:`render_site` rewrites exactly those lines (comment lines are left alone)
to a test port on 127.0.0.1 and a test upstream, and fails loudly if the site
file no longer has them, so a drift in the shipped file cannot go unnoticed.

Usage::

    handle = start_nginx(SITE, port, "127.0.0.1:54321", tmp_path)
    try:
        ...  # requests to handle.base_url
    finally:
        handle.stop()
"""
import grp
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

SHIPPED_LISTEN_PORT = 80
SHIPPED_UPSTREAM = "127.0.0.1:8000"

_LISTEN_V4 = re.compile(r"^(\s*)listen\s+80\s*;\s*$")
_LISTEN_V6 = re.compile(r"^(\s*)listen\s+\[::\]:80\s*;\s*$")
_UPSTREAM = re.compile(r"^(\s*)server\s+127\.0\.0\.1:8000\s*;\s*$")


class NginxError(RuntimeError):
    """nginx rejected the configuration or did not come up."""


def find_nginx():
    """Path of the nginx binary, or ``None``."""
    found = shutil.which("nginx")
    if found:
        return found
    for candidate in ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def free_port(host="127.0.0.1"):
    """A TCP port on ``host`` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def render_site(text, listen_port, upstream_addr):
    """Return the site text listening on 127.0.0.1:``listen_port``, proxying to ``upstream_addr``.

    The IPv6 listen line is dropped (tests use 127.0.0.1 only).

    :raises NginxError: the site lacks exactly one of each shipped line.
    """
    counts = {"listen": 0, "listen6": 0, "upstream": 0}
    out = []
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith("#"):
            out.append(line)
            continue
        m = _LISTEN_V4.match(line)
        if m:
            counts["listen"] += 1
            out.append(f"{m.group(1)}listen 127.0.0.1:{int(listen_port)};\n")
            continue
        m = _LISTEN_V6.match(line)
        if m:
            counts["listen6"] += 1
            out.append(f"{m.group(1)}# (test) IPv6 listener removed\n")
            continue
        m = _UPSTREAM.match(line)
        if m:
            counts["upstream"] += 1
            out.append(f"{m.group(1)}server {upstream_addr};\n")
            continue
        out.append(line)
    if counts["listen"] != 1 or counts["upstream"] != 1 or counts["listen6"] > 1:
        raise NginxError(
            f"site file should contain `listen {SHIPPED_LISTEN_PORT};` and "
            f"`server {SHIPPED_UPSTREAM};` exactly once each; found {counts}")
    return "".join(out)


def _main_conf(prefix, site_path):
    user_line = ""
    if os.geteuid() == 0:
        # A root master would run its worker as `nobody`, which cannot enter the
        # (private) test directory; keep the worker as the invoking user.
        user_line = (f"user {pwd.getpwuid(os.getuid()).pw_name} "
                     f"{grp.getgrgid(os.getgid()).gr_name};\n")
    tmp = prefix / "tmp"
    return f"""{user_line}daemon off;
master_process on;
worker_processes 1;
pid {prefix / 'nginx.pid'};
error_log {prefix / 'error.log'} info;

events {{
    worker_connections 256;
}}

http {{
    access_log {prefix / 'access.log'};
    client_body_temp_path {tmp / 'body'};
    proxy_temp_path {tmp / 'proxy'};
    fastcgi_temp_path {tmp / 'fastcgi'};
    uwsgi_temp_path {tmp / 'uwsgi'};
    scgi_temp_path {tmp / 'scgi'};
    default_type application/octet-stream;

    include {site_path};
}}
"""


class NginxHandle:
    """A running nginx; :meth:`stop` ends it."""

    def __init__(self, proc, prefix, port):
        self.proc = proc
        self.prefix = prefix
        self.port = port
        self.host = "127.0.0.1"
        self.base_url = f"http://127.0.0.1:{port}"
        self.conf_path = prefix / "nginx.conf"
        self.site_path = prefix / "site.conf"
        self.error_log = prefix / "error.log"

    def error_log_text(self):
        try:
            return self.error_log.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout=10.0):
        """Fast shutdown (SIGTERM); SIGKILL if nginx does not exit in ``timeout`` s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _nginx_cmd(nginx, prefix):
    # -e: the error log used before the configuration is read (nginx >= 1.19.5);
    # without it nginx may try the compiled-in system path.
    return [nginx, "-p", str(prefix), "-c", str(prefix / "nginx.conf"),
            "-e", str(prefix / "error.log")]


def write_config(site_conf_path, listen_port, upstream_addr, workdir):
    """Write ``nginx.conf`` and the rendered ``site.conf`` into ``workdir``; return the prefix."""
    prefix = Path(workdir).resolve()
    prefix.mkdir(parents=True, exist_ok=True)
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (prefix / "tmp" / sub).mkdir(parents=True, exist_ok=True)
    site_text = Path(site_conf_path).read_text()
    (prefix / "site.conf").write_text(render_site(site_text, listen_port, upstream_addr))
    (prefix / "nginx.conf").write_text(_main_conf(prefix, prefix / "site.conf"))
    return prefix


def check_config(site_conf_path, listen_port, upstream_addr, workdir, nginx=None):
    """Run ``nginx -t`` on the rendered site; return the CompletedProcess (does not raise)."""
    nginx = nginx or find_nginx()
    if nginx is None:
        raise NginxError("nginx binary not found")
    prefix = write_config(site_conf_path, listen_port, upstream_addr, workdir)
    return subprocess.run(_nginx_cmd(nginx, prefix) + ["-t"], check=False,
                          capture_output=True, text=True, timeout=30)


def _wait_port(proc, port, deadline, error_log):
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NginxError(f"nginx exited with {proc.returncode}:\n{error_log()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise NginxError(f"nginx did not accept connections on {port}:\n{error_log()}")


def start_nginx(site_conf_path, listen_port, upstream_addr, workdir, timeout=10.0):
    """Start nginx with the site, listening on 127.0.0.1:``listen_port``.

    :param upstream_addr: ``host:port`` substituted for the shipped upstream server.
    :param workdir: prefix for the generated config, pid, logs and temp files.
    :raises NginxError: ``nginx -t`` fails, nginx exits, or the port never opens.
    """
    nginx = find_nginx()
    if nginx is None:
        raise NginxError("nginx binary not found")
    checked = check_config(site_conf_path, listen_port, upstream_addr, workdir, nginx)
    if checked.returncode != 0:
        raise NginxError(f"nginx -t failed:\n{checked.stdout}{checked.stderr}")
    prefix = Path(workdir).resolve()
    with open(prefix / "nginx.out", "ab") as out:
        proc = subprocess.Popen(_nginx_cmd(nginx, prefix), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT)
    handle = NginxHandle(proc, prefix, listen_port)
    try:
        _wait_port(proc, listen_port, time.monotonic() + timeout, handle.error_log_text)
    except BaseException:
        handle.stop()
        raise
    return handle
