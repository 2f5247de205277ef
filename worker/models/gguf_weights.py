"""A GGUF checkpoint's tensors as the file stores them: packed blocks stay packed.

Tensors come out under Hugging Face names (``model.layers.3.self_attn.q_proj.weight``), so the
forward pass loads a GGUF exactly like a safetensors checkpoint. Each weight is either a
:class:`~pagedq.kernels.block_formats.QuantWeight` holding the file's own blocks (the formats the
kernels read, when ``keep_packed``) or a float tensor (F32/F16/BF16 tensors, and every packed type
the kernels do not read, widened with one log line per type).

llama.cpp's converter permutes the rows of q and k for its RoPE layout on the ``llama``
architecture (Llama, Mistral); rows are independent in every block format, so the inverse
permutation is applied to packed rows as it is to float ones (as transformers does when it
dequantizes a GGUF).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from pagedq.kernels.block_formats import BY_CODE, QuantWeight
from pagedq.kernels.huge_pages import ALIGN, Arena
from pagedq.logging import get_logger
from pagedq.worker.models.gguf_file import TensorInfo, read_index

log = get_logger(__name__)

TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
PERMUTED_ARCHITECTURES = ("llama",)  # q/k rows permuted by llama.cpp's converter
FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # GGML F32, F16, BF16
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for tensors the forward pass does not use
    (e.g. ``rope_freqs``, which it recomputes from the config)."""
    match = _LAYER.match(gguf_name)
    if match:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{PER_LAYER[part]}.{kind}" if part in PER_LAYER else None
    stem, _, kind = gguf_name.rpartition(".")
    return f"{TOP_LEVEL[stem]}.{kind}" if stem in TOP_LEVEL else None


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order undoing llama.cpp's q/k permutation for ``heads`` heads of ``rows / heads``."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(-1)


Weight = torch.Tensor | QuantWeight


def iter_gguf_weights(path: Path, keep_packed: bool = True,
                      huge_pages: bool = False) -> Iterator[tuple[str, Weight]]:
    """Yield (HF name, weight) for every tensor of the forward pass, one at a time, each read
    from the file into the tensor that keeps it (gguf_file.py says why not GGUFReader).
    ``huge_pages``: the packed weights are read into one huge-page arena (huge_pages.py), where
    they stay: the q/k rows are unpermuted in place."""
    index = read_index(path)
    heads = {"q_proj": index.arch_int("attention.head_count")}
    heads["k_proj"] = index.arch_int("attention.head_count_kv") or heads["q_proj"]
    permuted = index.architecture in PERMUTED_ARCHITECTURES
    widened: Counter[str] = Counter()
    kept = [i for i in index.tensors if hf_name(i.name) and keep_packed and _packed(i)]
    arena = Arena(sum(i.nbytes + ALIGN for i in kept), enabled=huge_pages)
    with open(path, "rb") as fh:
        for info in index.tensors:
            name = hf_name(info.name)
            if name is None:
                log.info("gguf tensor not used by the forward pass", tensor=info.name)
                continue
            out = arena.empty(info.nbytes) if keep_packed and _packed(info) else None
            weight = _weight(info, index.read(info, fh, out), keep_packed, widened)
            proj = name.split(".")[-2]
            if permuted and proj in heads and heads[proj]:
                weight = _unpermuted(weight, unpermute_rows(info.shape[0], heads[proj]))
            yield name, weight
    if arena.enabled:
        log.info("packed weights on transparent huge pages", bytes=arena.used,
                 huge_bytes=arena.huge_bytes())
    for type_name, count in sorted(widened.items()):
        log.info("gguf tensors widened to float (no packed kernel for this type)", type=type_name,
                 tensors=count, gguf=str(path), packed=keep_packed)


def _packed(info: TensorInfo) -> bool:
    """Whether the tensor stays packed blocks (a QuantWeight) when the kernels read its type."""
    return info.code in BY_CODE and len(info.shape) == 2


def _unpermuted(weight: Weight, order: torch.Tensor) -> Weight:
    """The rows of q or k in ``order``: a packed weight's rewritten in place (it keeps the
    memory it was read into, a huge-page arena's), a float one's as a new tensor."""
    if isinstance(weight, QuantWeight):
        weight.data.copy_(weight.data[order])
        return weight
    return weight[order]


def _weight(info: TensorInfo, raw: torch.Tensor, keep_packed: bool,
            widened: Counter[str]) -> Weight:
    """One tensor's bytes as the forward pass takes it: float types as floats, the formats the
    kernels read as a QuantWeight (``keep_packed``), any other type dequantized by ``gguf``."""
    if info.code in FLOAT_TYPES:
        return raw.view(FLOAT_TYPES[info.code]).reshape(info.shape)
    if keep_packed and _packed(info):
        return QuantWeight(BY_CODE[info.code], raw.view(info.shape[0], -1), info.shape)
    qtype = GGMLQuantizationType(info.code)
    widened[qtype.name] += 1
    rows = raw.numpy().reshape(-1, info.nbytes // max(1, _rows(info.shape)))
    return torch.from_numpy(gguf_dequantize(rows, qtype)).reshape(info.shape)


def _rows(shape: tuple[int, ...]) -> int:
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows
