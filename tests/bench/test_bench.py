"""``pagedq bench`` end to end on a tiny model, plus its pure parts against hand-worked oracles.

Never asserts on timings: only structure (every figure key present, numbers or a stated reason)
and simple truths (utilizations in [0, 1], token counts equal to the trace's, the paged layout
holding at least as many sequences as max-length reservation at equal memory, greedy outputs
equal between pagedq, HF generate and the Redis path on the same inputs).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pagedq.bench.command import config_from_args
from pagedq.bench.contiguous import simulate_reservation
from pagedq.bench.options import SCENARIOS, quick
from pagedq.bench.report import FIGURE_KEYS
from pagedq.bench.run import run_bench
from pagedq.bench.timeline import Timeline, p99_over_p50
from pagedq.bench.workload import (
    BenchRequest,
    LengthDist,
    TokenSpace,
    fixed_shape,
    sharegpt_like,
)

ROW_KEYS = {"pp", "tg", "b", "n_kv", "t_pp", "s_pp", "t_tg", "s_tg", "t", "s"}


def tiny_config(model_dir, redis_url):
    """Every scenario, at sizes the tiny model (1024 positions) runs in seconds."""
    return quick(
        model=str(model_dir), num_threads=1, max_model_len=512, max_num_batched_tokens=64,
        throughput_requests=6, prompt_dist=LengthDist(24, 0.5, 8, 64),
        output_dist=LengthDist(8, 0.5, 4, 16), hf_batch_size=4,
        decode_batches=(1, 4), decode_prompt_tokens=16, decode_new_tokens=8,
        decode_kv_cache_dtype="float16", capacity_requests=12, capacity_reserved_slots=2,
        capacity_max_model_len=128,
        capacity_max_num_seqs=64, itl_decodes=3, itl_decode_prompt_tokens=8,
        itl_decode_new_tokens=12, itl_long_prompt_tokens=200, itl_inject_after_tokens=3,
        prefix_tokens=64, prefix_suffix_tokens=8, prefix_repeats=2, redis_url=redis_url,
        queue_timeout_s=120.0,
    )


@pytest.fixture(scope="module")
def bench(tiny_model_dir, redis_url, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    config = tiny_config(tiny_model_dir("llama"), redis_url)
    doc, plots = run_bench(config, str(out / "bench.json"), str(out / "plots"))
    return config, doc, plots, out


def test_json_has_every_figure_or_a_reason(bench):
    _, doc, _, out = bench
    on_disk = json.loads((out / "bench.json").read_text())
    assert on_disk == json.loads(json.dumps(doc))  # what was returned is what was written
    for key in FIGURE_KEYS:
        assert key in on_disk
        if on_disk[key] is None:
            assert on_disk["unavailable"][key].startswith("unavailable: ")
    for key in ("tokens_per_s", "ttft_s", "itl_s", "peak_rss_mb", "machine", "targets",
                "config", "elapsed_s", "errors", "details"):
        assert key in on_disk
    assert on_disk["errors"] == {}
    # no llama.cpp binaries for the tiny model: unavailable with the reason, never an error
    assert on_disk["unavailable"]["llama_cpp"].startswith("unavailable: ")
    machine = on_disk["machine"]
    assert machine["torch_threads"] == 1 and machine["device"] == "cpu"
    assert machine["cpu_logical_cores"] >= 1
    assert on_disk["peak_rss_mb"]["pagedq"] > 0


def test_engine_figures_are_measured(bench):
    """Everything that needs only the engine and HF must be a number on the tiny model."""
    _, doc, _, _ = bench
    for key in FIGURE_KEYS:
        if key not in ("queue_throughput_vs_inprocess", "prefix_ttft_ratio",
                       "structured_throughput_ratio"):
            assert doc[key] is not None, doc["unavailable"].get(key)
    # the tiny model has no tokenizer to build a grammar on (test_bench_structured.py has one)
    assert "tokenizer" in doc["unavailable"]["structured_throughput_ratio"]


def test_kv_figures_are_sane(bench):
    config, doc, _, _ = bench
    cap = doc["details"]["capacity"]
    assert 0.0 < doc["kv_utilization"] <= 1.0
    assert 0.0 < doc["kv_utilization_contiguous"] <= 1.0
    assert 0.0 < cap["paged_kv_utilization_per_step"] <= 1.0
    # max_model_len (128) is far above the block size (16): reserving it wastes more.
    assert doc["kv_utilization"] > doc["kv_utilization_contiguous"]
    assert cap["reserved_peak_running"] == config.capacity_reserved_slots
    assert cap["paged_peak_running"] >= cap["reserved_peak_running"]
    assert doc["concurrency_vs_contiguous"] == pytest.approx(
        cap["paged_peak_running"] / cap["reserved_peak_running"])
    assert cap["kv_budget_tokens"] == config.capacity_reserved_slots * 128


def test_throughput_counts_only_useful_tokens_and_matches_hf(bench):
    _, doc, _, _ = bench
    tput = doc["details"]["throughput"]
    expected = tput["trace"]["output_tokens_total"]
    assert tput["pagedq_output_tokens"] == expected
    assert tput["hf_output_tokens"] == expected
    assert doc["throughput_vs_hf_static"] > 0
    assert doc["ttft_s"]["pagedq"]["count"] == tput["trace"]["num_requests"]
    assert doc["itl_s"]["hf_static"]["count"] == expected - tput["trace"]["num_requests"]
    # Same prompts, same lengths, greedy: the two systems must produce the same tokens.
    assert tput["greedy_agreement_pagedq_vs_hf"]["requests_identical"] == 1.0


def test_decode_sweep_rows_have_the_batched_bench_shape(bench):
    config, doc, _, _ = bench
    dec = doc["decode_tok_s_by_batch"]
    # the second pagedq sweep on an fp16 KV cache (llama.cpp's default) judges the targets
    assert "f16 KV cache" in doc["targets"]["decode_64_streams_tok_s"]["target"]
    for side in ("pagedq", "hf_static", "pagedq_kv_float16"):
        rows = dec["rows"][side]
        assert [r["b"] for r in rows] == list(config.decode_batches)
        for r in rows:
            assert set(r) == ROW_KEYS
            assert r["n_kv"] == r["b"] * (r["pp"] + r["tg"])
            assert r["s_tg"] > 0 and r["t_tg"] > 0
        assert set(dec[side]) == {str(b) for b in config.decode_batches}


def test_queue_baseline_brackets_the_redis_run(bench):
    _, doc, _, _ = bench
    q = doc["details"]["queue"]
    assert q["inprocess_tok_s_before"] > 0 and q["inprocess_tok_s_after"] > 0
    mean = (q["inprocess_tok_s_before"] + q["inprocess_tok_s_after"]) / 2
    assert q["inprocess_tok_s_baseline"] == pytest.approx(mean)
    assert doc["queue_throughput_vs_inprocess"] == pytest.approx(
        doc["tokens_per_s"]["pagedq_via_redis"] / mean)


def test_itl_and_prefix_ratios(bench):
    _, doc, _, _ = bench
    assert doc["itl_p99_over_p50_chunked"] >= 1.0
    assert doc["itl_p99_over_p50_unchunked"] >= 1.0
    itl = doc["details"]["itl"]
    assert itl["unchunked"]["max_num_batched_tokens"] >= 200  # the long prompt in one step
    assert itl["chunked"]["max_num_batched_tokens"] == 64
    if doc["prefix_ttft_ratio"] is not None:
        assert doc["prefix_ttft_ratio"] > 0
        assert all(h > 0 for h in doc["details"]["prefix"]["prefix_cache_hits"])


def test_gateway_path_streams_the_same_text_as_the_sdk(bench):
    _, doc, _, _ = bench
    g = doc["details"]["gateway"]
    assert g["texts_equal"] and g["http"]["output_tokens"] == g["sdk_before"]["output_tokens"]
    assert doc["gateway_throughput_vs_sdk"] == pytest.approx(
        g["http"]["tokens_per_s"] / g["sdk_tok_s_baseline"])
    assert doc["targets"]["gateway_added_ttft_p50_ms"]["target"] == "<= 10 ms"


def test_queue_path_gives_the_same_tokens(bench):
    _, doc, _, _ = bench
    if doc["queue_throughput_vs_inprocess"] is None:
        pytest.skip(doc["unavailable"]["queue_throughput_vs_inprocess"])
    q = doc["details"]["queue"]
    assert q["output_tokens"] == doc["details"]["throughput"]["trace"]["output_tokens_total"]
    assert q["outputs_equal_inprocess"]["requests_identical"] == 1.0


def test_table_and_markdown_render_from_the_saved_json(bench):
    from pagedq.bench import report

    _, _, _, out = bench
    doc = json.loads((out / "bench.json").read_text())
    md = report.markdown(doc)
    assert md.startswith("| Figure | Baseline |")
    assert f"| {report._fmt(doc['kv_utilization'])} |" in md
    assert "KV utilization" in report.table(doc)


def test_plots_are_pngs(bench):
    _, _, plots, _ = bench
    names = {p.rsplit("/", 1)[-1] for p in plots}
    assert names == {"kv_occupancy.png", "itl_distribution.png", "throughput_vs_concurrency.png"}
    for path in plots:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_unselected_scenarios_are_reported_unavailable(tiny_model_dir, tmp_path):
    config = tiny_config(tiny_model_dir("llama"), None).with_(scenarios=("capacity",))
    doc, _ = run_bench(config)
    assert doc["kv_utilization"] is not None
    assert doc["throughput_vs_hf_static"] is None
    assert "'throughput' was not selected" in doc["unavailable"]["throughput_vs_hf_static"]


def test_fp16_cache_sweep_is_unavailable_not_an_error_where_the_engine_refuses_it(
        tiny_model_dir, tmp_path):
    """A bfloat16 model cannot take an fp16 cache: the extra sweep is skipped with the
    engine's reason, the run has no error, and the targets fall back to the main sweep."""
    config = tiny_config(tiny_model_dir("llama"), None).with_(scenarios=("decode",),
                                                              dtype="bfloat16")
    doc, _ = run_bench(config)
    assert doc["errors"] == {}
    dec = doc["decode_tok_s_by_batch"]
    assert "pagedq_kv_float16" not in dec and set(dec["pagedq"]) == {"1", "4"}
    assert "f16 KV cache" not in doc["targets"]["decode_64_streams_tok_s"]["target"]


