"""The engine's ``quantization`` knob: what each value loads, what stats() and the start-up log
report, and what a file with types no kernel reads becomes.

The numbers these tests compare with come from the files themselves (tensor byte counts read
with safetensors and the gguf package), not from the engine under test.
"""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from pagedq.errors import InvalidRequestError
from pagedq.params import SamplingParams
from pagedq.worker import Engine
from tests.gguf_files import write_gguf

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
WIDE = {"hidden_size": 256, "intermediate_size": 512}


def file_tensor_bytes(model_dir) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())


def ready_line(logs: list[dict]) -> dict:
    return next(e for e in logs if e["event"] == "engine ready")


def test_the_start_up_line_has_the_memory_math(tiny_model_dir, tmp_path):
    """Weights, KV bytes per token and the concurrency they leave: the seed's VRAM math."""
    gguf = write_gguf(tiny_model_dir("llama", **WIDE), tmp_path / "m.gguf", "Q4_K")
    with capture_logs() as logs:
        engine = Engine(str(gguf), num_kv_blocks=64, max_model_len=128)
    line = ready_line(logs)
    assert line["quantization"] == "auto" and line["weight_bytes"] == engine.stats()["weight_bytes"]
    cfg = engine.hf_config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * \
        (cfg.hidden_size // cfg.num_attention_heads) * engine.kv_dtype.itemsize
    assert line["kv_bytes_per_token"] == per_token
    assert line["concurrency_at_max_len"] == pytest.approx(line["kv_tokens"] / 128, abs=0.01)


def test_none_holds_at_least_the_fp32_file_and_int8_a_third_of_it(tiny_model_dir):
    path = tiny_model_dir("llama", **WIDE)
    fp32 = file_tensor_bytes(path)
    none = Engine(str(path), num_kv_blocks=64, quantization="none")
    int8 = Engine(str(path), num_kv_blocks=64, quantization="int8")
    assert none.stats()["weight_bytes"] >= fp32
    assert int8.stats()["weight_bytes"] < fp32 / 3
    for engine in (none, int8):
        assert len(engine.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids) == 4


def test_auto_widens_a_type_it_cannot_read_with_a_log_line(tiny_model_dir, tmp_path):
    gguf = write_gguf(tiny_model_dir("llama", **WIDE), tmp_path / "m.gguf", "Q8_0",
                      types={"ffn_up": "MXFP4"})
    with capture_logs() as logs:
        engine = Engine(str(gguf), num_kv_blocks=64)
    widened = [e for e in logs if e["event"].startswith("gguf tensors widened")]
    assert [e["type"] for e in widened] == ["MXFP4"]
    assert len(engine.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids) == 4


def test_an_unknown_quantization_says_what_is_accepted():
    with pytest.raises(InvalidRequestError, match="int4"):
        Engine(quantization="fp8")


def test_huge_pages_change_no_output(tiny_model_dir, tmp_path):
    """A GGUF's packed weights read onto huge pages (the default) decode the same greedy tokens
    as on ordinary pages: the same bytes, only their pages differ."""
    gguf = write_gguf(tiny_model_dir("llama", **WIDE), tmp_path / "m.gguf", "Q4_K")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = []
    for huge in (True, False):
        engine = Engine(str(gguf), num_kv_blocks=64, max_model_len=128, huge_pages=huge)
        outs.append([o.outputs[0].token_ids for o in engine.generate([[1, 5, 9, 13], [2, 7]], params)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("quantization", ["int8", "none"])
def test_other_forms_move_onto_huge_pages_with_the_same_output(tiny_model_dir, quantization):
    """A safetensors checkpoint's weights (packed here to int8, or kept fp32) are copied onto
    huge pages after loading; greedy tokens equal those of the engine that keeps torch's pages,
    and (where this Linux grants huge pages) the big weights lie on them."""
    from pagedq.kernels.huge_pages import (
        MIN_TENSOR_BYTES,
        huge_pages_available,
        mapping_huge_bytes,
        on_huge_pages,
    )

    path = tiny_model_dir("llama", **WIDE)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs, engines = [], []
    for huge in (True, False):
        engine = Engine(str(path), num_kv_blocks=64, quantization=quantization, huge_pages=huge)
        outs.append([o.outputs[0].token_ids for o in engine.generate([[1, 5, 9, 13], [2, 7]], params)])
        engines.append(engine)
    assert outs[0] == outs[1]
    if not huge_pages_available():
        return
    slots = engines[0].model.weight_slots()
    held = [h[k] if isinstance(k, int) else getattr(h, k) for h, k in slots]
    big = [t for t in held if t.numel() * t.element_size() >= MIN_TENSOR_BYTES]
    assert big and all(on_huge_pages(t) and mapping_huge_bytes(t.data_ptr()) > 0 for t in big)
