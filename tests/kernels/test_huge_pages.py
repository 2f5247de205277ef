"""The huge-page arena: what it hands out, that the tensors outlive it, and (where this Linux
gives huge pages) that the kernel backs it with them, read from /proc/self/smaps."""

from __future__ import annotations

import gc

import pytest
import torch

from pagedq.kernels.huge_pages import (
    ALIGN,
    HUGE_PAGE,
    MIN_TENSOR_BYTES,
    Arena,
    huge_pages_available,
    mapping_huge_bytes,
    on_huge_pages,
    onto,
    thp_mode,
)


@pytest.mark.parametrize(("text", "mode"), [("always [madvise] never\n", "madvise"),
                                            ("[always] madvise never\n", "always"),
                                            ("always madvise [never]\n", "never"),
                                            ("garbage\n", "unsupported")])
def test_thp_mode_reads_the_bracketed_setting(tmp_path, text, mode):
    path = tmp_path / "enabled"
    path.write_text(text)
    assert thp_mode(path) == mode


def test_thp_mode_without_the_setting_is_unsupported(tmp_path):
    assert thp_mode(tmp_path / "missing") == "unsupported"


def test_mapping_huge_bytes_reads_the_entry_holding_the_address(tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text("1000-2000 rw-p 00000000 00:00 0\nAnonHugePages:        4 kB\n"
                     "200000-600000 rw-p 00000000 00:00 0\nRss: 4096 kB\n"
                     "AnonHugePages:     4096 kB\n")
    assert mapping_huge_bytes(0x300000, smaps) == 4096 * 1024
    assert mapping_huge_bytes(0x1800, smaps) == 4096
    assert mapping_huge_bytes(0x900000, smaps) == 0
    assert mapping_huge_bytes(0x300000, tmp_path / "missing") == 0


@pytest.mark.parametrize("enabled", [True, False])
def test_tensors_are_aligned_disjoint_and_outlive_the_arena(enabled):
    arena = Arena(3 * 2**20, enabled=enabled)
    sizes = [1000, 3, 2**20, 77]
    parts = [arena.empty(n) for n in sizes]
    for i, (part, n) in enumerate(zip(parts, sizes, strict=True)):
        assert part.dtype == torch.uint8 and part.numel() == n
        assert part.data_ptr() % ALIGN == 0
        part.fill_(i + 1)
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel()) for p in parts)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    if arena.enabled:  # carved from one mapping, in order
        assert [p.data_ptr() for p in parts] == sorted(p.data_ptr() for p in parts)
        assert arena.used <= arena.capacity and arena.capacity % HUGE_PAGE == 0
    del arena
    gc.collect()
    torch.empty(64 * 2**20, dtype=torch.uint8).fill_(0)  # reuse any freed memory
    for i, part in enumerate(parts):
        assert bool((part == i + 1).all())


def test_an_arena_out_of_room_hands_out_torch_memory():
    arena = Arena(4096)
    first = arena.empty(4096)
    spill = arena.empty(10 * HUGE_PAGE)  # past the capacity: a plain tensor, still usable
    spill.fill_(3)
    assert first.numel() == 4096 and int(spill.sum()) == 3 * 10 * HUGE_PAGE


@pytest.mark.skipif(not huge_pages_available(),
                    reason=f"this kernel gives no transparent huge pages (mode {thp_mode()})")
def test_the_kernel_backs_the_arena_with_huge_pages():
    arena = Arena(8 * HUGE_PAGE)
    assert arena.enabled
    arena.empty(8 * HUGE_PAGE).fill_(1)  # fault every page in
    assert arena.huge_bytes() >= 4 * HUGE_PAGE, "THP granted no huge page to the advised mapping"


def test_a_disabled_arena_maps_nothing():
    arena = Arena(8 * HUGE_PAGE, enabled=False)
    assert not arena.enabled and arena.huge_bytes() == 0
    assert arena.empty(100).numel() == 100


class Holder:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.data = tensor


def test_onto_moves_each_slot_in_place_and_leaves_the_rest():
    """Attribute, list entry and a Parameter's .data are swapped for equal copies on one new
    arena; a small tensor, a non-contiguous one and one already on an arena stay put."""
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(MIN_TENSOR_BYTES // 4 + 5, generator=gen)
    param = torch.nn.Parameter(torch.randn(128, MIN_TENSOR_BYTES // 256, generator=gen), False)
    listed = [torch.randint(0, 255, (MIN_TENSOR_BYTES,), dtype=torch.uint8, generator=gen)]
    small = torch.randn(10, generator=gen)
    strided = torch.randn(512, MIN_TENSOR_BYTES // 1024, generator=gen).t()
    resident = Arena(MIN_TENSOR_BYTES).empty(MIN_TENSOR_BYTES).fill_(5)
    holders = [Holder(big), Holder(small), Holder(strided), Holder(resident)]
    want = [big.clone(), param.data.clone(), listed[0].clone(), small, strided, resident]
    arena = onto([(holders[0], "data"), (param, "data"), (listed, 0), (holders[1], "data"),
                  (holders[2], "data"), (holders[3], "data")])
    got = [holders[0].data, param.data, listed[0], holders[1].data, holders[2].data,
           holders[3].data]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
    assert holders[1].data is small and holders[2].data is strided and holders[3].data is resident
    if arena.enabled:
        assert all(on_huge_pages(t) for t in got[:3])
        assert isinstance(param, torch.nn.Parameter) and param.data_ptr() == got[1].data_ptr()


def test_onto_disabled_moves_nothing():
    big = Holder(torch.randn(MIN_TENSOR_BYTES, dtype=torch.float32))
    before = big.data
    assert not onto([(big, "data")], enabled=False).enabled and big.data is before
