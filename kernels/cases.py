"""Random paged-attention batches for tests, ``check.py`` and benchmarks.

Why here and not in tests/: ``python -m pagedq.bench.kernel_check`` builds the same batches on a GPU.
A case scatters every sequence's K/V over randomly permuted physical blocks of a cache whose
unused slots hold NaN (so a kernel that reads them fails loudly), exactly like the engine's
cache after other requests come and go.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("separate", "joint", "interleaved")


@dataclass
class PagedCase:
    """One step's inputs: packed queries plus a paged cache already holding all context K/V.

    ``new_keys``/``new_values`` are the K/V of the query tokens (packed like ``query``) and
    ``slot_mapping`` their slots, for tests that write them with ``write_kv`` themselves.
    """

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    slot_mapping: torch.Tensor
    new_keys: torch.Tensor
    new_values: torch.Tensor

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    def attention_args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.query,
            self.k_cache,
            self.v_cache,
            self.block_table,
            self.seq_lens,
            self.cu_seqlens_q,
        )


def empty_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    layout: str = "separate",
    fill: float = float("nan"),
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches filled with ``fill``.

    layout "separate": two tensors; "joint": ``kv[0]``/``kv[1]`` of one [2, N, B, H, D] tensor;
    "interleaved": ``kv[:, 0]``/``kv[:, 1]`` of [N, 2, B, H, D] (blocks not flattenable).
    """
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if layout == "separate":
        return (
            torch.full(shape, fill, dtype=dtype, device=device),
            torch.full(shape, fill, dtype=dtype, device=device),
        )
    if layout == "joint":
        kv = torch.full((2, *shape), fill, dtype=dtype, device=device)
        return kv[0], kv[1]
    if layout == "interleaved":
        kv = torch.full((num_blocks, 2, *shape[1:]), fill, dtype=dtype, device=device)
        return kv[:, 0], kv[:, 1]
    raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")


def make_case(
    q_lens: list[int],
    context_lens: list[int],
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    layout: str = "separate",
    write_new: bool = True,
    extra_blocks: int = 3,
    seed: int = 0,
) -> PagedCase:
    """Sequence ``i`` has ``context_lens[i]`` cached tokens and ``q_lens[i]`` new ones.

    With ``write_new`` the new tokens' K/V are in the cache too (as after ``write_kv``, which the
    engine calls before attention); otherwise their slots still hold NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, q_lens, strict=True)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_seq, default=0) + 1
    num_blocks = sum(blocks_per_seq) + extra_blocks
    physical = torch.randperm(num_blocks, generator=gen)
    block_table = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        block_table[i, :n] = physical[start : start + n].int()
        start += n
    k_cache, v_cache = empty_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, layout)
    slot_rows, new_rows = [], []
    for i, (ctx, seq_len) in enumerate(zip(context_lens, seq_lens, strict=True)):
        pos = torch.arange(seq_len)
        slots = block_table[i].long()[pos // block_size] * block_size + pos % block_size
        slot_rows.append(slots)
        new_rows.append(slots[ctx:])
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=dev_gen, device=device, dtype=dtype)
    all_slots = torch.cat(slot_rows) if slot_rows else torch.zeros(0, dtype=torch.long)
    is_new = torch.zeros(all_slots.numel(), dtype=torch.bool)
    offset = 0
    for ctx, seq_len in zip(context_lens, seq_lens, strict=True):
        is_new[offset + ctx : offset + seq_len] = True
        offset += seq_len
    keys = randn(all_slots.numel(), num_kv_heads, head_dim)
    values = randn(all_slots.numel(), num_kv_heads, head_dim)
    write = torch.ones_like(is_new) if write_new else ~is_new
    all_slots, write, is_new = all_slots.to(device), write.to(device), is_new.to(device)
    blk, off = all_slots[write] // block_size, all_slots[write] % block_size
    k_cache[blk, off] = keys[write]
    v_cache[blk, off] = values[write]
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    if q_lens:
        cu[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    query = randn(sum(q_lens), num_heads, head_dim)
    return PagedCase(
        query=query,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=cu.to(device),
        slot_mapping=(torch.cat(new_rows) if new_rows else torch.zeros(0, dtype=torch.long)).to(device),
        new_keys=keys[is_new],
        new_values=values[is_new],
    )
