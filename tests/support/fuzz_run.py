"""Schema fuzzing of a running Kiln: schemathesis cases from Kiln's own ``/openapi.json``.

Every operation of the document gets positive cases (valid by the schema) and negative cases
(violating it), sent with a valid key. Each case is checked for what a client and the ledger
must see whatever the input:

- ``server_error``: no 5xx (the fake upstream answers every chat completion, so none is due);
- ``schema``: the response conforms to the document (status code documented for the
  operation, content type, headers, body schema; every ``data:`` event of a stream against the
  document's event schema);
- ``charged_4xx``: a 4xx adds no usage event and leaves the balance as it was;
- ``ledger``: the balance moved by exactly the cost of the usage events the case added;
- ``in_flight`` (after the run): no lease, no hold and no pending usage event is left, and the
  balance moved by the sum of the costs of all usage events.

Most positive chat cases name a catalog model (a string drawn from the schema names none), so
that they reach admission, the backend and settlement; most positive ``GET /v1/generation``
cases ask for a generation an earlier case made.
"""
import json
import random
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

import hypothesis
import requests
import schemathesis
import sqlalchemy as sa
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS, load_all_checks
from schemathesis.core.failures import FailureGroup

# schemathesis' own checks of a response against the document (not negative_data_rejection or
# positive_data_acceptance: whether a valid-looking body is accepted depends on the model, which
# the schema states only in descriptions).
SCHEMA_CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
                 "response_headers_conformance", "response_schema_conformance")
CHAT = "POST /v1/chat/completions"
# The operations of a path item (OpenAPI 3.1); its other keys (``parameters``, ``summary``, ...)
# are shared by them.
HTTP_METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
MESSAGES = ("POST /v1/messages", "POST /v1/messages/count_tokens")
GENERATION = "GET /v1/generation"
AIMED_SHARE = 0.9
# Share of the cases for an operation (OTHER_SHARE if not named); chat completions take what
# the others leave.
SHARES = {"GET /v1/generation": 0.08, "GET /healthz": 0.01, "GET /readyz": 0.01,
          "GET /openapi.json": 0.01}
OTHER_SHARE = 0.02
STATE_SQL = sa.text(
    "SELECT b.balance_nanos, b.held_nanos, b.in_flight, "
    "(SELECT count(*) FROM usage_events u WHERE u.org_id = b.org_id), "
    "(SELECT coalesce(sum(cost_nanos), 0) FROM usage_events u WHERE u.org_id = b.org_id), "
    "(SELECT count(*) FROM usage_events u WHERE u.org_id = b.org_id AND status = 'pending'), "
    "(SELECT count(*) FROM in_flight l WHERE l.org_id = b.org_id) "
    "FROM credit_balances b WHERE b.org_id = :o")


@dataclass(frozen=True)
class Ledger:
    """An org's ledger state: balance, holds, leases and its usage events' count and costs."""

    balance_nanos: int
    held_nanos: int
    in_flight: int
    events: int
    cost_nanos: int
    pending: int
    leases: int


@dataclass
class Figures:
    """What a fuzz run did: cases by operation and mode, responses by status, violations."""

    cases: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    violations: Counter = field(default_factory=Counter)
    examples: list = field(default_factory=list)

    @property
    def total(self):
        return sum(self.cases.values())

    def violate(self, kind, label, detail):
        """Count a violation of ``kind``; keep the first few for the report."""
        self.violations[kind] += 1
        if len(self.examples) < 20:
            self.examples.append(f"[{kind}] {label}: {detail}"[:2000])


