"""Reading GGUF files packed: real files written with the ``gguf`` package, every packed type,
each family. The oracles: the ``gguf`` package's own dequantizer, and transformers' GGUF loader
(which undoes llama.cpp's q/k permutation on float weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from pagedq.kernels.block_formats import QuantWeight, dequantize
from pagedq.kernels.huge_pages import huge_pages_available, mapping_huge_bytes, thp_mode
from pagedq.worker.models.gguf_weights import hf_name, iter_gguf_weights
from tests.gguf_files import ALL_TYPES, K_QUANTS, fits, quantize, quantized_state, write_gguf
from tests.tiny_models import build_tiny_model

WIDE = dict(hidden_size=256, intermediate_size=512)  # K-quants need K % 256 == 0


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory):
    cache = {}

    def make(family: str):
        if family not in cache:
            cache[family] = build_tiny_model(family, tmp_path_factory.mktemp(f"wide-{family}"), **WIDE)
        return cache[family]

    return make


def as_float(w) -> torch.Tensor:
    return dequantize(w) if isinstance(w, QuantWeight) else w.float()


@pytest.mark.parametrize("type_name", K_QUANTS)
def test_k_quant_fixtures_are_valid_blocks(type_name):
    """The test-side K-quant encoder makes blocks gguf decodes to within half a step."""
    x = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    y = gguf_dequantize(quantize(x, type_name), GGMLQuantizationType[type_name])
    levels = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 63}[type_name]
    step = (x.reshape(-1, 32).max(-1) - np.minimum(x.reshape(-1, 32).min(-1), 0)) / levels
    assert np.all(np.abs(y - x).reshape(-1, 32).max(-1) <= 1.6 * step + 1e-3)


@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_every_type_reads_packed_and_exact(tmp_path, wide_models, type_name):
    model = wide_models("llama")
    path = write_gguf(model, tmp_path / f"m-{type_name}.gguf", type_name)
    want = quantized_state(model, type_name)
    got = dict(iter_gguf_weights(path))
    assert set(got) == set(want)
    for name, w in got.items():
        assert isinstance(w, QuantWeight) == (want[name].dim() == 2), name
        if isinstance(w, QuantWeight):
            assert w.fmt.name == fits(type_name, w.shape[1]).lower()
        torch.testing.assert_close(as_float(w), want[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("huge_pages", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_matches_transformers_gguf_loader(tmp_path, wide_models, family, huge_pages):
    """Names, q/k row order and values agree with transformers' own GGUF dequantization, read
    onto huge pages too (where llama's q/k rows are unpermuted in place). (Its Qwen3 GGUF reader
    ignores head_dim, which the tiny Qwen3 sets: see the next test.)"""
    from transformers import AutoModelForCausalLM

    model = wide_models(family)
    path = write_gguf(model, tmp_path / "m.gguf", "Q6_K", types={"ffn_down": "Q4_0"})
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    state = hf.state_dict()
    got = dict(iter_gguf_weights(path, huge_pages=huge_pages))
    for name, w in got.items():
        torch.testing.assert_close(as_float(w), state[name].float(), rtol=0, atol=0, msg=name)


@pytest.mark.skipif(not huge_pages_available(),
                    reason=f"this kernel gives no transparent huge pages (mode {thp_mode()})")
def test_packed_weights_are_read_onto_huge_pages(tmp_path, wide_models):
    """Every packed weight, the unpermuted q/k included, lies in a mapping the kernel backs
    with huge pages; with the switch off none does."""
    path = write_gguf(wide_models("llama"), tmp_path / "m.gguf", "Q4_K")
    on = dict(iter_gguf_weights(path, huge_pages=True))
    off = dict(iter_gguf_weights(path, huge_pages=False))
    packed = [n for n, w in on.items() if isinstance(w, QuantWeight)]
    assert "model.layers.0.self_attn.q_proj.weight" in packed
    for name in packed:
        assert mapping_huge_bytes(on[name].data.data_ptr()) > 0, name
        if thp_mode() == "madvise":  # ("always" may back torch's own memory too)
            assert mapping_huge_bytes(off[name].data.data_ptr()) == 0, name
        assert torch.equal(on[name].data, off[name].data), name


def test_qwen3_norms_and_fallback_types(tmp_path, wide_models):
    """Qwen3's q/k norms load; its 64-wide o_proj rows fall back from Q4_K to Q8_0."""
    model = wide_models("qwen3")
    path = write_gguf(model, tmp_path / "m.gguf", "Q4_K")
    want = quantized_state(model, "Q4_K")
    got = dict(iter_gguf_weights(path))
    assert got["model.layers.0.self_attn.o_proj.weight"].fmt.name == "q8_0"
    assert got["model.layers.0.self_attn.q_proj.weight"].fmt.name == "q4_k"
    for name, w in got.items():
        torch.testing.assert_close(as_float(w), want[name], rtol=0, atol=0, msg=name)


def test_unread_types_are_widened_and_packing_can_be_refused(tmp_path, wide_models):
    model = wide_models("llama")
    path = write_gguf(model, tmp_path / "m.gguf", "Q8_0", types={"ffn_up": "MXFP4"})
    got = dict(iter_gguf_weights(path))
    up = got["model.layers.0.mlp.up_proj.weight"]
    assert not isinstance(up, QuantWeight) and up.dtype == torch.float32
    assert isinstance(got["model.layers.0.mlp.down_proj.weight"], QuantWeight)
    assert not any(isinstance(w, QuantWeight) for _, w in iter_gguf_weights(path, keep_packed=False))


def test_names():
    assert hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None