# -- pure parts ---------------------------------------------------------------------------------
def test_reservation_simulation_by_hand():
    """Budget 2 x 10 slots; requests (prompt, output): A(3,2) B(4,1) C(2,3).

    step 1: A,B admitted+prefilled (live 4+5=9); B done.   step 2: A decodes (5), C admitted (3)
    -> 8; A done.   step 3: C (4).   step 4: C (5), done.
    """
    reqs = [BenchRequest("A", [5] * 3, 2), BenchRequest("B", [5] * 4, 1),
            BenchRequest("C", [5] * 2, 3)]
    run = simulate_reservation(reqs, budget_tokens=20, max_model_len=10)
    assert [(s.running, s.tokens_live) for s in run.steps] == [(2, 9), (2, 8), (1, 4), (1, 5)]
    assert run.peak_running() == 2
    assert run.kv_utilization() == pytest.approx((9 + 8 + 4 + 5) / (20 + 20 + 10 + 10))
    assert simulate_reservation(reqs, budget_tokens=9, max_model_len=10).steps == []


def test_workload_is_seeded_bounded_and_special_free():
    space = TokenSpace.for_model(384, [0, 1, 2, None])
    assert space.low == 3
    assert TokenSpace.for_model(1000, [0, 990, 995]) == TokenSpace(1, 990)  # specials at the end
    dist = LengthDist(50, 1.0, 10, 80)
    a = sharegpt_like(40, space, seed=3, prompt=dist, output=dist)
    b = sharegpt_like(40, space, seed=3, prompt=dist, output=dist)
    assert a == b
    assert a != sharegpt_like(40, space, seed=4, prompt=dist, output=dist)
    for r in a:
        assert 10 <= r.prompt_len <= 80 and 10 <= r.max_tokens <= 80
        assert min(r.prompt_token_ids) >= 3 and max(r.prompt_token_ids) < 384
        assert r.params().ignore_eos and r.params().temperature == 0.0
    shaped = fixed_shape(3, 7, 5, space)
    assert [(r.prompt_len, r.max_tokens) for r in shaped] == [(7, 5)] * 3


