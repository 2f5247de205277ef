"""The ``memory`` bench scenario's model file and figures (bench/memory_bound.py). The
scenario's timings need llama.cpp and minutes; here its synthetic GGUF is checked to be a model
the engine serves, at a tiny shape, and its figures against hand-made rows."""

from __future__ import annotations

from pagedq.bench import memory_bound
from pagedq.params import SamplingParams
from pagedq.worker import Engine

TINY = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 4, "intermediate": 128}


def test_the_synthetic_gguf_is_a_model_the_engine_serves(tmp_path):
    path = memory_bound.synthetic_f16(tmp_path / "tiny.F16.gguf", shape=TINY)
    assert memory_bound.synthetic_f16(path, shape=TINY) == path  # written once
    engine = Engine(str(path), num_kv_blocks=64)
    assert engine.hf_config.hidden_size == 64 and engine.hf_config.num_hidden_layers == 2
    out = engine.chat([{"role": "user", "content": "hi"}],
                      SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    assert "<|im_start|>" in engine.tokenizer.chat_template  # SmolLM2's template came along


def test_figures_against_llama_cpp_and_the_roofline():
    row = lambda b, s: {"b": b, "s_tg": s}  # noqa: E731
    results = {"shape": memory_bound.SHAPE, "streams": [1, 16], "stream_read_gbps": 20.0,
               "files": {"Q4_K_M": {"gguf": "x", "file_bytes": 10**9, "weight_bytes": 10**9,
                                    "pagedq": [row(1, 17.0), row(16, 150.0)],
                                    "llama_cpp": [row(1, 15.0), row(16, 100.0)],
                                    "roofline_tok_s_1": 20.0}}}
    figs = memory_bound.figures(results)["files"]["Q4_K_M"]
    assert figs["vs_llama_cpp"] == {"1": 17 / 15, "16": 1.5} and figs["of_roofline_1"] == 0.85
    assert "| Q4_K_M | 1.00 GB | 17.0 / 150.0 |" in memory_bound.markdown(
        memory_bound.figures(results))
