"""Model catalog: the TOML file named by ``KILN_MODELS`` (``GET /v1/models`` shows its public
part: :mod:`gateway.api.models`).

Each entry gives a public model id, limits, input modalities, capabilities, prices (USD per
million tokens, kept as exact decimals), backends (base URL + upstream model name + weight +
optional ``max_in_flight`` and API key), and how requests reach them: ``routing`` and
``timeouts`` (docs/ROUTING.md); optionally a local ``tokenizer`` (a ``tokenizer.json`` or a GGUF
file: :mod:`.tokenizers`) with which Kiln counts the model's tokens itself (docs/METERING.md).
"""
import math
import tomllib
from dataclasses import dataclass, field, replace
from decimal import Decimal
from functools import cached_property
from pathlib import Path

from ..billing import NANOS_PER_USD
from .families import FAMILIES
from .images import DEFAULT_SOURCES, SOURCES
from .parameters import PARAMETERS
from .replies import MAX_REPLY_TOKENS
from .tokenizers import TokenizerFileError, check_file
from ..backends.routing import LOAD_BOUND, POLICIES, WEIGHTED

# The APIs a model may serve (its catalog ``endpoints``; chat alone by default). The Messages
# and Responses APIs are translated to chat, so they need "chat".
CHAT, COMPLETIONS, EMBEDDINGS = "chat", "completions", "embeddings"
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS)
# OpenAI's bounds, the catalog's defaults: inputs per embeddings request, candidates per prompt.
MAX_EMBEDDING_INPUTS = 2048
MAX_BEST_OF = 20

@dataclass(frozen=True)
class Timeouts:
    """Seconds: connecting to a backend, waiting for its first byte (its status line), and the
    longest silence after that (between stream chunks, or within a reply's body)."""

    connect_s: float
    first_byte_s: float
    idle_s: float


TIMEOUT_KEYS = ("connect_s", "first_byte_s", "idle_s")


@dataclass(frozen=True)
class Backend:
    """One model server: ``url`` is its OpenAI base URL (ending in ``/v1``); weight 0 drains it
    (no new requests; running ones finish); ``max_in_flight`` caps its concurrent requests from
    this host (0: no cap). Frozen: what a worker learns of it (breaker, load, slots) is kept
    apart, in :class:`gateway.backends.health.BackendStates`."""

    url: str
    model: str
    weight: int = 1
    # Exact counts: ``{base}/extras/tokenize/count`` (llama-cpp-python), ``{base}/tokenize``
    # (llama-server)
    tokenize_url: str = None
    server: str = "generic"   # the backend family (gateway.contract.families): what it reads
    max_in_flight: int = 0
    # Its API key, for a model server that requires one (sent as ``Authorization: Bearer``):
    # named by the environment variable or the file holding it, read once at load
    # (:func:`load_catalog`); the key itself is in no repr, comparison or hash.
    api_key_env: str = None
    api_key_file: str = None
    api_key: str = field(default=None, repr=False, compare=False)


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
    image_sources: tuple = DEFAULT_SOURCES  # gateway.contract.images
    # Hosts of image URLs the operator vouches for (no redirect off them): the only remote
    # image URLs a model on redirect-following backends is sent (docs/PARAMETERS.md).
    image_hosts: tuple = ()
    created: int = 0
    owned_by: str = "kiln"
    routing: str = WEIGHTED  # gateway.backends.routing.POLICIES
    load_bound: float = LOAD_BOUND  # prefix-affinity: × its share of in flight, then skipped
    timeouts: tuple = ()     # ((key of TIMEOUT_KEYS, seconds), ...) set in the catalog
    endpoints: tuple = (CHAT,)  # the APIs it serves (ENDPOINTS)
    max_best_of: int = MAX_BEST_OF  # completions: ``best_of`` above it is refused
    embedding_max_inputs: int = MAX_EMBEDDING_INPUTS  # embeddings: inputs per request
    embedding_max_input_tokens: int = 0  # embeddings: tokens per input (0: the context window)
    dimensions: bool = False  # embeddings: the model reads ``dimensions`` (Matryoshka)
    # Token entries one answer may carry: max_tokens × n × (1 + top_logprobs) (chat), max_tokens
    # × best_of × prompts × (1 + logprobs) (completions); above it: 400 (contract/replies.py).
    max_reply_tokens: int = MAX_REPLY_TOKENS
    # A local tokenizer (tokenizer.json or GGUF file; relative to the catalog's folder), for
    # exact counts without the backend (gateway.contract.tokenizers); None: none.
    tokenizer: str = None
    _weights: tuple = field(default=(), repr=False)

    def timeouts_for(self, config):
        """Return the model's :class:`Timeouts`: the catalog's, else the settings'."""
        given = dict(self.timeouts)
        return Timeouts(given.get("connect_s", config.upstream_connect_timeout_s),
                        given.get("first_byte_s", config.upstream_read_timeout_s),
                        given.get("idle_s", config.upstream_read_timeout_s))

    @property
    def vouched_image_hosts(self):
        """The image hosts this model's remote image URLs must name (lower case), or None
        when none of its backends follows redirects fetching them (the ``openai`` family)."""
        if not any(FAMILIES[b.server].follows_image_redirects for b in self.backends
                   if b.server in FAMILIES):
            return None
        return frozenset(h.lower().rstrip(".") for h in self.image_hosts)

    @property
    def max_input_tokens(self):
        """Tokens one embeddings input may have."""
        return self.embedding_max_input_tokens or self.context_window

    def public(self):
        """Return the public description served by ``GET /v1/models``."""
        return {
            "id": self.id, "object": "model", "created": self.created, "owned_by": self.owned_by,
            "context_window": self.context_window, "max_output_tokens": self.max_output_tokens,
            "input_modalities": list(self.input), "endpoints": list(self.endpoints),
            "capabilities": {"parallel_tool_calls": self.parallel_tool_calls,
                             "forced_tool_choice": self.forced_tool_choice,
                             "response_format": self.response_format, "stop": self.stop},
            "pricing": {"input": str(self.pricing.input),
                        "cached_input": str(self.pricing.cached_input),
                        "output": str(self.pricing.output), "unit": "USD per 1M tokens"},
        }


