"""Fixtures of the service tests: the tiny model and its in-process reference engine."""

from __future__ import annotations

import pytest

from tests.service.harness import ENGINE


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def reference(model):
    """The in-process engine: what every worker result must equal."""
    from pagedq.worker import Engine

    engine = Engine(model, **ENGINE)

    def run(prompt, params):
        return [o.token_ids for o in engine.generate([prompt], params)[0].outputs]

    return run
