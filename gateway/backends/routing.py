"""Routing policies: the order in which a model's live backends are offered a request.

A policy returns the candidates ranked, best first; the caller (:mod:`gateway.backends.fleet`) takes
the first that has a free slot. What each policy is for is in docs/ROUTING.md.

- ``weighted``: a random order drawn by weight (stateless; the default).
- ``least-outstanding``: power of two choices (Mitzenmacher, "The Power of Two Choices in
  Randomized Load Balancing", 2001): two backends drawn by weight, the one with fewer
  requests in flight per unit of weight first.
- ``prefix-affinity``: rendezvous hashing (Thaler and Ravishankar, 1998) of the conversation's
  prefix, so that every turn of a conversation lands on the backend that holds its KV cache,
  with bounded loads (Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded
  Loads", 2018): a backend past ``load_bound`` (catalog; :data:`LOAD_BOUND` by default) times
  its share of the requests in flight is passed over for the next one in the conversation's
  order.
"""
import hashlib
import json
import math
import random

WEIGHTED, LEAST_OUTSTANDING, PREFIX_AFFINITY = "weighted", "least-outstanding", "prefix-affinity"
POLICIES = (WEIGHTED, LEAST_OUTSTANDING, PREFIX_AFFINITY)
# 1.5, not the 1.25 of the paper's experiments: bench/fleet.py measured 1.25 scattering the
# first turns of a burst of new conversations (89 % of turns on their first backend) where 1.5
# keeps 96-99 % with a spread of turns under 1.25 × the mean (bench/RESULTS.md, "Fleet").
LOAD_BOUND = 1.5
# ... and at least this many requests above its share: while few requests are in flight (a burst of
# new conversations) 1.25 × a small mean would scatter the first turns, whose backend is the
# one that holds the conversation's cache (the same idea as SGLang's router, whose balance
# thresholds are both relative and absolute).
LOAD_SLACK = 2
_TOP = float(2 ** 64)


def rank(policy, candidates, load, key=None, rng=random, load_bound=LOAD_BOUND):
    """Return ``candidates`` (backends with weight > 0) in the order ``policy`` offers them.

    :param load: ``backend -> requests in flight`` (this host's, as the worker knows them).
    :param key: the conversation's prefix key (:func:`prefix_key`), for ``prefix-affinity``.
    :param load_bound: for ``prefix-affinity``, the multiple of its share of the requests in
        flight above which a backend is passed over.
    """
    if len(candidates) <= 1:
        return list(candidates)
    if policy == PREFIX_AFFINITY and key is not None:
        return affinity_order(candidates, load, key, load_bound)
    if policy == WEIGHTED:
        return weighted_order(candidates, rng)
    return least_outstanding_order(candidates, load, rng)


def weighted_order(candidates, rng=random):
    """A random order in which each next backend is drawn by weight among those left
    (Efraimidis and Spirakis, "Weighted random sampling with a reservoir", 2006)."""
    return sorted(candidates, key=lambda b: -rng.random() ** (1.0 / b.weight))


def least_outstanding_order(candidates, load, rng=random):
    """Two backends drawn by weight, the less loaded first; then the rest by load (per unit of
    weight)."""
    def _load(backend):
        return load(backend) / backend.weight
    first, second = weighted_order(candidates, rng)[:2]
    pair = sorted((first, second), key=_load)
    rest = sorted((b for b in candidates if b is not first and b is not second), key=_load)
    return pair + rest


def affinity_order(candidates, load, key, load_bound=LOAD_BOUND):
    """The conversation's rendezvous order, backends over their bounded load moved last."""
    ranked = sorted(candidates, key=lambda b: -_score(key, b))
    loads = {b.url: load(b) for b in candidates}
    total = sum(loads.values()) + 1
    weights = sum(b.weight for b in candidates)
    within = [b for b in ranked if loads[b.url] + 1 <= _bound(b, total, weights, load_bound)]
    return within + [b for b in ranked if b not in within]


def _bound(backend, total, weights, load_bound):
    share = total * backend.weight / weights
    return max(math.ceil(load_bound * share), math.floor(share) + LOAD_SLACK)


def _score(key, backend):
    """Weighted rendezvous score (-w / ln h, h uniform in (0, 1) from the hash)."""
    digest = hashlib.blake2b(f"{key}\0{backend.url}".encode(), digest_size=8).digest()
    h = (int.from_bytes(digest, "big") + 0.5) / _TOP
    return -backend.weight / math.log(h)


def prefix_key(messages):
    """Return the key of a conversation: its system prompt and its first user turn (the part
    every later turn repeats, so the part a backend's prefix cache holds), or None."""
    system = next((m.get("content") for m in messages
                   if m.get("role") in ("system", "developer")), None)
    user = next((m.get("content") for m in messages if m.get("role") == "user"), None)
    if system is None and user is None:
        return None
    text = json.dumps([system, user], sort_keys=True, ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
