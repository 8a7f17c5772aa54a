"""Checks on the suite's layout, for every run: the unit layer is exactly ``tests/unit``.

The layers' own fixtures live beside them: ``tests/unit/conftest.py`` (an in-process Kiln on
SQLite) and ``tests/functional/conftest.py`` (Postgres, the fake upstream, gunicorn).
"""
from pathlib import Path

import pytest

UNIT = Path(__file__).parent / "unit"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Refuse a run where a test outside ``tests/unit`` is marked ``unit``: ``make check`` runs
    the ``unit`` marker and CI's view of the layers would disagree with the directories."""
    stray = [item.nodeid for item in items
             if item.get_closest_marker("unit") and not item.path.is_relative_to(UNIT)]
    if stray:
        raise pytest.UsageError("marked unit outside tests/unit: " + ", ".join(stray))
