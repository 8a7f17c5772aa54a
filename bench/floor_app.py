"""The stack's floor: the least a relay on Kiln's stack costs, as a yardstick for bench/run.py.

A Flask app under gunicorn's gevent worker that parses the JSON body and sends it with one
``requests.Session`` to the upstream, then relays the answer: JSON as a whole, a stream as the
upstream's bytes arrive. No authentication, no validation, no metering: whatever Kiln adds on
top of this is Kiln's own cost (the benchmark keeps this floor as a target beside direct access and
LiteLLM). The session gets the two settings Kiln's also has (``gateway/backends/upstream.py``): no
proxy lookup from the environment, and a connection pool large enough for the benchmark's
concurrency, so that the floor is not slowed by what any relay would configure.

    FLOOR_UPSTREAM_URL=http://127.0.0.1:9000/v1 gunicorn -k gevent -w 2 \\
        --chdir bench 'floor_app:create_app()'
"""

import os

import requests
from flask import Flask, Response, request
from requests.adapters import HTTPAdapter


def create_app(upstream_url=None):
    """Return the relay app for ``upstream_url`` (default: ``FLOOR_UPSTREAM_URL``)."""
    app = Flask(__name__)
    chat_url = (upstream_url or os.environ["FLOOR_UPSTREAM_URL"]).rstrip("/") + "/chat/completions"
    session = requests.Session()
    session.trust_env = False
    session.mount("http://", HTTPAdapter(pool_maxsize=256))

    @app.post("/v1/chat/completions")
    def chat():
        """Relay one chat completion."""
        body = request.get_json()
        stream = bool(body.get("stream"))
        upstream = session.post(chat_url, json=body, stream=stream, timeout=(5, 600))
        headers = {"Content-Type": upstream.headers.get("Content-Type", "application/json")}
        if not stream:
            return Response(upstream.content, upstream.status_code, headers)

        def relay():
            try:
                yield from upstream.iter_content(chunk_size=None)
            finally:
                upstream.close()

        return Response(relay(), upstream.status_code, headers)

    @app.get("/health")
    def health():
        """Answer 200 once the worker serves."""
        return "ok"

    return app
