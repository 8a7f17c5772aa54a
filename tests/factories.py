"""Shared test data: messages, request bodies, prices, catalog entries, orgs and in-process apps.

Expected costs here are literal arithmetic on the catalog's prices, not Kiln's pricing
functions, so that a test of Kiln's money is not checked against Kiln's own math.
"""
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from pathlib import Path

import sqlalchemy as sa

from gateway.contract.catalog import Backend, ModelEntry, Pricing
from gateway_proc import make_org, migrate

MESSAGES = [{"role": "user", "content": "Say hello"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                         "parameters": {"type": "object", "properties": {}}}}
DROP = object()  # marks a key to leave out of a body (chat_body)
# fake-model in tests/conftest.py's catalog, and smollm2-135m in gateway/demo_models.toml:
# 0.10, 0.05 and 0.30 USD per million tokens are 100, 50 and 300 nano-dollars per token.
FAKE_MODEL_NANOS = SMOLLM2_NANOS = {"input": 100, "cached_input": 50, "output": 300}
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


def concurrently(n, fn, timeout_s=120):
    """Run ``fn(i)`` for i in range(n) in n threads released together; return the results."""
    barrier = threading.Barrier(n)

    def run(i):
        barrier.wait(timeout=timeout_s)
        return fn(i)
    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(run, range(n), timeout=timeout_s))