class CatalogError(ValueError):
    """The catalog file is missing, malformed or inconsistent."""


def load_catalog(path, environ=None):
    """Read the catalog at ``path`` into ``{model id: ModelEntry}``.

    :param environ: the environment backends' ``api_key_env`` variables are read from
        (:func:`gateway.config.environment`); their ``api_key_file`` files are read then too.
        None: no backend key is read or checked, for a caller that never calls a backend (the
        body checker's child process, the sweeper).
    :raises CatalogError: unreadable file, missing field, bad price, no backend, a backend
        key that cannot be read (a variable unset or empty, a file unreadable or empty, a key
        that is not one line of visible ASCII; the message never holds a key), or a
        ``tokenizer`` file that is missing, unreadable or not a tokenizer.
    """
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise CatalogError(f"catalog {path}: {err}") from err
    models = {}
    for raw in data.get("models", []):
        entry = _with_tokenizer(_entry(raw), Path(path).parent)
        if environ is not None:
            entry = replace(entry, backends=tuple(_with_key(entry, b, environ)
                                                  for b in entry.backends))
        if entry.id in models:
            raise CatalogError(f"catalog {path}: duplicate model id {entry.id!r}")
        models[entry.id] = entry
    return models


def _with_tokenizer(entry, folder):
    """Return ``entry`` with its ``tokenizer`` path made absolute (relative to ``folder``, the
    catalog's), once the file is found to be a readable tokenizer.json or GGUF file."""
    if entry.tokenizer is None:
        return entry
    if not isinstance(entry.tokenizer, str) or not entry.tokenizer:
        raise CatalogError(f"catalog entry {entry.id!r}: tokenizer must name a tokenizer.json "
                           f"or GGUF file")
    path = folder / Path(entry.tokenizer).expanduser()
    try:
        check_file(path)
    except TokenizerFileError as err:
        raise CatalogError(f"catalog entry {entry.id!r}: {err}") from None
    return replace(entry, tokenizer=str(path.resolve()))


