"""gunicorn settings for Kiln: gevent workers, long streams, graceful restarts.

Every value can be overridden with a KILN_* variable (see deploy/kiln.env.example) or on the
gunicorn command line. Nothing here imports the app when the file is read: with gevent workers
the app must be imported after the worker has patched the standard library, so preload_app stays
off (the hooks below that import it run inside a worker, after the patching).

Logs: one JSON line per request on stdout (logger ``kiln.requests``); gunicorn's own lines and
the gateway's warnings on stderr. Under systemd both go to the journal.
"""
import logging
import os
import shutil
import tempfile

from gunicorn.glogging import Logger

bind = os.environ.get("KILN_BIND", "127.0.0.1:8000")
worker_class = "gevent"
workers = int(os.environ.get("KILN_WORKERS", os.cpu_count() or 2))
# Each open SSE stream is one greenlet and one connection: size for thousands per worker.
worker_connections = int(os.environ.get("KILN_WORKER_CONNECTIONS", "10000"))
# gevent workers heartbeat from the hub, so a long stream does not trip the worker timeout;
# it only catches a worker whose hub is blocked.
timeout = int(os.environ.get("KILN_WORKER_TIMEOUT", "60"))
# On SIGTERM/HUP, running streams get this long to finish before the worker is killed;
# systemd's TimeoutStopSec must be longer.
graceful_timeout = int(os.environ.get("KILN_GRACEFUL_TIMEOUT", "120"))
# Idle keep-alive seconds. Above nginx's upstream keepalive_timeout (4 s), so that nginx, not
# gunicorn, closes an idle connection (no POST meets a closing socket). Short, because a
# stopping worker (stop, reload, max_requests) waits for its idle connections until this expires.
# It is also the header timeout: the gevent worker reads each request's head (the first one
# included), and the unread rest of a refused body, within it, else closes the connection. The
# body itself must arrive within KILN_BODY_TIMEOUT_S (gateway/api/intake.py; 408 after it).
keepalive = 5
# Recycle workers now and then (memory hygiene); jitter keeps them from restarting together.
max_requests = int(os.environ.get("KILN_MAX_REQUESTS", "50000"))
max_requests_jitter = max_requests // 10
preload_app = False
# A backend named by its IP address is resolved in place, not in a thread of gevent's resolver
# (gateway/backends/resolver.py); any other name as gevent resolves it.
os.environ.setdefault("GEVENT_RESOLVER", "gateway.backends.resolver.Resolver")
# gunicorn 25+ opens a control socket at one shared per-user path; several instances on a host
# would take it from each other. Signals (systemd's reload/stop) are the control interface.
control_socket_disable = True
accesslog = None  # the app logs one JSON line per request (with more); no duplicate access log


class NoAccessLog(Logger):
    """gunicorn's logger without the access log. ``accesslog = None`` does not switch it off
    once ``logconfig_dict`` is set: gunicorn then builds each request's log atoms (its headers,
    times, sizes) and hands them to a logger with no handler (gunicorn/glogging.py,
    ``_compute_access_log_enabled``), 3 % of a worker's samples at 64 connections (py-spy)."""

    def access(self, resp, req, environ, request_time):
        """Log nothing: the request's line is the app's (logger ``kiln.requests``)."""


logger_class = NoAccessLog
errorlog = "-"
loglevel = os.environ.get("KILN_LOG_LEVEL", "info")
forwarded_allow_ips = os.environ.get("KILN_TRUSTED_PROXIES", "127.0.0.1,::1")
proc_name = "kiln-gateway"


def _request_lines_only(record):
    """Pass the request log's INFO lines (JSON); its warnings belong on stderr."""
    return record.levelno <= logging.INFO


