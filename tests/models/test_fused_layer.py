"""The model on each CPU backend: the fused C++ all-layers op (CPU fp32 decode steps) against
the per-op Python layer, the portable PyTorch kernels and transformers.

The backend is chosen as the engine chooses it, by a Selector, here with explicit switches or CPU
features (the model asks the backend it is given; nothing reads the environment).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedq.kernels import Selector, Switches
from pagedq.kernels.backend import portable_backend
from pagedq.kernels.cpu_features import CpuFeatures
from pagedq.params import SamplingParams
from pagedq.worker import Engine
from tests.oracle import assert_greedy

pytestmark = pytest.mark.usefixtures("cpu_ops")  # fails, not skips, where the build broke

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
AVX2 = CpuFeatures.of("avx2", "fma", "f16c")


def run(path, fused: bool | None, prompts: list[list[int]], kv_cache_dtype="auto", params=GREEDY,
        selector: Selector | None = None):
    """Generate greedily on the backend ``selector`` chooses with the fused layer on or off
    (``fused=None``: the portable PyTorch kernels); return (outputs, per-step logits, fused-op
    calls)."""
    # a 64-token budget: the 70-token prompt's first chunk (> 32 tokens) takes the Python layer
    engine = Engine(str(path), num_kv_blocks=256, block_size=4, max_num_batched_tokens=64,
                    kv_cache_dtype=kv_cache_dtype)
    calls = []
    if fused is None:
        backend = portable_backend("cpu", torch.float32)
    else:
        selector = selector or Selector(Switches(fused_layer=fused))
        backend = selector.select("cpu", torch.float32, engine.kv_dtype, engine.model.head_dim)
        if backend.ops is not None:
            op = backend.ops.decoder_layers
            counting = lambda *a: calls.append(1) or op(*a)
            backend = dataclasses.replace(
                backend, ops=dataclasses.replace(backend.ops, decoder_layers=counting))
    engine.model.use_kernels(backend.plan())
    logits = []
    execute = engine.runner.execute

    def recording(sched):
        out = execute(sched)
        logits.append(out[0].clone())
        return out

    engine.runner.execute = recording
    outs = engine.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], logits, len(calls)


def test_fused_layer_matches_python_layer_and_transformers(tiny_family_dir):
    family, path = tiny_family_dir
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 7, 16, 70)]
    fused_out, fused_logits, fused_calls = run(path, True, prompts)
    plain_out, plain_logits, plain_calls = run(path, False, prompts)
    assert plain_calls == 0 and fused_calls > 0, family
    assert len(fused_logits) == len(plain_logits)
    for a, b in zip(fused_logits, plain_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for p, out in zip(prompts, fused_out, strict=True):
        assert_greedy(path, p, out)


def test_fused_layer_needs_short_chunks(tiny_model_dir):
    """A step with a chunk over the kernel's limit keeps the Python layer (SDPA for the chunk)."""
    path = tiny_model_dir("llama")
    prompt = list(range(3, 103))
    _, _, calls_long = run(path, True, [prompt])
    # 100 tokens at a 64-token budget: two prefill steps (64 + 36) on the Python layer, then 9
    # decode steps, each one call of the all-layers op
    assert calls_long == 9


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
def test_half_precision_kv_cache(tiny_model_dir, kv_cache_dtype):
    """kv_cache_dtype under a float32 model: the C++ layer rounds K/V into the cache exactly as
    the Python layer's write does, and the logits stay near the float32 cache's."""
    path = tiny_model_dir("qwen3")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 9, 40)]
    fused_out, fused_logits, calls = run(path, True, prompts, kv_cache_dtype)
    plain_out, plain_logits, _ = run(path, False, prompts, kv_cache_dtype)
    assert calls > 0 and fused_out == plain_out
    for a, b in zip(fused_logits, plain_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # prompts only (one token each), so both caches see the same inputs at every step
    one = SamplingParams(temperature=0.0, max_tokens=1)
    _, low, _ = run(path, True, prompts, kv_cache_dtype, one)
    _, full, _ = run(path, True, prompts, "auto", one)
    tol = 2e-2 if kv_cache_dtype == "bfloat16" else 3e-3
    for a, b in zip(low, full, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("variant", ["avx2", "no-onednn", "no-cpu-kernels"])
def test_every_cpu_backend_matches_the_portable_kernels(tiny_model_dir, variant):
    """Each backend this CPU can run (the AVX2 GEMV tiles, F.linear instead of oneDNN, no C++
    at all) gives the portable PyTorch kernels' logits at every step, and transformers' tokens."""
    path = tiny_model_dir("qwen2")
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 6, 12, 23)]
    selector = {"avx2": Selector(cpu=AVX2), "no-onednn": Selector(Switches(onednn=False)),
                "no-cpu-kernels": Selector(Switches(cpu_kernels=False))}[variant]
    out, logits, calls = run(path, True, prompts, selector=selector)
    ref_out, ref_logits, _ = run(path, None, prompts)
    assert (calls > 0) == (variant != "no-cpu-kernels") and out == ref_out
    for a, b in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for p, tokens in zip(prompts, out, strict=True):
        assert_greedy(path, p, tokens)


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