class Fuzzer:
    """Run schema cases against ``base_url`` as the org ``org_id`` (key ``key``).

    :param engine: SQLAlchemy engine on the gateway's database (to read the org's ledger).
    :param models: catalog model ids positive chat cases name.
    :param document: the OpenAPI document to fuzz from; by default the gateway's own.
    """

    def __init__(self, base_url, key, engine, org_id, models, seed=1, document=None):
        self.base_url, self.engine, self.org_id = base_url, engine, org_id
        self.headers = {"Authorization": f"Bearer {key}"}
        self.models, self.rng = list(models), random.Random(seed)
        self.seed = seed
        self.session = requests.Session()
        self.document = document or self.session.get(base_url + "/openapi.json",
                                                     timeout=30).json()
        self.schema = schemathesis.openapi.from_dict(self.document)
        load_all_checks()
        self.checks = [CHECKS.get_one(name) for name in SCHEMA_CHECKS]
        self.figures, self.generations = Figures(), []

    def ledger(self):
        """Return the org's :class:`Ledger` now."""
        with self.engine.connect() as conn:
            return Ledger(*conn.execute(STATE_SQL, {"o": self.org_id}).one())

    def settled_ledger(self, timeout_s=5.0):
        """Return the org's :class:`Ledger` once no usage event of it is pending (a settlement
        commits a few milliseconds after its answer: one of the previous case's must not move
        the balance inside the next case's window), or as it is after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        state = self.ledger()
        while state.pending and time.monotonic() < deadline:
            time.sleep(0.01)
            state = self.ledger()
        return state

    def run(self, cases):
        """Run about ``cases`` cases over every operation, half positive, half negative."""
        self.start = self.ledger()
        for label, budget in self._budgets(cases).items():
            operation = self.schema[_path(label)][_method(label)]
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                self._run_operation(label, operation, mode, max(1, budget // 2))
        self.check_quiescence()
        return self.figures

    def _budgets(self, cases):
        """Every operation of the document; chat completions first (later
        ``GET /v1/generation`` cases ask for their ids)."""
        labels = [f"{method.upper()} {path}" for path, item in self.document["paths"].items()
                  for method in item if method in HTTP_METHODS]
        others = {label: max(2, int(cases * SHARES.get(label, OTHER_SHARE)))
                  for label in labels if label != CHAT}
        return {CHAT: max(2, cases - sum(others.values())), **others}

    def _run_operation(self, label, operation, mode, examples):
        strategy = operation.as_strategy(generation_mode=mode)

        @settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=False)
        @hypothesis.seed(self.seed)
        @given(case=strategy)
        def fuzz(case):
            self.run_case(label, mode.value, case)
        try:
            fuzz()
        except Unsatisfiable:  # nothing to break: an operation without parameters or body
            pass

    def run_case(self, label, mode, case):
        """Send one case and check the response and the ledger around it."""
        self._aim(label, mode, case)
        self.figures.cases[(label, mode)] += 1
        before = self.settled_ledger()
        try:
            response = case.call(base_url=self.base_url, session=self.session,
                                 headers=self.headers, timeout=60)
        except requests.RequestException as err:
            self.figures.violate("transport", label, repr(err))
            return
        self.figures.statuses[(label, mode, response.status_code)] += 1
        # schemathesis' responses have lower-case header names and lists of values.
        self.generations += response.headers.get("x-neocloud-generation-id", [])[:1]
        self._check_response(label, case, response)
        self._check_ledger(label, response, before, self.ledger())

    def _aim(self, label, mode, case):
        """Point most positive cases at what exists: a catalog model, a generation seen."""
        if mode != "positive" or self.rng.random() >= AIMED_SHARE:
            return
        if (label == CHAT or label in MESSAGES) and isinstance(case.body, dict):
            case.body["model"] = self.rng.choice(self.models)
        if label == GENERATION and self.generations and isinstance(case.query, dict):
            case.query["id"] = self.rng.choice(self.generations)

    def _check_response(self, label, case, response):
        if response.status_code >= 500:
            self.figures.violate("server_error", label, _show(case, response))
        try:
            case.validate_response(response, checks=self.checks, headers=self.headers)
        except (AssertionError, FailureGroup) as err:
            if response.status_code < 500:  # a 5xx is counted above, once
                self.figures.violate("schema", label, f"{_show(case, response)}\n{err}")

    def _check_ledger(self, label, response, before, after):
        added = after.events - before.events
        moved = before.balance_nanos - after.balance_nanos
        if 400 <= response.status_code < 500 and (added or moved):
            self.figures.violate("charged_4xx", label, f"{response.status_code}: {added} "
                                 f"usage events, balance moved {moved} nanos")
        if moved != after.cost_nanos - before.cost_nanos:
            self.figures.violate("ledger", label, f"balance moved {moved} nanos, usage events "
                                 f"cost {after.cost_nanos - before.cost_nanos}")

    def check_quiescence(self):
        """After the run: no lease, hold or pending event; balance moved by the events' cost."""
        end = self.ledger()
        if end.in_flight or end.leases or end.held_nanos or end.pending:
            self.figures.violate("in_flight", "quiescence", repr(end))
        moved = self.start.balance_nanos - end.balance_nanos
        if moved != end.cost_nanos - self.start.cost_nanos:
            self.figures.violate("ledger", "quiescence",
                                 f"balance moved {moved}, costs {end.cost_nanos}")


def _path(label):
    return label.split(" ", 1)[1]


def _method(label):
    return label.split(" ", 1)[0]


def _show(case, response):
    body = response.content[:400].decode("utf-8", "replace")
    try:
        sent = json.dumps(case.body)[:400] if case.body is not None else ""
    except (TypeError, ValueError):
        sent = repr(case.body)[:400]
    return f"{response.status_code} for {case.method} {case.path} query={case.query} " \
           f"body={sent} -> {body}"


def format_figures(figures, seconds=None):
    """Return the figures as a plain-text table."""
    lines = [f"schema fuzz: {figures.total} cases"
             + (f" in {seconds:.0f} s" if seconds is not None else "")]
    lines.append(f"  {'operation':<28} {'positive':>9} {'negative':>9}")
    for label in sorted({label for label, _ in figures.cases}):
        lines.append(f"  {label:<28} {figures.cases[(label, 'positive')]:>9} "
                     f"{figures.cases[(label, 'negative')]:>9}")
    lines.append(f"  {'operation':<28} {'mode':<9} responses by status")
    for label, mode in sorted({(label, mode) for label, mode, _ in figures.statuses}):
        counts = {s: n for (op, m, s), n in sorted(figures.statuses.items())
                  if (op, m) == (label, mode)}
        lines.append(f"  {label:<28} {mode:<9} "
                     + "  ".join(f"{s}: {n}" for s, n in counts.items()))
    lines.append("  violations")
    for kind in ("server_error", "schema", "charged_4xx", "ledger", "in_flight", "transport"):
        lines.append(f"  {kind:<28} {figures.violations[kind]:>9}")
    return "\n".join(lines)


def describe_failure():
    """Return the current exception's traceback (the harness failed, not Kiln)."""
    return traceback.format_exc()
