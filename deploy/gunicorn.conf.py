"""gunicorn settings for Kiln: gevent workers, long streams, graceful restarts.

Every value can be overridden with a KILN_* variable (see deploy/kiln.env.example) or on the
gunicorn command line. Nothing here imports the app: with gevent workers the app must be
imported after the worker has patched the standard library, so preload_app stays off.
"""
import os
import shutil
import tempfile

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
keepalive = 75  # idle client keep-alive seconds (above nginx's upstream keepalive_timeout 60s)
# Recycle workers now and then (memory hygiene); jitter keeps them from restarting together.
max_requests = int(os.environ.get("KILN_MAX_REQUESTS", "50000"))
max_requests_jitter = max_requests // 10
preload_app = False
accesslog = None  # the app logs one JSON line per generation; no duplicate access log
errorlog = "-"
loglevel = os.environ.get("KILN_LOG_LEVEL", "info")
forwarded_allow_ips = os.environ.get("KILN_TRUSTED_PROXIES", "127.0.0.1,::1")
proc_name = "kiln-gateway"
logconfig_dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(message)s"},
                   "generic": {"format": "%(asctime)s [%(process)d] [%(levelname)s] %(message)s"}},
    "handlers": {"requests": {"class": "logging.StreamHandler", "formatter": "plain",
                              "stream": "ext://sys.stdout"},
                 "console": {"class": "logging.StreamHandler", "formatter": "generic",
                             "stream": "ext://sys.stderr"}},
    "loggers": {"kiln.requests": {"handlers": ["requests"], "level": "INFO", "propagate": False},
                "gunicorn.error": {"handlers": ["console"], "level": "INFO", "propagate": False}},
    "root": {"handlers": ["console"], "level": "INFO"},
}

# Prometheus multiprocess mode: every worker writes its samples here; /metrics merges them.
_metrics_dir = os.environ.setdefault(
    "PROMETHEUS_MULTIPROC_DIR", os.path.join(tempfile.gettempdir(), f"kiln-metrics-{os.getpid()}"))


def on_starting(server):
    """Start from an empty metrics directory (stale files would add old counts)."""
    shutil.rmtree(_metrics_dir, ignore_errors=True)
    os.makedirs(_metrics_dir, exist_ok=True)


def child_exit(server, worker):
    """Drop a dead worker's live gauges (in-flight) from the merged metrics."""
    from prometheus_client import multiprocess
    multiprocess.mark_process_dead(worker.pid)
