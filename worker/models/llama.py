"""Our forward pass for the Llama family over the paged KV cache.

Llama, Mistral, Qwen2 and Qwen3 differ by a few flags: q/k/v bias (Qwen2), per-head q/k RMSNorm
(Qwen3), tied embeddings. Parameter names follow the Hugging Face checkpoints so weights load
by name; q/k/v and gate/up are fused at load time so each layer is four matmuls.

Every forward handles a packed batch of tokens from many sequences (prefill chunks and decodes
alike): positions say where each token sits, and the attention context says where its KV goes.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedq.errors import EngineError
from pagedq.kernels import paged_attention, write_kv
from pagedq.kernels.cpu_attention import kernel_fits, kernel_rows, kernel_takes

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}
UNSUPPORTED_ROPE = {"dynamic", "longrope"}  # depend on the running length: no static table


class UnsupportedModelError(EngineError):
    """The checkpoint's architecture or options are outside what this forward pass implements."""


@dataclass
class AttentionContext:
    """Per-step attention inputs shared by every layer."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    plan: Any = None  # kernels' per-step plan (indices built once, used by every layer)
    backend: str | None = None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` by the fastest CPU route for this many rows.

    1-16 rows (decode at small batch): the C++ skinny GEMV, which streams each weight row once
    at memory bandwidth. More rows: the oneDNN-prepacked copy when there is one (see
    ``pack_for_cpu``). Otherwise torch's own linear.
    """
    if packed is not None:
        rows = x.shape[0]
        if rows <= SKINNY_MAX_ROWS and _SKINNY["op"] is not None:
            out = x.new_empty((rows, weight.shape[0]))
            _SKINNY["op"](out, x.contiguous(), weight, bias)
            return out
        padded = padded_rows(rows)
        if padded != rows:
            x = torch.cat((x, x.new_zeros(padded - rows, x.shape[1])))
        out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
        return out[:rows]
    return F.linear(x, weight, bias)


