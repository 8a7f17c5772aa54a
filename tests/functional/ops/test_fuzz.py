"""Schema fuzzing in the suite: a few hundred schemathesis cases through the real gateway
(``tests/support/fuzz_run.py``; ``make fuzz`` runs the big one)."""
import copy

import pytest

from fuzz_run import Fuzzer, Ledger, format_figures

pytestmark = pytest.mark.postgres
MODELS = ("fake-model", "fake-vision", "gpt-oss-fake")


def report(figures):
    return format_figures(figures) + "\n\n" + "\n\n".join(figures.examples)


def test_a_few_hundred_schema_cases_break_nothing(gateway, engine, org, fake):
    figures = Fuzzer(gateway.base_url, org.key, engine, org.id, MODELS, seed=7).run(300)
    assert not figures.violations, report(figures)
    assert figures.total >= 250
    chat = {status for (label, _, status) in figures.statuses if label.startswith("POST")}
    # Both kinds of case reached the gateway: some were served and billed, some refused.
    assert 200 in chat and 400 in chat, report(figures)
    assert figures.cases[("GET /v1/generation", "positive")] > 0
    assert fake.errors == []


def test_a_response_the_document_does_not_state_is_a_violation(gateway, engine, org, fake):
    fuzzer = Fuzzer(gateway.base_url, org.key, engine, org.id, MODELS, seed=3)
    document = copy.deepcopy(fuzzer.document)
    del document["paths"]["/v1/chat/completions"]["post"]["responses"]["400"]
    figures = Fuzzer(gateway.base_url, org.key, engine, org.id, MODELS, seed=3,
                     document=document).run(60)
    assert figures.violations["schema"] > 0, report(figures)


class FakeResponse:
    def __init__(self, status_code):
        self.status_code = status_code


def test_a_charged_refusal_and_a_balance_off_its_events_are_violations(gateway, engine, org):
    fuzzer = Fuzzer(gateway.base_url, org.key, engine, org.id, MODELS)
    before = Ledger(balance_nanos=1000, held_nanos=0, in_flight=0, events=3, cost_nanos=50,
                    pending=0, leases=0)
    charged = Ledger(balance_nanos=990, held_nanos=0, in_flight=0, events=4, cost_nanos=60,
                     pending=0, leases=0)
    fuzzer._check_ledger("POST /v1/chat/completions", FakeResponse(400), before, charged)
    assert fuzzer.figures.violations["charged_4xx"] == 1
    assert fuzzer.figures.violations["ledger"] == 0
    fuzzer._check_ledger("POST /v1/chat/completions", FakeResponse(200), before, charged)
    assert fuzzer.figures.violations["charged_4xx"] == 1  # a 200 may be charged
    off = Ledger(balance_nanos=980, held_nanos=0, in_flight=0, events=4, cost_nanos=60,
                 pending=0, leases=0)
    fuzzer._check_ledger("POST /v1/chat/completions", FakeResponse(200), before, off)
    assert fuzzer.figures.violations["ledger"] == 1


def test_a_lease_or_hold_left_at_quiescence_is_a_violation(gateway, engine, org):
    fuzzer = Fuzzer(gateway.base_url, org.key, engine, org.id, MODELS)
    fuzzer.start = fuzzer.ledger()
    fuzzer.check_quiescence()
    assert not fuzzer.figures.violations  # a fresh org is quiet
    leaked = Ledger(balance_nanos=fuzzer.start.balance_nanos, held_nanos=5, in_flight=1,
                    events=1, cost_nanos=0, pending=1, leases=1)
    fuzzer.ledger = lambda: leaked
    fuzzer.check_quiescence()
    assert fuzzer.figures.violations["in_flight"] == 1
