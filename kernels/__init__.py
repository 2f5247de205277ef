"""pagedq.kernels: paged attention and KV-cache writes (Triton on CUDA, plain PyTorch elsewhere).

The engine needs three names::

    plan = plan_attention(block_table, seq_lens, cu_seqlens_q, block_size)  # once per step
    write_kv(key, value, k_cache, v_cache, slot_mapping)                    # per layer
    out = paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, plan=plan)
"""

from pagedq.kernels.attention import (
    BackendUnavailableError,
    paged_attention,
    resolve_backend,
    write_kv,
)
from pagedq.kernels.plan import AttentionPlan, KernelArgumentError, plan_attention
from pagedq.kernels.reference import reference_paged_attention, reference_write_kv

__all__ = [
    "AttentionPlan",
    "BackendUnavailableError",
    "KernelArgumentError",
    "paged_attention",
    "plan_attention",
    "reference_paged_attention",
    "reference_write_kv",
    "resolve_backend",
    "write_kv",
]
