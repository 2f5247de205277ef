"""The bench's ``quant`` scenario on a tiny model's real GGUF file (no llama.cpp binaries here:
its side is reported missing with the reason). Structure and simple truths only, no timings."""

from __future__ import annotations

import pytest

from pagedq.bench.options import quick
from pagedq.bench.quant_scenario import TARGETS, best_rows, figures, markdown, table
from pagedq.bench.report import markdown as report_markdown
from pagedq.bench.run import run_bench
from pagedq.bench.workload import LengthDist
from tests.gguf_files import write_gguf
from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-bench")
    model = build_tiny_model("llama", root / "model", hidden_size=256, intermediate_size=512)
    gguf = write_gguf(model, root / "tiny.Q8_0.gguf", "Q8_0")
    config = quick(model=str(gguf), scenarios=("quant",), num_threads=1, max_model_len=256,
                   throughput_requests=4, prompt_dist=LengthDist(16, 0.5, 8, 32),
                   output_dist=LengthDist(6, 0.5, 4, 8), decode_batches=(1, 4),
                   decode_prompt_tokens=8, decode_new_tokens=6, quant_fidelity_tokens=4)
    out, _ = run_bench(config)
    return out


def test_the_file_is_measured_packed(doc):
    assert doc["errors"] == {}
    files = doc["quant"]["files"]
    assert list(files) == ["tiny.Q8_0"]
    f = files["tiny.Q8_0"]
    assert set(f["decode_tok_s"]["pagedq"]) == {"1", "4"}
    assert all(v > 0 for v in f["decode_tok_s"]["pagedq"].values())
    assert f["mixed_tok_s"]["pagedq"] > 0
    assert 0 < f["weights_vs_file"] <= TARGETS["weights_vs_file"]
    assert f["met"]["weights_vs_file"] is True
    assert 0.0 <= f["mean_matching_prefix"] <= 1.0 and f["prefix_target"] == 0.9
    assert set(f["perplexity"]) == {"packed", "dequantized"}
    assert all(v > 1 for v in f["perplexity"].values())


def test_each_stream_count_keeps_its_best_sweep():
    """quant_repeats sweeps per engine, alternated: the fastest row per stream count is kept."""
    sweeps = [[{"b": 1, "s_tg": 80.0}, {"b": 8, "s_tg": 300.0}],
              [{"b": 1, "s_tg": 95.0}, {"b": 8, "s_tg": 250.0}]]
    assert best_rows(sweeps) == [{"b": 1, "s_tg": 95.0}, {"b": 8, "s_tg": 300.0}]


def test_llama_cpp_is_missing_with_a_reason(doc):
    q = doc["quant"]
    assert q["llama_cpp_unavailable"]
    f = q["files"]["tiny.Q8_0"]
    assert f["decode_tok_s"]["llama_cpp"] is None and f["ratios"]["decode_1"] is None
    assert f["met"]["decode_1"] is None  # not judged without llama.cpp
    assert "tiny.Q8_0" in table(q) and "n/a" in table(q)


def test_the_markdown_report_carries_the_quant_table(doc):
    """One row per file, a pagedq / llama.cpp cell per stream count (llama.cpp missing: "-")."""
    rows = [line for line in report_markdown(doc).splitlines() if line.startswith("| tiny.Q8_0 |")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert len(cells) == 1 + 2 + 3  # type, streams 1 and 4, mixed, weights/file, prefix
    assert all(c.endswith(" / -") for c in cells[1:4])
    assert float(cells[4]) == pytest.approx(doc["quant"]["files"]["tiny.Q8_0"]["weights_vs_file"],
                                            abs=1e-3)


def test_figures_need_measurements():
    assert figures(None) is None and table(None) == "" and markdown(None) == ""
