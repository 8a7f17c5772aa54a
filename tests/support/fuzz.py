"""Fuzz Kiln from its own OpenAPI document: schemathesis cases through a real gateway.

    python tests/support/fuzz.py --cases N [--seed S]        (or: make fuzz CASES=N SEED=S)

Starts a fresh Postgres database (on 127.0.0.1:5432), the scripted fake upstream (every chat
completion answers at once), gunicorn with two gevent workers, and one org with a key; runs
about N cases, positive and negative, over every operation (``fuzz_run``); prints a figures
table (cases by operation and mode, responses by status, violations by kind) and the first
violations. Exits 1 on any violation, 2 if the harness itself failed.
docs/RELIABILITY.md ("Schema fuzzing") records a run.
"""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

import fuzz_run
from factories import CATALOG
from fake_upstream import FakeUpstream
from gateway_proc import Gateway, create_database, drop_database, gateway_env, make_org, migrate

MODELS = ("fake-model", "fake-vision", "gpt-oss-fake")


def main(argv=None):
    """Run the fuzz; return the exit status."""
    args = _parse(argv)
    name = f"kiln_fuzz_{os.getpid()}"
    url = create_database(name)
    try:
        return _run(url, args)
    except Exception:  # noqa: BLE001 -- a harness failure is reported as such, not as Kiln's
        print(fuzz_run.describe_failure(), file=sys.stderr)
        return 2
    finally:
        drop_database(name)


def _run(url, args):
    migrate(url)
    engine = sa.create_engine(url)
    with FakeUpstream() as fake, tempfile.TemporaryDirectory() as tmp:
        catalog = Path(tmp) / "models.toml"
        catalog.write_text(CATALOG.format(url=fake.base_url))
        gateway = Gateway(gateway_env(url, catalog), workers=2).start()
        try:
            org = make_org(engine, "fuzz", usd="1000")
            fuzzer = fuzz_run.Fuzzer(gateway.base_url, org.key, engine, org.id, MODELS,
                                     seed=args.seed)
            started = time.monotonic()
            figures = fuzzer.run(args.cases)
            elapsed = time.monotonic() - started
        finally:
            gateway.stop()
        if fake.errors:
            raise RuntimeError(f"the fake upstream failed: {fake.errors[0]}")
    engine.dispose()
    print(fuzz_run.format_figures(figures, elapsed))
    for example in figures.examples:
        print("\n" + example)
    return 1 if figures.violations else 0


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1000, help="about how many cases")
    parser.add_argument("--seed", type=int, default=1, help="hypothesis and aiming seed")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
