"""``paged_attention`` and ``write_kv``: the only kernel entry points the engine's layers call.

``backend`` names the implementation (see :mod:`pagedq.kernels.backend`): attention ``"cpp"``,
``"sdpa"`` or ``"triton"``, KV writes ``"torch"`` or ``"triton"``. The engine passes what its
:class:`~pagedq.kernels.backend.Backend` chose at start; ``None`` asks the process's selector for
these tensors. Triton on a CPU tensor runs only in Triton's interpreter (``TRITON_INTERPRET=1``
set before triton is first imported); that is how the Triton kernels are tested without a GPU.
"""

from __future__ import annotations

import math

import torch

from pagedq.kernels.backend import (
    ATTENTION,
    KV_WRITE,
    BackendUnavailableError,
    default_attention,
    process_selector,
    triton_available,
)
from pagedq.kernels.cpu_attention import kernel_fits
from pagedq.kernels.plan import AttentionPlan, KernelArgumentError, mixed_ok, plan_attention
from pagedq.kernels.torch_attention import torch_paged_attention
from pagedq.kernels.torch_cache import torch_write_kv


def _check_triton(tensor: torch.Tensor) -> None:
    if not triton_available():
        raise BackendUnavailableError(
            "backend='triton' needs the triton package (pip install triton); use backend=None"
        )
    if not tensor.is_cuda and not process_selector().switches.triton_interpret:
        raise BackendUnavailableError(
            "backend='triton' on CPU tensors runs only in Triton's interpreter: set "
            "TRITON_INTERPRET=1 before importing triton, or use backend=None"
        )


def resolve_attention(backend: str | None, query: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> str:
    """The attention that runs: ``backend`` checked against these tensors, or for None the
    selector's choice for their device, dtypes and head size."""
    if backend is None:
        name = default_attention(query.device.type, query.dtype, k_cache.dtype, query.shape[-1])
        return name if name != "cpp" or kernel_fits(query, k_cache, v_cache) else "sdpa"
    if backend not in ATTENTION:
        raise BackendUnavailableError(f"unknown attention backend {backend!r}; use one of {ATTENTION}")
    if backend == "triton":
        _check_triton(query)
    elif backend == "cpp":
        if process_selector().library() is None:
            raise BackendUnavailableError(
                "backend='cpp' needs the C++ CPU kernels, which do not run here (see the "
                "cpu_ops_unavailable warning); use backend='sdpa' or None"
            )
        if not kernel_fits(query, k_cache, v_cache):
            raise KernelArgumentError(
                "the C++ attention kernel takes CPU float32/float16/bfloat16 queries with head_dim "
                "% 8 == 0 and a contiguous head_dim; use backend='sdpa' for these tensors"
            )
    return backend


def resolve_kv_write(backend: str | None, key: torch.Tensor) -> str:
    """The KV write that runs: ``backend`` checked, or for None Triton on CUDA (when it imports)."""
    if backend is None:
        return "triton" if key.is_cuda and triton_available() else "torch"
    if backend not in KV_WRITE:
        raise BackendUnavailableError(f"unknown KV-write backend {backend!r}; use one of {KV_WRITE}")
    if backend == "triton":
        _check_triton(key)
    return backend


def _check_attention_args(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan
) -> None:
    if query.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise KernelArgumentError(
            "expected query [num_tokens, num_heads, head_dim] and k_cache/v_cache of one shape "
            f"[num_blocks, block_size, num_kv_heads, head_dim]; got {tuple(query.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if not (k_cache.dtype == v_cache.dtype and mixed_ok(query.dtype, k_cache.dtype)) or not (
        query.device == k_cache.device == v_cache.device
    ):
        raise KernelArgumentError(
            f"query ({query.dtype}, {query.device}), k_cache ({k_cache.dtype}, {k_cache.device}) "
            f"and v_cache ({v_cache.dtype}, {v_cache.device}) must share one device, and the "
            "caches the query's dtype (or float16/bfloat16 under a float32 query)"
        )
    num_heads, head_dim = query.shape[1:]
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise KernelArgumentError(
            f"query has {num_heads} heads of dim {head_dim}, cache {num_kv_heads} heads of dim "
            f"{cache_dim}; head dims must match and num_heads be a multiple of num_kv_heads"
        )
    if block_size != plan.block_size:
        raise KernelArgumentError(
            f"the plan was built for block_size={plan.block_size}, the cache has {block_size}"
        )
    if query.shape[0] < plan.num_tokens:
        raise KernelArgumentError(
            f"query has {query.shape[0]} rows, the plan needs num_tokens={plan.num_tokens}"
        )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float | None = None,
    backend: str | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged KV cache.

    query: [num_tokens, num_heads, head_dim]; k_cache/v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim]; block_table int32 [num_seqs, max_blocks]; seq_lens int32 [num_seqs]
    (cached + new tokens); cu_seqlens_q int32 [num_seqs + 1]. Query token ``j`` of sequence ``i``
    sits at position ``seq_lens[i] - q_len_i + j``. Pass ``plan`` (from :func:`plan_attention`,
    built once per step) to skip the per-call index/mask construction; the other metadata
    arguments are then ignored. Returns [num_tokens, num_heads, head_dim] in query's dtype.
    """
    if plan is None:
        plan = plan_attention(block_table, seq_lens, cu_seqlens_q, k_cache.shape[1], device=query.device)
    _check_attention_args(query, k_cache, v_cache, plan)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    name = resolve_attention(backend, query, k_cache, v_cache)
    if name == "triton":
        # optional dependency: triton (x86-64 only; CUDA builds of torch bring it)
        from pagedq.kernels.triton_attention import triton_paged_attention

        if k_cache.dtype != query.dtype:
            raise KernelArgumentError(
                f"the Triton kernel needs the cache in the query's dtype ({query.dtype}), got "
                f"{k_cache.dtype}: use kv_cache_dtype='auto' on CUDA"
            )

        return triton_paged_attention(query, k_cache, v_cache, plan, scale)
    kernel = process_selector().library().paged_attention_rows if name == "cpp" else None
    return torch_paged_attention(query, k_cache, v_cache, plan, scale, kernel)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str | None = None,
) -> None:
    """Store new tokens' K/V [num_tokens, num_kv_heads, head_dim] into the paged cache in place.

    slot_mapping int64 [num_tokens]: slot = block * block_size + offset; -1 marks padding tokens,
    which are skipped.
    """
    if key.shape != value.shape or key.shape[1:] != k_cache.shape[2:]:
        raise KernelArgumentError(
            f"key/value {tuple(key.shape)}/{tuple(value.shape)} do not match the cache's "
            f"[num_kv_heads, head_dim] = {tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.shape[0] != key.shape[0]:
        raise KernelArgumentError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens"
        )
    if resolve_kv_write(backend, key) == "triton":
        from pagedq.kernels.triton_cache import triton_write_kv  # optional dependency: triton

        triton_write_kv(key, value, k_cache, v_cache, slot_mapping)
        return
    torch_write_kv(key, value, k_cache, v_cache, slot_mapping)
