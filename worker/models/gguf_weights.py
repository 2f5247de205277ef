"""A GGUF checkpoint's tensors as the file stores them: packed blocks stay packed.

Tensors come out under Hugging Face names (``model.layers.3.self_attn.q_proj.weight``), so the
forward pass loads a GGUF exactly like a safetensors checkpoint. Each weight is either a
:class:`~pagedq.worker.models.quant.QuantWeight` holding the file's own blocks (the formats the
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

import numpy as np
import torch

from pagedq.logging import get_logger
from pagedq.worker.models.quant import BY_CODE, QuantWeight

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


def _architecture(reader) -> str:
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def _field_int(reader, key: str) -> int | None:
    field = reader.fields.get(key)
    return None if field is None else int(field.parts[field.data[0]][0])


Weight = torch.Tensor | QuantWeight


def gguf_head_dim(path: Path) -> int | None:
    """The attention head size a GGUF states (``<arch>.attention.key_length``), if it does."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return _field_int(reader, f"{_architecture(reader)}.attention.key_length")


def iter_gguf_weights(path: Path, keep_packed: bool = True) -> Iterator[tuple[str, Weight]]:
    """Yield (HF name, weight) for every tensor of the forward pass, one at a time."""
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize

    reader = GGUFReader(str(path))
    arch = _architecture(reader)
    heads = {"q_proj": _field_int(reader, f"{arch}.attention.head_count")}
    heads["k_proj"] = _field_int(reader, f"{arch}.attention.head_count_kv") or heads["q_proj"]
    widened: Counter[str] = Counter()
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            log.info("gguf tensor not used by the forward pass", tensor=tensor.name)
            continue
        code = int(tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGML lists the fastest dim first
        if code in FLOAT_TYPES:
            weight = torch.from_numpy(np.array(tensor.data)).reshape(shape)
        elif keep_packed and code in BY_CODE and len(shape) == 2:
            weight = QuantWeight(BY_CODE[code], torch.from_numpy(np.array(tensor.data)), shape)
        else:
            widened[tensor.tensor_type.name] += 1
            weight = torch.from_numpy(gguf_dequantize(tensor.data, tensor.tensor_type)).reshape(shape)
        proj = name.split(".")[-2]
        if arch in PERMUTED_ARCHITECTURES and proj in heads and heads[proj]:
            order = unpermute_rows(shape[0], heads[proj])
            weight = weight.rows(order) if isinstance(weight, QuantWeight) else weight[order]
        yield name, weight
    for type_name, count in sorted(widened.items()):
        log.info("gguf tensors widened to float (no packed kernel for this type)", type=type_name,
                 tensors=count, gguf=str(path), packed=keep_packed)
