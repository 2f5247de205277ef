"""The bench's ``structured`` scenario end to end on a random-weight model with the bundled
tokenizer: structure and simple truths only, never timings."""

from __future__ import annotations

import pytest

from pagedq.bench.options import quick
from pagedq.bench.report import table
from pagedq.bench.run import run_bench
from tests.engine.structured_cases import build_random_model


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    model = build_random_model(tmp_path_factory.mktemp("random-smol-vocab"))
    config = quick(model=str(model), num_threads=1, max_model_len=1024, scenarios=("structured",),
                   structured_requests=4, structured_max_tokens=300)
    doc, _ = run_bench(config)
    return doc


def test_structured_figures(doc):
    assert doc["errors"] == {}
    s = doc["details"]["structured"]
    assert doc["structured_throughput_ratio"] > 0
    assert s["valid_outputs"] == s["requests"] == 4  # garbage weights, valid JSON: the mask
    assert len(s["tok_s_constrained"]) == len(s["tok_s_free"]) == 2
    assert s["mask_ms_per_step"] > 0 and 0 < s["mask_share_of_step"] < 1
    assert set(s["ttft_s"]) == {"fresh_engine_s", "new_schema_s", "cached_schema_s"}
    assert all(v > 0 for v in s["ttft_s"].values())
    assert doc["targets"]["structured_throughput_ratio"]["target"] == ">= 0.9"
    assert "JSON schema vs unconstrained" in table(doc)
