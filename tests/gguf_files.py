"""Real GGUF files of tiny models, written with the ``gguf`` package, in every packed type.

The ``gguf`` package quantizes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 itself; it only dequantizes the
K-quants, so Q4_K, Q5_K and Q6_K blocks are made here (simple min/max fits, valid blocks that the
package's own dequantizer decodes: that is tested). Tensors are named and laid out as llama.cpp's
converter writes them, q/k rows permuted for the ``llama`` architecture included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
ALL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


# --------------------------------------------------------------------------- K-quant blocks


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per super-block -> the 12-byte layout Q4_K/Q5_K store."""
    s = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    s[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    s[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return s


def _affine_k(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """x [nb, 256] -> codes [nb, 8, 32] in 0..levels-1, d, dmin (fp16) and 6-bit sc, mn."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    hi = sub.max(-1)
    scale = np.maximum(hi - lo, 1e-12) / (levels - 1)
    d = _f16(scale.max(-1) / 63)
    dmin = _f16(np.maximum((-lo).max(-1), 1e-12) / 63)
    sc = np.clip(np.round(scale / np.maximum(d.astype(np.float32), 1e-12)[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / np.maximum(dmin.astype(np.float32), 1e-12)[:, None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    step = np.where(step > 0, step, 1)  # an all-zero super-block (an embedding's padding row)
    offset = dmin.astype(np.float32)[:, None] * mn
    codes = np.clip(np.round((sub + offset[..., None]) / step[..., None]), 0, levels - 1).astype(np.uint8)
    return codes, d, dmin, sc, mn


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    codes, d, dmin, sc, mn = _affine_k(x.reshape(-1, 256), 16)
    pairs = codes.reshape(-1, 4, 2, 32)  # chunk j holds sub-blocks 2j (low) and 2j+1 (high)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8),
                           _pack_k_scales(sc, mn), qs], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    codes, d, dmin, sc, mn = _affine_k(x.reshape(-1, 256), 32)
    low = codes & 15
    pairs = low.reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    qh = np.zeros((codes.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= ((codes[:, j] >> 4) & 1) << j
    return np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8),
                           _pack_k_scales(sc, mn), qh, qs], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    groups = x.reshape(-1, 16, 16)
    scale = np.maximum(np.abs(groups).max(-1), 1e-12) / 31
    d = _f16(scale.max(-1) / 127)
    safe_d = np.where(d > 0, d.astype(np.float32), 1)[:, None]
    sc = np.clip(np.round(scale / safe_d), 1, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    step = np.where(step > 0, step, 1)
    q = (np.clip(np.round(groups / step[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    ql = np.zeros((q.shape[0], 128), dtype=np.uint8)
    qh = np.zeros((q.shape[0], 64), dtype=np.uint8)
    for e in range(256):
        half, r = divmod(e, 128)
        quarter, t = divmod(r, 32)
        ql[:, 64 * half + 32 * (quarter % 2) + t] |= (q[:, e] & 15) << (4 * (quarter // 2))
        qh[:, 32 * half + t] |= (q[:, e] >> 4) << (2 * quarter)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.reshape(-1, 1).view(np.uint8)], axis=1)


def fits(type_name: str, k: int) -> str:
    """``type_name``, or Q8_0 where its blocks do not tile a row of ``k`` (as llama-quantize
    falls back to a 32-wide type for such tensors)."""
    return "Q8_0" if type_name in K_QUANTS and k % 256 else type_name


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """A float32 [N, K] matrix -> GGUF blocks [N, row_bytes] of ``type_name``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    n = x.shape[0]
    if type_name in K_QUANTS:
        blocks = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}[type_name](x)
        return blocks.reshape(n, -1)
    return gguf_quantize(x.astype(np.float32), GGMLQuantizationType[type_name])


# --------------------------------------------------------------------------- files

_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    if hf in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf]
    parts = hf.removeprefix("model.layers.").split(".")
    return f"blk.{parts[0]}.{_LAYER_PARTS['.'.join(parts[1:-1])]}.{parts[-1]}"


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row permutation (the inverse of gguf_weights.unpermute_rows)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class BpeVocab:
    """A byte-level BPE tokenizer's metadata as llama.cpp writes it ("gpt2" model): the
    vocabulary and merges of ``tokenizer_dir``'s tokenizer.json, its added tokens as CONTROL,
    ``extra`` tokens appended (``"<think>": 4`` a USER_DEFINED one), the special ids stated and
    the flags set (None: the key left out)."""

    tokenizer_dir: Path
    pre: str = "default"
    extra: dict[str, int] = field(default_factory=dict)
    ids: dict[str, int] = field(default_factory=dict)  # "unknown", "padding" (bos, eos: config)
    add_bos: bool | None = None
    add_eos: bool | None = None
    chat_template: str | None = None

    def write(self, writer) -> None:
        from gguf import TokenType

        data = json.loads((Path(self.tokenizer_dir) / "tokenizer.json").read_text())
        vocab = data["model"]["vocab"]
        tokens = sorted(vocab, key=vocab.get) + list(self.extra)
        added = {t["content"] for t in data["added_tokens"]}
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(tokens)
        writer.add_token_types([self.extra.get(t, TokenType.CONTROL if t in added
                                               else TokenType.NORMAL) for t in tokens])
        writer.add_token_merges([" ".join(m) if isinstance(m, list) else m
                                 for m in data["model"]["merges"]])
        for name, token_id in self.ids.items():
            writer.add_uint32(f"tokenizer.ggml.{name}_token_id", token_id)
        if self.add_bos is not None:
            writer.add_add_bos_token(self.add_bos)
        if self.add_eos is not None:
            writer.add_add_eos_token(self.add_eos)
        if self.chat_template is not None:
            writer.add_chat_template(self.chat_template)


def write_gguf(model_dir: Path, out: Path, weight_type: str = "Q8_0",
               types: dict[str, str] | None = None, vocab: BpeVocab | None = None,
               name: str | None = None) -> Path:
    """Write the safetensors model in ``model_dir`` as a GGUF at ``out``.

    Every 2-D weight gets ``weight_type`` unless ``types`` maps a part of its GGUF name
    (``"ffn_down"``, ``"token_embd"``) to another; 1-D tensors stay F32. Token ids only unless a
    ``vocab`` is given; ``name`` is general.name.
    """
    from gguf import GGMLQuantizationType, GGUFWriter
    from safetensors.torch import load_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    arch = config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = GGUFWriter(str(out), arch)
    if name is not None:
        writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    rope = config.get("rope_parameters") or {}  # transformers 5 nests rope_theta there
    writer.add_rope_freq_base(float(config.get("rope_theta") or rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_bos_token_id(config.get("bos_token_id") or 1)
    writer.add_eos_token_id(config.get("eos_token_id") or 2)
    if vocab is not None:
        vocab.write(writer)
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    for hf, tensor in state.items():
        name = gguf_name(hf)
        data = tensor.float().numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            data = permute_rows(data, heads if ".attn_q." in name else kv_heads)
        chosen = next((t for part, t in (types or {}).items() if part in name), weight_type)
        chosen = fits(chosen, data.shape[-1])
        if data.ndim == 1 or chosen == "F32":
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        else:
            writer.add_tensor(name, quantize(data, chosen), raw_dtype=GGMLQuantizationType[chosen])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def quantized_state(model_dir: Path, weight_type: str) -> dict[str, torch.Tensor]:
    """The float state dict the GGUF of ``weight_type`` stands for (test oracles' weights)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from safetensors.torch import load_file

    state = load_file(str(Path(model_dir) / "model.safetensors"))
    out = {}
    for name, tensor in state.items():
        if tensor.dim() == 1:
            out[name] = tensor.float()
            continue
        chosen = fits(weight_type, tensor.shape[-1])
        blocks = quantize(tensor.float().numpy(), chosen)
        out[name] = torch.from_numpy(dequantize(blocks, GGMLQuantizationType[chosen])).reshape(tensor.shape)
    return out
