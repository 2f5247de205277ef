"""A model's weights on transparent huge pages.

Why: a decode step streams every weight once. On 4 KiB pages each 4 KiB of weights costs a TLB
miss and a page walk, and under a hypervisor (nested paging: most cloud machines) a walk is
several memory reads of its own. On a KVM guest (Intel Xeon, CPU model 167, 2 threads) a plain
read streamed 23 GB/s from 4 KiB pages and 29 GB/s from 2 MiB pages, and one stream of the
1.7B-shape Q8_0 model decoded 13.2-13.6 tok/s with its weights on 4 KiB pages against 14.6-15.2
on huge pages, the bundled model in fp32 30-33 against 40-41 (docs/quantization.md, "Weights on
huge pages"). The KV cache stays on torch's pages: on huge pages it measured level at 64
streams (attention reads whole blocks, far fewer pages a step than the weights).

Linux gives a process huge pages in two modes (``/sys/kernel/mm/transparent_hugepage/enabled``):
``always``, and ``madvise`` (Debian's and Ubuntu's default), where only memory that asks gets
them: an anonymous private mapping advised ``MADV_HUGEPAGE``. torch's allocator does not ask.
Its own switch, ``THP_MEM_ALLOC_ENABLE=1``, asks for every allocation of 2 MiB or more,
transient activations included, and measured slower at 64 streams (each fresh buffer faults and
zeroes whole 2 MiB pages), so only the weights, which live as long as the model, come here: a
GGUF's packed blocks are read straight into an arena (gguf_weights.py), every other form is
moved onto one after loading (:func:`onto`).

An :class:`Arena` is one such mapping, carved into tensors by a bump pointer: a model's many
small matrices share its huge pages instead of each rounding up to 2 MiB. Each tensor keeps the
mapping alive (the buffer protocol), so it is unmapped when the last one is freed. Where huge
pages are unavailable (``never``, not Linux, an ``mmap`` refused) the arena hands out ordinary
torch tensors, and the model runs as before.
"""

from __future__ import annotations

import mmap
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedq.logging import get_logger

log = get_logger(__name__)

HUGE_PAGE = 2 * 2**20  # x86-64's PMD-sized page, the only size transparent huge pages use there
ALIGN = 64  # every tensor starts on a cache line (the kernels' vector loads)
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MIN_TENSOR_BYTES = 64 * 2**10  # smaller tensors (norms, biases) are not worth a copy
# Address ranges of every arena this process mapped, never removed: a range unmapped and
# reused by torch at worst makes on_huge_pages() answer yes for a tensor there, which only
# spares it a copy onto huge pages.
_MAPPED: list[tuple[int, int]] = []


def thp_mode(path: Path = THP_ENABLED) -> str:
    """The kernel's transparent huge page mode: ``always``, ``madvise`` or ``never``;
    ``unsupported`` where there is no such setting (not Linux, a kernel built without THP)."""
    try:
        found = re.search(r"\[(\w+)\]", path.read_text())
    except OSError:
        return "unsupported"
    return found.group(1) if found else "unsupported"


def huge_pages_available() -> bool:
    """Whether an advised mapping can get huge pages here."""
    return sys.platform == "linux" and hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in (
        "always", "madvise")


@dataclass
class Arena:
    """A bump allocator over one anonymous mapping advised for huge pages.

    ``capacity``: the bytes it can hand out (rounded up to whole huge pages). ``enabled``
    False, or huge pages unavailable, makes :meth:`empty` return plain torch tensors."""

    capacity: int
    enabled: bool = True
    used: int = 0
    _buffer: torch.Tensor | None = field(default=None, repr=False)
    _mapping: mmap.mmap | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not (self.enabled and self.capacity > 0 and huge_pages_available()):
            self.enabled = False
            return
        size = -(-self.capacity // HUGE_PAGE) * HUGE_PAGE
        try:
            # one huge page of slack: the mapping starts page-aligned, not 2 MiB-aligned
            self._mapping = mmap.mmap(-1, size + HUGE_PAGE,
                                      flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._mapping.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, ValueError) as exc:
            log.info("huge pages refused; weights stay on ordinary pages", error=str(exc))
            self.enabled, self._mapping = False, None
            return
        whole = torch.frombuffer(self._mapping, dtype=torch.uint8)
        start = -whole.data_ptr() % HUGE_PAGE
        self._buffer = whole[start:start + size]
        self.capacity = size
        _MAPPED.append((self._buffer.data_ptr(), self._buffer.data_ptr() + size))

    def empty(self, nbytes: int) -> torch.Tensor:
        """An uninitialised uint8 tensor of ``nbytes``: from the mapping while it has room,
        else from torch (a model larger than its arena still loads)."""
        begin = -(-self.used // ALIGN) * ALIGN
        if self._buffer is None or begin + nbytes > self.capacity:
            return torch.empty(nbytes, dtype=torch.uint8)
        self.used = begin + nbytes
        return self._buffer[begin:self.used]

    def huge_bytes(self) -> int:
        """Bytes of the mapping the kernel backs with huge pages now (``AnonHugePages`` of its
        entry in /proc/self/smaps); 0 without a mapping or where smaps is unreadable."""
        if self._buffer is None:
            return 0
        return mapping_huge_bytes(self._buffer.data_ptr())


def on_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lies in an arena's mapping (read there, or copied by :func:`onto`)."""
    at = tensor.data_ptr()
    return any(start <= at < end for start, end in _MAPPED)


# Where a tensor lives: (holder, attribute name) or (list, index); onto() swaps it there.
Slot = tuple[Any, str | int]


def onto(slots: list[Slot], enabled: bool = True) -> Arena:
    """Move the tensors at ``slots`` onto one new arena, in place: each slot is set to a copy
    on huge pages (same dtype, shape and values) before the next is copied, so the original
    is freed as it goes and the peak is the arena and one tensor. For weights that were not
    read into an arena (GGUF reads are, huge_pages in gguf_weights.py); those already on one,
    those under :data:`MIN_TENSOR_BYTES` and non-contiguous ones stay where they are."""
    def get(slot: Slot) -> torch.Tensor:
        holder, key = slot
        return holder[key] if isinstance(key, int) else getattr(holder, key)

    def wanted(t: torch.Tensor) -> bool:
        return (t.device.type == "cpu" and t.is_contiguous() and not on_huge_pages(t)
                and _nbytes(t) >= MIN_TENSOR_BYTES)

    moving = [slot for slot in slots if wanted(get(slot))]
    arena = Arena(sum(_nbytes(get(s)) + ALIGN for s in moving), enabled=enabled)
    if not arena.enabled:
        return arena
    for holder, key in moving:
        t = get((holder, key))
        copy = arena.empty(_nbytes(t)).view(t.dtype).view(t.shape).copy_(t)
        if isinstance(key, int):
            holder[key] = copy
        else:
            setattr(holder, key, copy)
    return arena


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def mapping_huge_bytes(address: int, smaps: Path = Path("/proc/self/smaps")) -> int:
    """``AnonHugePages`` in bytes of the mapping holding ``address`` (0 if none or unreadable)."""
    try:
        lines = smaps.read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0