def padded_rows(rows: int) -> int:
    """The rows a oneDNN GEMM runs on: ``rows`` rounded up to a bucket (multiples of 16 up to
    128, then eight buckets per doubling: at most 1/8 extra rows).

    Every step's token count would otherwise be a new GEMM shape, and the memory oneDNN and
    glibc keep per shape made a worker's RSS grow by gigabytes over a day of varied prompts;
    a few dozen shapes keep it flat. decoder_layer_cpu.cpp's ``padded_rows`` is the same.
    """
    step = max(16, (1 << (rows.bit_length() - 1)) // 8)
    return -(-rows // step) * step


SKINNY_MAX_ROWS = 16  # kMaxSkinnyRows in kernels/csrc/cpu_ops.h
# C++ CPU ops (pagedq.kernels.cpu_attention), set by pack_for_cpu when the library loads
_SKINNY: dict[str, Any] = {"op": None, "rms_norm": None, "layer": None}
FUSED_SWITCH = "PAGEDQ_FUSED_LAYER"  # "0": keep the per-op Python layer (A/B runs, tests)


def can_pack(weight: torch.Tensor) -> bool:
    """oneDNN prepacking pays on CPU fp32: 2-3x the GEMM throughput of MKL at small batches."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and os.environ.get("PAGEDQ_ONEDNN", "1") != "0")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm: normalise in fp32, scale in the model dtype."""
    if x.dtype == torch.float32:
        op = _SKINNY["rms_norm"]
        if op is not None and x.dim() == 2 and x.is_contiguous() and not x.is_cuda:
            out = torch.empty_like(x)
            op(out, x, weight, eps)  # one C++ pass instead of ATen's six launches
            return out
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_tables(config, max_positions: int, dtype: torch.dtype, device) -> torch.Tensor:
    """cos/sin for every position, from transformers' own RoPE initialisation for this family.

    Returns [max_positions, 2, head_dim] (cos, signed sin), computed in fp32 as transformers
    does.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in UNSUPPORTED_ROPE:
        raise UnsupportedModelError(
            f"RoPE type {rope_type!r} rescales with the running length; use a model with static "
            "RoPE scaling (default, linear, llama3, yarn)"
        )
    module = importlib.import_module(
        f"transformers.models.{config.model_type}.modeling_{config.model_type}"
    )
    rotary_cls = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
    rotary = rotary_cls(config)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * rotary.inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = rotary.attention_scaling
    cos, sin = emb.cos() * scale, emb.sin() * scale
    half = cos.shape[-1] // 2
    sin[:, :half] = -sin[:, :half]  # folds rotate_half's sign into the table (see apply_rope)
    return torch.stack([cos, sin], dim=1).to(dtype=dtype, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/signed_sin: [T, 1, D]. transformers' rotate-half RoPE in three ops.

    rotate_half(x) * sin == roll(x, D/2) * signed_sin, where signed_sin negates the first half.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def fused_layer_op(x: torch.Tensor, ctx: AttentionContext):
    """The C++ all-layers op (``decoder_layers``) when this step can use it, else None.

    It needs CPU fp32 activations (the caches fp32, fp16 or bf16), and every sequence's query
    rows in the paged kernel (decodes and the short chunks ``kernel_takes`` picks); steps with a
    longer prefill chunk keep the Python layer, whose attention uses SDPA for it.
    """
    op = _SKINNY["layer"]
    if op is None or x.dtype != torch.float32 or x.device.type != "cpu" or ctx.plan is None:
        return None
    if os.environ.get(FUSED_SWITCH, "1") == "0" or ctx.backend not in (None, "torch"):
        return None
    k_cache = ctx.kv_caches[0][0]
    query = x.new_empty(0, 1, k_cache.shape[-1])  # stands for the fp32 query rows
    if not kernel_fits(query, k_cache, ctx.kv_caches[0][1]):
        return None
    q_lens, seq_lens = ctx.plan.q_lens, ctx.plan.seq_lens_host
    fits = q_lens and all(kernel_takes(q, s) for q, s in zip(q_lens, seq_lens, strict=True))
    return op if fits else None


class DecoderLayer(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool, dtype,
                 device) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        h, d = config.hidden_size, self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        self.sizes = (q_size, kv_size, kv_size)

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), False)

        self.qkv_proj = param(q_size + 2 * kv_size, h)
        self.qkv_bias = param(q_size + 2 * kv_size) if qkv_bias else None
        self.o_proj = param(h, q_size)
        self.o_bias = param(h) if o_bias else None
        self.q_norm = param(d) if qk_norm else None
        self.k_norm = param(d) if qk_norm else None
        self.gate_up_proj = param(2 * config.intermediate_size, h)
        self.down_proj = param(h, config.intermediate_size)
        self.packed: dict[str, torch.Tensor] = {}  # oneDNN copies of the projections (CPU)
        self.input_layernorm = param(h)
        self.post_attention_layernorm = param(h)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, layer: int,
                ctx: AttentionContext) -> torch.Tensor:
        t = x.shape[0]
        h = rms_norm(x, self.input_layernorm, self.eps)
        qkv = linear(h, self.qkv_proj, self.qkv_bias, self.packed.get("qkv_proj"))
        q_size, kv_size, _ = self.sizes
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, :q_size + kv_size].view(t, heads, self.head_dim)
        v = qkv[:, q_size + kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((rms_norm(qk[:, :self.num_heads], self.q_norm, self.eps),
                            rms_norm(qk[:, self.num_heads:], self.k_norm, self.eps)), dim=1)
        qk = apply_rope(qk, rope[:, 0:1], rope[:, 1:2])  # q and k rotated in one go
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        k_cache, v_cache = ctx.kv_caches[layer]
        write_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, ctx.block_table, ctx.seq_lens, ctx.cu_seqlens_q,
                            scale=self.scale, backend=ctx.backend, plan=ctx.plan)
        x = x + linear(o.reshape(t, -1), self.o_proj, self.o_bias, self.packed.get("o_proj"))
        h = rms_norm(x, self.post_attention_layernorm, self.eps)
        gate, up = linear(h, self.gate_up_proj, None, self.packed.get("gate_up_proj")).chunk(2, dim=-1)
        return x + linear(F.silu(gate).mul_(up), self.down_proj, None, self.packed.get("down_proj"))


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head for one Llama-family checkpoint."""

    def __init__(self, config, dtype: torch.dtype, device, max_positions: int) -> None:
        super().__init__()
        family = config.model_type
        if family not in SUPPORTED:
            raise UnsupportedModelError(
                f"model_type {family!r} is not supported; pagedq runs {sorted(SUPPORTED)}"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {config.hidden_act!r}: only silu is supported")
        if getattr(config, "use_sliding_window", False):
            raise UnsupportedModelError("sliding-window attention is not supported")
        o_bias = bool(getattr(config, "attention_bias", False)) and family != "qwen2"
        qkv_bias = family == "qwen2" or o_bias
        qk_norm = family == "qwen3"
        self.config = config
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.eps = config.rms_norm_eps
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device), False
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, qkv_bias, o_bias, qk_norm, dtype, device)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype, device=device), False)
        self.lm_head = None if self.tied else nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device), False
        )
        self.packed_head: torch.Tensor | None = None
        self._fused_weights: tuple[list, ...] | None = None  # see fused_weights()
        self.register_buffer("rope", rope_tables(config, max_positions, dtype, device), False)

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.layers[0].head_dim

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                ctx: AttentionContext) -> torch.Tensor:
        """Hidden states after the final norm for every packed token: [T, hidden]."""
        x = F.embedding(input_ids, self.embed_tokens)
        rope = self.rope[positions]
        op = fused_layer_op(x, ctx)
        if op is not None:
            kv_heads = self.num_kv_heads
            rows = ctx.plan.derived(
                "cpu_layer_rows", lambda plan: kernel_rows(plan, list(range(plan.num_seqs)), kv_heads)
            )
            first = self.layers[0]
            x = op(x, rope, *self.fused_weights(),
                   [k for k, _ in ctx.kv_caches], [v for _, v in ctx.kv_caches],
                   ctx.slot_mapping.long().contiguous(), rows.block_table, rows.rows,
                   first.num_heads, rows.heads_per_item, rows.grain, SKINNY_MAX_ROWS, first.eps,
                   first.scale)
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x, rope, i, ctx)
        return rms_norm(x, self.norm, self.eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        return linear(hidden, head, None, self.packed_head).float()

    PACKED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")

    # decoder_layers' weight arguments in order; "+" names the layer's oneDNN-packed copy
    FUSED_WEIGHTS = ("input_layernorm", "qkv_proj", "qkv_proj+", "qkv_bias", "q_norm", "k_norm",
                     "o_proj", "o_proj+", "o_bias", "post_attention_layernorm", "gate_up_proj",
                     "gate_up_proj+", "down_proj", "down_proj+")

    def fused_weights(self) -> tuple[list, ...]:
        """One list per FUSED_WEIGHTS entry, one tensor per layer, built once. A list whose
        tensor no layer has (no bias, no q/k norm, no packing) is empty, as the op expects."""
        if self._fused_weights is None:
            def per_layer(name: str) -> list:
                got = [layer.packed.get(name[:-1]) if name.endswith("+") else getattr(layer, name)
                       for layer in self.layers]
                return [] if all(t is None for t in got) else got

            self._fused_weights = tuple(per_layer(name) for name in self.FUSED_WEIGHTS)
        return self._fused_weights

    def pack_for_cpu(self, batch_hint: int = 64) -> None:
        """Prepare the CPU fast paths once: a oneDNN-blocked copy of every projection and the
        LM head (for batched steps) beside the plain weights (for the skinny decode GEMV)."""
        if not can_pack(self.embed_tokens):
            return
        from pagedq.kernels.cpu_attention import skinny_linear_op

        _SKINNY["op"] = skinny_linear_op()
        loaded = _SKINNY["op"] is not None
        _SKINNY["rms_norm"] = torch.ops.pagedq_cpu.rms_norm if loaded else None
        _SKINNY["layer"] = torch.ops.pagedq_cpu.decoder_layers if loaded else None
        pack = torch.ops.mkldnn._reorder_linear_weight
        for layer in self.layers:
            layer.packed = {name: pack(getattr(layer, name).data, batch_hint) for name in self.PACKED}
        self._fused_weights = None
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        self.packed_head = pack(head.data, batch_hint)

    # -- weights --------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; fail loudly on gaps."""
        parts: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            parts[name.removeprefix("model.")] = tensor
        if self.tied:
            parts.pop("lm_head.weight", None)

        def take(key: str) -> torch.Tensor:
            if key not in parts:
                raise UnsupportedModelError(f"checkpoint is missing weight {key!r}")
            return parts.pop(key)

        def put(dst: torch.Tensor, *srcs: torch.Tensor) -> None:
            src = torch.cat(srcs, dim=0) if len(srcs) > 1 else srcs[0]
            if src.shape != dst.shape:
                raise UnsupportedModelError(f"weight shape {tuple(src.shape)} != {tuple(dst.shape)}")
            dst.copy_(src)

        with torch.no_grad():
            put(self.embed_tokens, take("embed_tokens.weight"))
            put(self.norm, take("norm.weight"))
            if not self.tied:
                put(self.lm_head, take("lm_head.weight"))
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                a = p + "self_attn."
                put(layer.qkv_proj, *(take(f"{a}{n}_proj.weight") for n in "qkv"))
                if layer.qkv_bias is not None:
                    put(layer.qkv_bias, *(take(f"{a}{n}_proj.bias") for n in "qkv"))
                put(layer.o_proj, take(a + "o_proj.weight"))
                if layer.o_bias is not None:
                    put(layer.o_bias, take(a + "o_proj.bias"))
                if layer.q_norm is not None:
                    put(layer.q_norm, take(a + "q_norm.weight"))
                    put(layer.k_norm, take(a + "k_norm.weight"))
                m = p + "mlp."
                put(layer.gate_up_proj, take(m + "gate_proj.weight"), take(m + "up_proj.weight"))
                put(layer.down_proj, take(m + "down_proj.weight"))
                put(layer.input_layernorm, take(p + "input_layernorm.weight"))
                put(layer.post_attention_layernorm, take(p + "post_attention_layernorm.weight"))
        if parts:
            raise UnsupportedModelError(f"checkpoint has weights this model does not use: "
                                        f"{sorted(parts)[:5]}")