def _check_image_sources(entry):
    """``image_sources`` is a list among :data:`gateway.contract.images.SOURCES`; ``private`` widens
    ``http`` or ``https``, so it needs one of them."""
    if not all(isinstance(s, str) and s in SOURCES for s in entry.image_sources):
        raise CatalogError(f"catalog entry {entry.id!r}: image_sources must be a list among "
                           f"{', '.join(SOURCES)}, not {list(entry.image_sources)}")
    if not all(isinstance(h, str) and h.strip() for h in entry.image_hosts):
        raise CatalogError(f"catalog entry {entry.id!r}: image_hosts must be a list of host "
                           f"names, not {list(entry.image_hosts)}")
    if "private" in entry.image_sources and not {"http", "https"} & set(entry.image_sources):
        raise CatalogError(f"catalog entry {entry.id!r}: image_sources \"private\" widens "
                           f"\"http\" or \"https\"; list one of them too")


def _entry(raw):
    if any(isinstance(b, dict) and "api_key" in b for b in raw.get("backends") or ()):
        raise CatalogError(f"catalog entry {raw.get('id', '?')!r}: a backend's key is not "
                           f"written in the catalog; name it with api_key_env or api_key_file")
    endpoints = _endpoints(raw)
    try:
        backends = tuple(Backend(**b) for b in raw["backends"])
        pricing = _pricing(raw["pricing"], endpoints)
        extra = {k: raw[k] for k in ("family", "parallel_tool_calls", "forced_tool_choice",
                                     "response_format", "stop", "created", "owned_by",
                                     "routing", "load_bound", "max_best_of",
                                     "embedding_max_inputs", "embedding_max_input_tokens",
                                     "dimensions", "max_reply_tokens", "tokenizer") if k in raw}
        extra.update({k: tuple(raw[k]) for k in ("extra_params", "image_sources", "image_hosts")
                      if k in raw})
        extra["endpoints"] = endpoints
        # An embeddings-only model generates nothing: its max output may be left out (0).
        max_output = raw["max_output_tokens"] if endpoints != (EMBEDDINGS,) \
            else raw.get("max_output_tokens", 0)
        entry = ModelEntry(id=raw["id"], context_window=int(raw["context_window"]),
                           max_output_tokens=int(max_output), pricing=pricing,
                           backends=backends, input=tuple(raw.get("input", ["text"])),
                           timeouts=_timeouts(raw.get("timeouts", {})),
                           _weights=tuple(b.weight for b in backends), **extra)
    except (KeyError, TypeError, ValueError, ArithmeticError) as err:
        raise CatalogError(f"catalog entry {raw.get('id', '?')!r}: bad or missing {err}") from err
    _check_fleet(entry)
    if set(entry.extra_params) & set(PARAMETERS):
        raise CatalogError(f"catalog entry {entry.id!r}: extra_params may only name "
                           f"non-OpenAI parameters (Kiln decides the others)")
    _check_image_sources(entry)
    _check_endpoint_limits(entry)
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


def _endpoints(raw):
    """The model's ``endpoints``: a non-empty list among :data:`ENDPOINTS`, no repeats."""
    endpoints = raw.get("endpoints", [CHAT])
    if (not isinstance(endpoints, list) or not endpoints or len(set(endpoints)) != len(endpoints)
            or not all(isinstance(e, str) and e in ENDPOINTS for e in endpoints)):
        raise CatalogError(f"catalog entry {raw.get('id', '?')!r}: endpoints must be a "
                           f"non-empty list among {', '.join(ENDPOINTS)}, not {endpoints!r}")
    return tuple(endpoints)


def _pricing(prices, endpoints):
    """Read the price table. A model that generates (chat, completions) needs ``input``,
    ``cached_input`` and ``output``; an embeddings-only model is priced on its input alone:
    ``cached_input`` defaults to ``input``, and an ``output`` price, never charged, must be
    absent or 0 (docs/METERING.md, "Embeddings")."""
    if not isinstance(prices, dict) or set(prices) - {"input", "cached_input", "output"}:
        raise TypeError("pricing (a table of input, cached_input, output)")
    if endpoints == (EMBEDDINGS,):
        prices = {"cached_input": prices["input"], "output": "0", **prices}
        if Decimal(str(prices["output"])) != 0:
            raise ValueError("pricing: an embeddings-only model has no output price")
    return Pricing(*(Decimal(str(prices[k])) for k in ("input", "cached_input", "output")))


