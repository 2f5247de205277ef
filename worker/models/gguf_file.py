"""A GGUF file's tensor index and scalar metadata, read without building the rest.

The ``gguf`` package's GGUFReader parses every metadata field into NumPy views, including the
tokenizer's ~100k vocabulary and merge strings, and maps the whole file: for the bundled
135M model that is ~160 MB of Python objects, plus the mapped pages, held while the weights
load. Loading needs only the tensor table and a few integers, so this reader walks the header
once (strings and arrays are skipped by their lengths, never decoded), keeps the scalars, and
reads each tensor's bytes with one ``readinto`` into the tensor that keeps them: no mapping, no
second copy. The format is GGUF v2/v3 (little-endian), as llama.cpp's ``gguf.md`` describes it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from pagedq.errors import ModelNotFoundError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> struct format of a scalar (STRING=8 and ARRAY=9 are read apart)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
Value = int | float | bool | str | list


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: ``shape`` slowest dimension first (PyTorch order), ``code``
    its GGML type id, ``offset`` and ``nbytes`` where its bytes lie in the file."""

    name: str
    shape: tuple[int, ...]
    code: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class GGUFIndex:
    """The scalar metadata (arrays, such as the vocabulary, are left out unless asked for:
    then they are lists) and the tensors."""

    path: Path
    metadata: dict[str, Value]
    tensors: list[TensorInfo]

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def arch_int(self, key: str) -> int | None:
        """``<architecture>.<key>`` as an int, None when the file does not state it."""
        value = self.metadata.get(f"{self.architecture}.{key}")
        return None if value is None else int(value)

    def read(self, info: TensorInfo, fh: BinaryIO, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor's bytes from ``fh`` (this file, opened binary) as a uint8 tensor: ``out``
        (``info.nbytes`` of uint8, e.g. from a huge-page arena) or a new one."""
        out = torch.empty(info.nbytes, dtype=torch.uint8) if out is None else out
        fh.seek(info.offset)
        if fh.readinto(out.numpy()) != info.nbytes:
            raise ModelNotFoundError(f"{self.path} is truncated: tensor {info.name!r} runs past "
                                     "its end; download the file again.")
        return out


class _Cursor:
    """Reads little-endian values from a file, keeping its position."""

    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh

    def unpack(self, fmt: str) -> int | float | bool:
        size = struct.calcsize(fmt)
        data = self.fh.read(size)
        if len(data) != size:
            raise ValueError("unexpected end of file in the GGUF header")
        return struct.unpack(fmt, data)[0]

    def string(self) -> str:
        return self.fh.read(int(self.unpack("<Q"))).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        self.fh.seek(int(self.unpack("<Q")), 1)

    def value(self, kind: int, keep_array: bool = False) -> Value | None:
        """A metadata value: scalars and strings are returned, arrays skipped (None) unless
        ``keep_array``."""
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            if keep_array:
                return self.array()
            self.skip_array()
            return None
        return self.unpack(SCALARS[kind])

    def array(self) -> list:
        kind, count = int(self.unpack("<I")), int(self.unpack("<Q"))
        if kind in SCALARS:
            fmt = SCALARS[kind]
            data = self.fh.read(count * struct.calcsize(fmt))
            return list(struct.unpack(f"<{count}{fmt[1:]}", data))
        return [self.value(kind, keep_array=True) for _ in range(count)]

    def skip_array(self) -> None:
        kind, count = int(self.unpack("<I")), int(self.unpack("<Q"))
        if kind in SCALARS:
            self.fh.seek(count * struct.calcsize(SCALARS[kind]), 1)
            return
        for _ in range(count):
            if kind == STRING:
                self.skip_string()
            else:
                self.value(kind)


def read_index(path: Path, arrays: tuple[str, ...] = ()) -> GGUFIndex:
    """The index of the GGUF at ``path``, with the metadata arrays named in ``arrays`` read as
    lists (the others are skipped); raises ModelNotFoundError for a file that is not GGUF
    v2/v3."""
    path = Path(path)
    with open(path, "rb") as fh:
        cur = _Cursor(fh)
        try:
            if fh.read(4) != MAGIC:
                raise ValueError("no GGUF magic")
            version = int(cur.unpack("<I"))
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (pagedq reads 2 and 3)")
            n_tensors, n_fields = int(cur.unpack("<Q")), int(cur.unpack("<Q"))
            metadata = {}
            for _ in range(n_fields):
                key = cur.string()
                value = cur.value(int(cur.unpack("<I")), keep_array=key in arrays)
                if value is not None:
                    metadata[key] = value
            raw = [_tensor_entry(cur) for _ in range(n_tensors)]
            alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
            start = -(-fh.tell() // alignment) * alignment
        except (ValueError, KeyError, struct.error) as exc:
            raise ModelNotFoundError(f"{path} is not a readable GGUF file ({exc}); pass a "
                                     "GGUF v2/v3 file or a Hugging Face directory.") from exc
    tensors = [TensorInfo(name, shape, code, start + offset, _nbytes(shape, code))
               for name, shape, code, offset in raw]
    return GGUFIndex(path, metadata, tensors)


def _tensor_entry(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string()
    dims = [int(cur.unpack("<Q")) for _ in range(int(cur.unpack("<I")))]
    code, offset = int(cur.unpack("<I")), int(cur.unpack("<Q"))
    return name, tuple(reversed(dims)), code, offset  # GGML lists the fastest dimension first


def _nbytes(shape: tuple[int, ...], code: int) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(code)]
    elements = 1
    for d in shape:
        elements *= d
    return elements // block * size
