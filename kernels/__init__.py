"""pagedq.kernels: the kernel backend selector, paged attention and KV-cache writes.

The engine needs four names::

    backend = select_backend(device, dtype, kv_dtype, head_dim)             # once, at start
    plan = plan_attention(block_table, seq_lens, cu_seqlens_q, block_size)  # once per step
    write_kv(key, value, k_cache, v_cache, slot_mapping, backend.kv_write)  # per layer
    out = paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q,
                          backend=backend.attention, plan=plan)
"""

from pagedq.kernels.attention import paged_attention, write_kv
from pagedq.kernels.backend import (
    Backend,
    BackendUnavailableError,
    LinearChoice,
    Selector,
    Switches,
    select_backend,
)
from pagedq.kernels.cpu_features import ISA_LEVELS, UnsupportedIsaError, cpu_isa_levels
from pagedq.kernels.plan import AttentionPlan, KernelArgumentError, plan_attention
from pagedq.kernels.reference import reference_paged_attention, reference_write_kv

__all__ = [
    "ISA_LEVELS",
    "AttentionPlan",
    "Backend",
    "BackendUnavailableError",
    "KernelArgumentError",
    "LinearChoice",
    "Selector",
    "Switches",
    "UnsupportedIsaError",
    "cpu_isa_levels",
    "paged_attention",
    "plan_attention",
    "reference_paged_attention",
    "reference_write_kv",
    "select_backend",
    "write_kv",
]
