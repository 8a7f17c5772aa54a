"""Shared test data: messages, request bodies, prices, catalog entries, orgs and in-process apps.

Expected costs here are literal arithmetic on the catalog's prices, not Kiln's pricing
functions, so that a test of Kiln's money is not checked against Kiln's own math.
"""
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

import sqlalchemy as sa

from gateway.backends import routing
from gateway.config import Config
from gateway.contract.catalog import Backend, ModelEntry, Pricing
from gateway.backends.health import BackendStates
from gateway.ops.metrics import Metrics
from gateway_proc import make_org, migrate

# The functional layer's catalog (tests/functional/conftest.py) and the unit layer's apps: a
# template for str.format(url=<the backends' base URL>).
CATALOG = """
[[models]]
id = "fake-model"
context_window = 8192
max_output_tokens = 1024
input = ["text"]
endpoints = ["chat", "completions"]
pricing = {{ input = "0.10", cached_input = "0.05", output = "0.30" }}
backends = [{{ url = "{url}", model = "upstream-fake" }}]

[[models]]
id = "fake-vision"
context_window = 32768
max_output_tokens = 4096
input = ["text", "image"]
parallel_tool_calls = true
forced_tool_choice = true
response_format = true
image_hosts = ["1.1.1.1", "2606:4700::1111"]
pricing = {{ input = "1.25", cached_input = "0.125", output = "10" }}
backends = [{{ url = "{url}", model = "upstream-vision" }}]

[[models]]
id = "gpt-oss-fake"
family = "gpt-oss"
context_window = 131072
max_output_tokens = 32768
input = ["text"]
pricing = {{ input = "0.05", cached_input = "0.025", output = "0.25" }}
backends = [{{ url = "{url}", model = "openai/gpt-oss-120b" }}]

[[models]]
id = "fake-embed"
context_window = 512
endpoints = ["embeddings"]
embedding_max_inputs = 8
pricing = {{ input = "0.02" }}
backends = [{{ url = "{url}", model = "upstream-embed" }}]
"""

MESSAGES = [{"role": "user", "content": "Say hello"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                         "parameters": {"type": "object", "properties": {}}}}


class _Drop:
    """Marks a key to leave out of a body (:func:`chat_body`); its repr is stable, so test ids
    that show it are the same in every process (pytest-xdist's workers must agree)."""

    def __repr__(self):
        return "DROP"


DROP = _Drop()

# fake-model in CATALOG above, and smollm2-135m in gateway/demo_models.toml:
# 0.10, 0.05 and 0.30 USD per million tokens are 100, 50 and 300 nano-dollars per token.
FAKE_MODEL_NANOS = SMOLLM2_NANOS = {"input": 100, "cached_input": 50, "output": 300}
# fake-embed in CATALOG: 0.02 USD per million input tokens, 20 nano-dollars per token.
FAKE_EMBED_NANOS = {"input": 20, "cached_input": 20, "output": 0}
UNREACHABLE_BACKEND = "http://127.0.0.1:9/v1"  # the discard port: nothing answers there


def chat_body(model="fake-model", **changes):
    """A chat completions body for ``model`` with ``changes`` applied (``DROP`` removes a key)."""
    body = {"model": model, "messages": MESSAGES, **changes}
    return {k: v for k, v in body.items() if v is not DROP}


def literal_cost_nanos(price, prompt=0, completion=0, cached=0):
    """What ``prompt``/``cached``/``completion`` tokens cost at ``price`` (nano-dollars per
    token, whole numbers: no rounding), in nano-dollars."""
    return ((prompt - cached) * price["input"] + cached * price["cached_input"]
            + completion * price["output"])


def fake_model_nanos(prompt=0, completion=0, cached=0):
    """What ``prompt``/``cached``/``completion`` tokens of fake-model cost, in nano-dollars."""
    return literal_cost_nanos(FAKE_MODEL_NANOS, prompt, completion, cached)


def event_values(org_id, api_key_id, started_at, **changes):
    """The columns of one settled usage event for a direct INSERT into ``usage_events``: a
    completed, non-stream chat generation of fake-model (10 prompt tokens, 2 of them cached,
    5 completion tokens, at fake-model's prices), started and ended at ``started_at``, with
    ``changes``. The balance and the rollup are not moved: for listings, not for money."""
    values = dict(id=f"gen-{uuid.uuid4().hex[:24]}", org_id=org_id, api_key_id=api_key_id,
                  model="fake-model", endpoint="chat", stream=False, status="completed",
                  prompt_tokens=10, cached_tokens=2, completion_tokens=5,
                  cost_nanos=fake_model_nanos(10, 5, 2), http_status=200,
                  started_at=started_at, ended_at=started_at)
    return {**values, **changes}


def pricing(input="0.10", cached_input="0.05", output="0.30"):
    """A catalog price (USD per million tokens, decimal strings)."""
    return Pricing(input=Decimal(input), cached_input=Decimal(cached_input),
                   output=Decimal(output))


