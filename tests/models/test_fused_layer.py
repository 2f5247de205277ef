"""The C++ decoder-layer ops (CPU fp32 decode steps) against the per-op Python layer and transformers."""

from __future__ import annotations

import pytest
import torch

from pagedq.client import SamplingParams
from pagedq.kernels.cpu_attention import cpu_kernel
from pagedq.worker import Engine
from pagedq.worker.models import llama
from tests.oracle import assert_greedy

pytestmark = pytest.mark.skipif(cpu_kernel() is None, reason="the C++ CPU kernel library is unavailable")

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def run(path, monkeypatch, fused: bool, prompts: list[list[int]], kv_cache_dtype="auto",
        params=GREEDY):
    """Generate greedily; return (outputs, per-step logits, fused-op calls)."""
    monkeypatch.setenv(llama.FUSED_SWITCH, "1" if fused else "0")
    # a 64-token budget: the 70-token prompt's first chunk (> 32 tokens) takes the Python layer
    engine = Engine(str(path), num_kv_blocks=256, block_size=4, max_num_batched_tokens=64,
                    kv_cache_dtype=kv_cache_dtype)
    calls = []
    op = llama._SKINNY["layer"]
    monkeypatch.setitem(llama._SKINNY, "layer", lambda *a: calls.append(1) or op(*a))
    logits = []
    execute = engine.runner.execute

    def recording(sched):
        out = execute(sched)
        logits.append(out[0].clone())
        return out

    engine.runner.execute = recording
    outs = engine.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], logits, len(calls)


def test_fused_layer_matches_python_layer_and_transformers(tiny_family_dir, monkeypatch):
    family, path = tiny_family_dir
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 7, 16, 70)]
    fused_out, fused_logits, fused_calls = run(path, monkeypatch, True, prompts)
    plain_out, plain_logits, plain_calls = run(path, monkeypatch, False, prompts)
    assert plain_calls == 0 and fused_calls > 0, family
    assert len(fused_logits) == len(plain_logits)
    for a, b in zip(fused_logits, plain_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for p, out in zip(prompts, fused_out, strict=True):
        assert_greedy(path, p, out)


def test_fused_layer_needs_short_chunks(tiny_model_dir, monkeypatch):
    """A step with a chunk over the kernel's limit keeps the Python layer (SDPA for the chunk)."""
    path = tiny_model_dir("llama")
    prompt = list(range(3, 103))
    _, _, calls_long = run(path, monkeypatch, True, [prompt])
    # 100 tokens at a 64-token budget: two prefill steps (64 + 36) on the Python layer, then 9
    # decode steps, each one call of the all-layers op
    assert calls_long == 9


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_half_precision_kv_cache(tiny_model_dir, monkeypatch, kv_cache_dtype):
    """kv_cache_dtype under a float32 model: the C++ layer rounds K/V into the cache exactly as
    the Python layer's write does, and the logits stay near the float32 cache's."""
    path = tiny_model_dir("qwen3")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 9, 40)]
    fused_out, fused_logits, calls = run(path, monkeypatch, True, prompts, kv_cache_dtype)
    plain_out, plain_logits, _ = run(path, monkeypatch, False, prompts, kv_cache_dtype)
    assert calls > 0 and fused_out == plain_out
    for a, b in zip(fused_logits, plain_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # prompts only (one token each), so both caches see the same inputs at every step
    one = SamplingParams(temperature=0.0, max_tokens=1)
    _, low, _ = run(path, monkeypatch, True, prompts, kv_cache_dtype, one)
    _, full, _ = run(path, monkeypatch, True, prompts, "auto", one)
    tol = 2e-2 if kv_cache_dtype == "bfloat16" else 3e-3
    for a, b in zip(low, full, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_kv_cache_dtype_is_validated(tiny_model_dir):
    from pagedq.errors import InvalidRequestError

    path = str(tiny_model_dir("llama"))
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of"):
        Engine(path, num_kv_blocks=16, kv_cache_dtype="int8")
    with pytest.raises(InvalidRequestError, match="needs a float32 model on the CPU"):
        Engine(path, num_kv_blocks=16, dtype="bfloat16", kv_cache_dtype="float16")
    engine = Engine(path, num_kv_blocks=16, kv_cache_dtype="float16")
    assert engine.stats()["kv_cache_dtype"] == "float16"
    assert engine.runner.kv_cache.dtype == torch.float16