def test_timeline_statistics():
    tl = Timeline(start=0.0)
    tl.arrive("x", 0.0)
    tl.tokens("x", 1.0, 1)
    tl.tokens("x", 1.5, 2)
    tl.end = 2.0
    assert tl.output_tokens == 3 and tl.tokens_per_s == 1.5
    assert list(tl.ttfts()) == [1.0]
    assert list(tl.itls()) == [0.5, 0.0]
    ratio = p99_over_p50(np.array([1.0] * 99 + [10.0]))
    assert math.isclose(ratio, float(np.percentile([1.0] * 99 + [10.0], 99)))
    assert p99_over_p50(np.array([1.0])) is None


def test_cli_parses_quick_and_scenarios():
    import argparse

    from pagedq.bench.command import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--quick", "--scenarios", "capacity,itl", "--threads", "2",
                              "--json", "x.json", "--max-num-batched-tokens", "256"])
    config = config_from_args(args)
    assert config.profile == "quick" and config.scenarios == ("capacity", "itl")
    assert config.num_threads == 2 and config.max_num_batched_tokens == 256
    full = config_from_args(parser.parse_args(["bench"]))
    assert full.profile == "full" and full.scenarios == SCENARIOS
    assert full.throughput_requests == 64 and full.decode_batches == (1, 8, 32, 64)
    with pytest.raises(SystemExit):
        config_from_args(parser.parse_args(["bench", "--scenarios", "nope"]))
    tuned = config_from_args(parser.parse_args(
        ["bench", "--quick", "--set", "decode_batches=1,8", "--set", "prompt_dist=50,0.5,8,99",
         "--set", "redis_url=redis://h:1/0", "--set", "device=none"]))
    assert tuned.decode_batches == (1, 8) and tuned.prompt_dist == LengthDist(50, 0.5, 8, 99)
    assert tuned.redis_url == "redis://h:1/0" and tuned.device is None
    with pytest.raises(SystemExit):
        config_from_args(parser.parse_args(["bench", "--set", "no_such_field=1"]))