logconfig_dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(message)s"},
                   "generic": {"format": "%(asctime)s [%(process)d] [%(levelname)s] %(message)s"},
                   "named": {"format": "%(asctime)s [%(process)d] [%(levelname)s] %(name)s: "
                                       "%(message)s"}},
    "filters": {"request_lines": {"()": lambda: _request_lines_only}},
    "handlers": {"requests": {"class": "logging.StreamHandler", "formatter": "plain",
                              "filters": ["request_lines"], "stream": "ext://sys.stdout"},
                 "problems": {"class": "logging.StreamHandler", "formatter": "named",
                              "level": "WARNING", "stream": "ext://sys.stderr"},
                 "console": {"class": "logging.StreamHandler", "formatter": "generic",
                             "stream": "ext://sys.stderr"},
                 "app": {"class": "logging.StreamHandler", "formatter": "named",
                         "stream": "ext://sys.stderr"}},
    # stdout carries nothing but the JSON request lines, so that it can be parsed line by line;
    # the request log is switched by KILN_LOG_REQUESTS, not by the log level.
    "loggers": {"kiln.requests": {"handlers": ["requests", "problems"], "level": "INFO",
                                  "propagate": False},
                # Applied after gunicorn's own `loglevel`, so it must repeat it.
                "gunicorn.error": {"handlers": ["console"], "level": loglevel.upper(),
                                   "propagate": False}},
    "root": {"handlers": ["app"], "level": loglevel.upper()},
}

# Prometheus multiprocess mode: every worker writes its samples here; /metrics merges them.
_metrics_dir = os.environ.setdefault(
    "PROMETHEUS_MULTIPROC_DIR", os.path.join(tempfile.gettempdir(), f"kiln-metrics-{os.getpid()}"))
# Exists from here on: `gunicorn --check-config` imports the app without running on_starting.
os.makedirs(_metrics_dir, exist_ok=True)


def on_starting(server):
    """Start from an empty metrics directory (stale files would add old counts)."""
    shutil.rmtree(_metrics_dir, ignore_errors=True)
    os.makedirs(_metrics_dir, exist_ok=True)


def child_exit(server, worker):
    """Drop a dead worker's live gauges (in-flight) from the merged metrics."""
    from prometheus_client import multiprocess
    multiprocess.mark_process_dead(worker.pid)


def post_worker_init(worker):
    """Start the worker's tracing (when on), keep expected request errors out of stderr, answer
    unparsable requests in the envelope, and end running generations before a graceful stop's
    deadline (runs in each worker, after the app loaded).

    gevent prints every exception a greenlet dies with, message and traceback, to stderr. The
    gateway's upstream greenlets end with a GatewayError (502, 400, ...) as an ordinary result
    that the view collects and answers with; printing it would flood the journal and could
    copy a backend's error text, which may quote the prompt, into it.
    """
    import gevent
    from gevent import get_hub
    from gunicorn import util

    from gateway.errors import GatewayError
    from gateway.ops.tracing import start_worker
    start_worker(worker.wsgi)  # this worker's tracer provider, after the fork (docs/TRACES.md)
    hub = get_hub()
    hub.NOT_ERROR = tuple(hub.NOT_ERROR) + (GatewayError,)
    util.write_error = _write_error_envelope
    gevent.spawn(_end_generations_before_the_kill, worker)
    # Webhooks are delivered by every worker from its start, not from its first request
    # (docs/WEBHOOKS.md).
    from gateway.ops import webhooks
    webhooks.start_deliverer(worker.wsgi)


def _write_error_envelope(sock, status_int, reason, mesg):
    """gunicorn's answer to a request it could not parse (``gunicorn.util.write_error``, which
    writes an HTML page), in the OpenAI error envelope instead, for clients that reach the
    workers without nginx (``make run``)."""
    from gunicorn import util

    from gateway.errors import ProtocolError
    util.write_nonblock(sock, ProtocolError(status_int, mesg).http_bytes(reason))


def _end_generations_before_the_kill(worker):
    """Once a graceful stop begins (TERM, a reload, max_requests), wait until just before
    graceful_timeout, then end the streams still running: told, billed and settled, where the
    master's kill at the timeout would leave them to the sweeper with the progress last recorded."""
    import gevent

    from gateway.ops.lifecycle import end_generations, shutdown_deadline_s
    while worker.alive:
        gevent.sleep(0.25)
    gevent.sleep(shutdown_deadline_s(worker.cfg.graceful_timeout))
    end_generations(worker.wsgi)


def worker_exit(server, worker):
    """Commit this worker's queued settlements before it exits (stop, reload, max_requests):
    a graceful stop loses no bill; then export its last spans. Runs in the worker, after its
    last request."""
    from gateway.ops.lifecycle import drain
    from gateway.ops.tracing import stop_worker
    drain(worker.wsgi)
    stop_worker(worker.wsgi)  # export the spans still batched