def model_entry(server="generic", **changes):
    """A catalog entry ``m`` (4096-token window, 1024 max output) with ``changes``."""
    base = dict(id="m", context_window=4096, max_output_tokens=1024, pricing=pricing(),
                backends=(Backend(url="http://x/v1", model="m", server=server),))
    return ModelEntry(**{**base, **changes})


def org(engine, usd="10", limit=None):
    """A fresh org with ``usd`` of credits and one key (:class:`gateway_proc.Org`)."""
    return make_org(engine, f"org-{uuid.uuid4().hex[:10]}", usd=usd, limit=limit)


def sqlite_app(directory, catalog_toml, **settings):
    """An in-process Kiln on a migrated SQLite file in ``directory``: ``(app, engine)``.

    :param catalog_toml: the catalog's text.
    :param settings: Config fields over the defaults (the sweeper is off).
    """
    from gateway import create_app
    directory = Path(directory)
    url = f"sqlite:///{directory / 'kiln.db'}"
    migrate(url)
    (directory / "models.toml").write_text(catalog_toml)
    config = {"database_url": url, "models": str(directory / "models.toml"),
              "sweep_interval_s": 0, **settings}
    return create_app(config), sa.create_engine(url)


# An in-process fleet (routing and retries without HTTP).
URLS = ("http://a:1/v1", "http://b:1/v1", "http://c:1/v1")
TIMEOUTS = (5.0, 30.0)  # a try's (connect, first byte) seconds


def backends(weights=(1, 1, 1), caps=(0, 0, 0)):
    """Catalog backends on ``URLS`` with these weights and ``max_in_flight`` caps."""
    return [Backend(url=u, model="m", weight=w, max_in_flight=c)
            for u, w, c in zip(URLS, weights, caps, strict=False)]


def services(tmp_path, **settings):
    """What a route needs of the app (config, metrics, backend states): slots under
    ``tmp_path``, no backoff."""
    config = Config.from_mapping({"slot_dir": str(tmp_path), "upstream_retry_backoff_s": 0,
                                  **settings})
    return SimpleNamespace(config=config, metrics=Metrics(), states=BackendStates())


def entry(fleet, policy="weighted"):
    """A catalog entry ``m`` on ``fleet`` routed by ``policy``."""
    return SimpleNamespace(id="m", backends=tuple(fleet), routing=policy,
                           load_bound=routing.LOAD_BOUND)


def concurrently(n, fn, timeout_s=120):
    """Run ``fn(i)`` for i in range(n) in n threads released together; return the results."""
    barrier = threading.Barrier(n)

    def run(i):
        barrier.wait(timeout=timeout_s)
        return fn(i)
    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(run, range(n), timeout=timeout_s))


# One model on a fleet of backends (the fleet tests through gunicorn, bench/fleet.py).
FLEET_CATALOG = """
[[models]]
id = "fleet-model"
context_window = 8192
max_output_tokens = 1024
routing = "{routing}"
load_bound = {load_bound}
timeouts = {{ {timeouts} }}
pricing = {{ input = "0.10", cached_input = "0.05", output = "0.30" }}
backends = [{backends}]
"""


def write_fleet_catalog(path, urls, routing="least-outstanding", timeouts="first_byte_s = 30",
                        weights=None, caps=None, load_bound=1.25):
    """Write a catalog of one model, ``fleet-model``, on the backends at ``urls`` to ``path``."""
    weights, caps = weights or [1] * len(urls), caps or [0] * len(urls)
    backends = ", ".join(f'{{ url = "{u}", model = "m", weight = {w}, max_in_flight = {c} }}'
                         for u, w, c in zip(urls, weights, caps, strict=True))
    path.write_text(FLEET_CATALOG.format(routing=routing, timeouts=timeouts, backends=backends,
                                         load_bound=load_bound))
    return path


# Vision models that differ only in image_sources (the image-source tests, both layers), on
# the openai family's backends: they fetch images outside the operator's network, so the
# sources alone decide (a self-hosted family's image_hosts: test_image_redirects.py).
IMAGE_SOURCES_MODEL = """
[[models]]
id = "{id}"
context_window = 8192
max_output_tokens = 256
input = ["text", "image"]
{sources}
pricing = {{ input = "1", cached_input = "0.5", output = "2" }}
backends = [{{ url = "{url}", model = "upstream-vision", server = "openai" }}]
"""
IMAGE_SOURCES = {"data-only": '["data"]', "https-private": '["https", "private"]',
           "data-http": '["data", "http"]', "default": None}


def image_sources_catalog(url, **sources):
    """A catalog of vision models on ``url``, one per ``name=image_sources`` (None: unset)."""
    return "".join(IMAGE_SOURCES_MODEL.format(id=model, url=url, sources=f"image_sources = {value}"
                                if value is not None else "")
                   for model, value in sources.items())
