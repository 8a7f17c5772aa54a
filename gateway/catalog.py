"""Model catalog: the TOML file named by ``KILN_MODELS``, and ``GET /v1/models``.

Each entry gives a public model id, limits, input modalities, capabilities, prices (USD per
million tokens, kept as exact decimals) and backends (base URL + upstream model name + weight).
"""
import random
import time
import tomllib
from dataclasses import dataclass, field
from decimal import Decimal
from functools import cached_property

from flask import Blueprint, current_app, jsonify

from .auth import require_key
from .billing import NANOS_PER_USD
from .errors import ServiceUnavailable
from .families import FAMILIES
from .images import DEFAULT_SOURCES, SOURCES
from .parameters import PARAMETERS

bp = Blueprint("models", __name__)


class Health:
    """A backend's health as this process sees it: one that refused a connection is left out
    of rotation for a cooldown, then tried again; any answer puts it back at once."""

    def __init__(self):
        self.down_until = 0.0  # time.monotonic() seconds

    def is_up(self, now):
        return now >= self.down_until

    def mark_down(self, cooldown_s):
        self.down_until = time.monotonic() + cooldown_s

    def mark_up(self):
        self.down_until = 0.0


@dataclass(frozen=True)
class Backend:
    """One model server: ``url`` is its OpenAI base URL (ending in ``/v1``); weight 0 drains it."""

    url: str
    model: str
    weight: int = 1
    tokenize_url: str = None  # llama.cpp: ``POST {base}/extras/tokenize/count`` for exact counts
    server: str = "generic"   # the backend family (gateway.families): what it reads
    health: Health = field(default_factory=Health, repr=False, compare=False)


@dataclass(frozen=True)
class Pricing:
    """USD per million tokens, exact decimals with at most 9 places (nano-dollars per million
    tokens), so that a price is an integer in :attr:`nanos` and a cost is integer arithmetic."""

    input: Decimal
    cached_input: Decimal
    output: Decimal

    @cached_property
    def nanos(self):
        """``(input, cached_input, output)`` in integer nano-dollars per million tokens."""
        return tuple(int(p * NANOS_PER_USD) for p in (self.input, self.cached_input, self.output))


@dataclass(frozen=True)
class ModelEntry:
    id: str
    context_window: int
    max_output_tokens: int
    pricing: Pricing
    backends: tuple
    input: tuple = ("text",)
    family: str = ""
    parallel_tool_calls: bool = False
    forced_tool_choice: bool = False
    response_format: bool = False
    stop: bool = True
    # Non-OpenAI parameters forwarded as given (``top_k``, ``repetition_penalty``, ...).
    extra_params: tuple = ()
    image_sources: tuple = DEFAULT_SOURCES  # gateway.images
    created: int = 0
    owned_by: str = "kiln"
    _weights: tuple = field(default=(), repr=False)

    def pick_backend(self):
        """Return a backend chosen by weight among those in rotation.

        :raises ServiceUnavailable: no backend available: every one is drained (weight 0) or
            refused its last connection within the cooldown (503, endpoint reference "Errors").
        """
        now = time.monotonic()
        live = [b for b in self.backends if b.weight > 0 and b.health.is_up(now)]
        if not live:
            raise ServiceUnavailable(f"No backend is available for model '{self.id}'. Retry "
                                     f"with exponential backoff.", code="no_backend_available")
        if len(live) == 1:
            return live[0]
        return random.choices(live, weights=[b.weight for b in live])[0]

    def public(self):
        """Return the public description served by ``GET /v1/models``."""
        return {
            "id": self.id, "object": "model", "created": self.created, "owned_by": self.owned_by,
            "context_window": self.context_window, "max_output_tokens": self.max_output_tokens,
            "input_modalities": list(self.input),
            "capabilities": {"parallel_tool_calls": self.parallel_tool_calls,
                             "forced_tool_choice": self.forced_tool_choice,
                             "response_format": self.response_format, "stop": self.stop},
            "pricing": {"input": str(self.pricing.input),
                        "cached_input": str(self.pricing.cached_input),
                        "output": str(self.pricing.output), "unit": "USD per 1M tokens"},
        }


class CatalogError(ValueError):
    """The catalog file is missing, malformed or inconsistent."""


def load_catalog(path):
    """Read the catalog at ``path`` into ``{model id: ModelEntry}``.

    :raises CatalogError: unreadable file, missing field, bad price or no backend.
    """
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise CatalogError(f"catalog {path}: {err}") from err
    models = {}
    for raw in data.get("models", []):
        entry = _entry(raw)
        if entry.id in models:
            raise CatalogError(f"catalog {path}: duplicate model id {entry.id!r}")
        models[entry.id] = entry
    return models


def _entry(raw):
    try:
        backends = tuple(Backend(**b) for b in raw["backends"])
        prices = raw["pricing"]
        pricing = Pricing(*(Decimal(str(prices[k])) for k in ("input", "cached_input", "output")))
        extra = {k: raw[k] for k in ("family", "parallel_tool_calls", "forced_tool_choice",
                                     "response_format", "stop", "created", "owned_by") if k in raw}
        extra.update({k: tuple(raw[k]) for k in ("extra_params", "image_sources") if k in raw})
        entry = ModelEntry(id=raw["id"], context_window=int(raw["context_window"]),
                           max_output_tokens=int(raw["max_output_tokens"]), pricing=pricing,
                           backends=backends, input=tuple(raw.get("input", ["text"])),
                           _weights=tuple(b.weight for b in backends), **extra)
    except (KeyError, TypeError, ArithmeticError) as err:
        raise CatalogError(f"catalog entry {raw.get('id', '?')!r}: bad or missing {err}") from err
    if not backends:
        raise CatalogError(f"catalog entry {entry.id!r}: no backends")
    for backend in backends:
        if backend.server not in FAMILIES:
            raise CatalogError(f"catalog entry {entry.id!r}: server {backend.server!r} is not "
                               f"one of {', '.join(FAMILIES)}")
    if set(entry.extra_params) & set(PARAMETERS):
        raise CatalogError(f"catalog entry {entry.id!r}: extra_params may only name "
                           f"non-OpenAI parameters (Kiln decides the others)")
    if not set(entry.image_sources) <= set(SOURCES):
        raise CatalogError(f"catalog entry {entry.id!r}: image_sources must be among "
                           f"{', '.join(SOURCES)}")
    prices = (pricing.input, pricing.cached_input, pricing.output)
    if min(prices) < 0:
        raise CatalogError(f"catalog entry {entry.id!r}: negative price")
    if pricing.cached_input > pricing.input:  # a hold is priced with no cached tokens
        raise CatalogError(f"catalog entry {entry.id!r}: cached_input above input; a hold "
                           f"would not cover a cached prompt")
    if any((p * NANOS_PER_USD) % 1 for p in prices):
        raise CatalogError(f"catalog entry {entry.id!r}: a price has more than 9 decimal places "
                           f"(nano-dollars per million tokens)")
    return entry


def catalog():
    """Return the current app's catalog mapping."""
    return current_app.extensions["kiln.catalog"]


@bp.get("/models")
@require_key
def list_models():
    """List the public models of the catalog (OpenAI list shape)."""
    return jsonify({"object": "list", "data": [m.public() for m in catalog().values()]})
