"""Fixtures: a worker on a tiny model (a real tokenizer and chat template) per test module,
each module on its own queue so modules never see each other's jobs."""

from __future__ import annotations

import pytest

from pagedq.gateway.fleet import model_id
from tests.service.harness import running_worker


@pytest.fixture(scope="module")
def queue(request) -> str:
    return "gw-" + request.module.__name__.rsplit(".", 1)[-1]


@pytest.fixture(scope="module")
def tiny_model(tiny_text_model_dir) -> str:
    return str(tiny_text_model_dir)


@pytest.fixture(scope="module")
def tiny_id(tiny_model) -> str:
    return model_id(tiny_model)


@pytest.fixture(scope="module")
def tiny_worker(redis_url, tiny_model, queue):
    """One in-process worker on the tiny model (max_model_len 256)."""
    with running_worker(redis_url, tiny_model, f"{queue}-w", queue=queue) as worker:
        yield worker