def _check_endpoint_limits(entry):
    """The completions and embeddings bounds are whole numbers of at least 1 (the input token
    limit 0 means the context window), ``dimensions`` a boolean."""
    for name in ("max_best_of", "embedding_max_inputs", "embedding_max_input_tokens",
                 "max_reply_tokens"):
        value = getattr(entry, name)
        low = 0 if name == "embedding_max_input_tokens" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise CatalogError(f"catalog entry {entry.id!r}: {name} must be a whole number, "
                               f"{low} or more")
    if not isinstance(entry.dimensions, bool):
        raise CatalogError(f"catalog entry {entry.id!r}: dimensions must be true or false")


def _timeouts(raw):
    if not isinstance(raw, dict) or set(raw) - set(TIMEOUT_KEYS):
        raise TypeError(f"timeouts (a table of {', '.join(TIMEOUT_KEYS)})")
    values = tuple((k, float(raw[k])) for k in TIMEOUT_KEYS if k in raw)
    if any(not (math.isfinite(v) and v > 0) for _, v in values):
        raise TypeError("timeouts (each a number of seconds above 0)")
    return values


def _with_key(entry, backend, environ):
    """Return ``backend`` with its API key read: from the variable ``api_key_env`` names in
    ``environ``, or from the file ``api_key_file`` names (its text, surrounding whitespace such
    as a final newline left out); ``backend`` itself when it names neither."""
    where = f"catalog entry {entry.id!r}: backend {backend.url}"
    name, path = backend.api_key_env, backend.api_key_file
    if name is None and path is None:
        return backend
    if name is not None:
        key = environ.get(name) or ""
        if not key.strip():
            raise CatalogError(f"{where}: api_key_env {name} is not set, or empty")
    else:
        try:
            with open(path, "rb") as fh:
                key = fh.read(_MAX_KEY_BYTES + 1).decode("ascii")
        except (OSError, UnicodeDecodeError) as err:
            reason = err.strerror if isinstance(err, OSError) else "not ASCII text"
            raise CatalogError(f"{where}: api_key_file {path} cannot be read ({reason})") \
                from None
        if not key.strip():
            raise CatalogError(f"{where}: api_key_file {path} is empty")
    key = key.strip()
    if len(key) > _MAX_KEY_BYTES or not all("!" <= c <= "~" for c in key):
        source = f"api_key_env {name}" if name is not None else f"api_key_file {path}"
        raise CatalogError(f"{where}: the API key of {source} must be one line of visible "
                           f"ASCII characters, at most {_MAX_KEY_BYTES}")
    return replace(backend, api_key=key)


_MAX_KEY_BYTES = 4096  # a longer "key" is a wrong file


def _check_fleet(entry):
    """Check the backends and how they are reached: known family, whole non-negative weight
    and cap, a known routing policy."""
    if not entry.backends:
        raise CatalogError(f"catalog entry {entry.id!r}: no backends")
    if isinstance(entry.load_bound, bool) or not isinstance(entry.load_bound, (int, float)) \
            or not 1 <= entry.load_bound < math.inf:
        raise CatalogError(f"catalog entry {entry.id!r}: load_bound must be a number, 1 or more")
    if entry.routing not in POLICIES:
        raise CatalogError(f"catalog entry {entry.id!r}: routing {entry.routing!r} is not one "
                           f"of {', '.join(POLICIES)}")
    for backend in entry.backends:
        if backend.server not in FAMILIES:
            raise CatalogError(f"catalog entry {entry.id!r}: server {backend.server!r} is not "
                               f"one of {', '.join(FAMILIES)}")
        for name in ("weight", "max_in_flight"):
            value = getattr(backend, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CatalogError(f"catalog entry {entry.id!r}: backend {backend.url}: {name} "
                                   f"must be a whole number, 0 or more")
        _check_key_source(entry, backend)


def _check_key_source(entry, backend):
    """A backend names its key's variable or its file (non-empty text), not both."""
    where = f"catalog entry {entry.id!r}: backend {backend.url}"
    name, path = backend.api_key_env, backend.api_key_file
    if name is not None and path is not None:
        raise CatalogError(f"{where}: api_key_env and api_key_file both given; name one")
    if name is not None and (not isinstance(name, str) or not name or "=" in name):
        raise CatalogError(f"{where}: api_key_env must name an environment variable")
    if path is not None and (not isinstance(path, str) or not path):
        raise CatalogError(f"{where}: api_key_file must name a file")
