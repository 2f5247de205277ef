"""The chaos suite's profiles: a short one in every test run, a long one on request.

``pytest tests/chaos`` runs each scenario briefly (a few faults, a short kill loop, a thousand
hostile entries) so CI stays within its time budget. ``PAGEDQ_CHAOS=long pytest tests/chaos
-s`` runs the long profile whose figures docs/operations.md reports; tests marked
``chaos_long`` run only then.
"""

from __future__ import annotations

import os

import pytest

LONG = os.environ.get("PAGEDQ_CHAOS", "") == "long"


def pytest_collection_modifyitems(config, items):
    if LONG:
        return
    skip = pytest.mark.skip(reason="long chaos profile: set PAGEDQ_CHAOS=long")
    for item in items:
        if "chaos_long" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def profile():
    """"long" or "short": the scenario's size."""
    return "long" if LONG else "short"
