"""Our forward pass for the Llama family over the paged KV cache.

Llama, Mistral, Qwen2 and Qwen3 differ by a few flags: q/k/v bias (Qwen2), per-head q/k RMSNorm
(Qwen3), tied embeddings. Parameter names follow the Hugging Face checkpoints so weights load
by name; q/k/v and gate/up are fused at load time so each layer is four matmuls.

Every forward handles a packed batch of tokens from many sequences (prefill chunks and decodes
alike): positions say where each token sits, and the attention context says where its KV goes.
Which kernels run is the :class:`~pagedq.kernels.backend.KernelPlan` the model is built from
(pagedq.worker.models.build) and packed for (:meth:`CausalLM.use_kernels`): its backend, the
linear of the float weights, the route of each packed format, resolved once; the model asks it
and nothing else.

Weights are either float parameters or, when the checkpoint's matrices arrive packed
(:class:`~pagedq.kernels.block_formats.QuantWeight`: GGUF blocks, int8/int4, bf16 rows), packed
projections (:mod:`pagedq.worker.models.packed`) that never widen them; the embedding then looks
up and dequantizes only the rows a step needs, and a tied LM head reads the same blocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedq.errors import EngineError
from pagedq.kernels import Backend, LinearChoice, paged_attention, write_kv
from pagedq.kernels.backend import KernelPlan
from pagedq.kernels.block_formats import QuantWeight, dequantize, weight_nbytes
from pagedq.kernels.cpu_attention import kernel_rows, kernel_takes_step
from pagedq.kernels.huge_pages import Slot
from pagedq.worker.models.packed import Segment, build_projection, segment_format
from pagedq.worker.models.packed_embedding import PackedEmbedding

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3"}
UNSUPPORTED_ROPE = {"dynamic", "longrope"}  # depend on the running length: no static table
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # a layer's matmuls


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
    backend: str | None = None  # an attention for this step other than the model's (tests)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: Backend) -> torch.Tensor:
    """Hugging Face's RMSNorm: normalise in fp32, scale in the model dtype."""
    if x.dtype == torch.float32:
        if backend.norm == "cpp" and x.dim() == 2 and x.is_contiguous():
            out = torch.empty_like(x)
            backend.ops.rms_norm(out, x, weight, eps)  # one C++ pass instead of ATen's six launches
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
    inv_freq, scale = rope_frequencies(config, rope_type)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    half = cos.shape[-1] // 2
    sin[:, :half] = -sin[:, :half]  # folds rotate_half's sign into the table (see apply_rope)
    return torch.stack([cos, sin], dim=1).to(dtype=dtype, device=device)


def rope_frequencies(config, rope_type: str) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention scaling) as the family's ``*RotaryEmbedding`` computes them: its
    ``compute_default_rope_parameters`` for "default" (the same formula in Llama, Mistral, Qwen2
    and Qwen3), transformers' ROPE_INIT_FUNCTIONS for the scaled types. Importing the modeling
    module for its rotary class would load the whole PyTorch model code (~60-200 MB resident)
    for these few lines."""
    # transformers costs ~3 s to import: the engine package imports this module long before
    # a model loads (the worker's service, the CLI's parser)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS.get(rope_type)  # transformers 4.x also lists "default"
    if init is not None:
        return init(config, None)
    if rope_type != "default":
        raise UnsupportedModelError(f"RoPE type {rope_type!r} is unknown to this transformers")
    params = getattr(config, "rope_parameters", None) or {}
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    dim = head_dim(config)
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/signed_sin: [T, 1, D]. transformers' rotate-half RoPE in three ops.

    rotate_half(x) * sin == roll(x, D/2) * signed_sin, where signed_sin negates the first half.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def head_dim(config) -> int:
    """The width of one attention head (the config's, else hidden size over heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderLayer(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool, dtype,
                 plan: KernelPlan) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = head_dim(config)
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        h, d = config.hidden_size, self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        self.sizes = (q_size, kv_size, kv_size)

        def param(*shape):  # allocated when a float weight arrives (load_weights)
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device="meta"), False)

        self.qkv_proj = param(q_size + 2 * kv_size, h)
        self.qkv_bias = param(q_size + 2 * kv_size) if qkv_bias else None
        self.o_proj = param(h, q_size)
        self.o_bias = param(h) if o_bias else None
        self.q_norm = param(d) if qk_norm else None
        self.k_norm = param(d) if qk_norm else None
        self.gate_up_proj = param(2 * config.intermediate_size, h)
        self.down_proj = param(h, config.intermediate_size)
        self.packed: dict[str, torch.Tensor] = {}  # the linear's prepacked copies (oneDNN)
        self.segments: dict[str, list[Segment]] = {}  # packed weights per projection (PROJECTIONS)
        self.projections: dict[str, Any] = {}  # their runtime objects, built by use_kernels
        self.backend = plan.backend  # CausalLM.use_kernels sets these two again
        self.linear = plan.linear
        self.input_layernorm = param(h)
        self.post_attention_layernorm = param(h)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, layer: int,
                ctx: AttentionContext) -> torch.Tensor:
        t = x.shape[0]
        backend = self.backend
        h = rms_norm(x, self.input_layernorm, self.eps, backend)
        qkv = self.project("qkv_proj", h, self.qkv_bias)
        q_size, kv_size, _ = self.sizes
        heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, :q_size + kv_size].view(t, heads, self.head_dim)
        v = qkv[:, q_size + kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((rms_norm(qk[:, :self.num_heads], self.q_norm, self.eps, backend),
                            rms_norm(qk[:, self.num_heads:], self.k_norm, self.eps, backend)), dim=1)
        qk = apply_rope(qk, rope[:, 0:1], rope[:, 1:2])  # q and k rotated in one go
        q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        k_cache, v_cache = ctx.kv_caches[layer]
        write_kv(k, v, k_cache, v_cache, ctx.slot_mapping, backend.kv_write)
        o = paged_attention(q, k_cache, v_cache, ctx.block_table, ctx.seq_lens, ctx.cu_seqlens_q,
                            scale=self.scale, backend=ctx.backend or backend.attention, plan=ctx.plan)
        x = x + self.project("o_proj", o.reshape(t, -1), self.o_bias)
        h = rms_norm(x, self.post_attention_layernorm, self.eps, backend)
        gate, up = self.project("gate_up_proj", h).chunk(2, dim=-1)
        return x + self.project("down_proj", F.silu(gate).mul_(up))

    def project(self, name: str, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` for projection ``name``: its packed runtime object (which holds
        the bias) or the backend's linear over the float weight."""
        packed = self.projections.get(name)
        if packed is not None:
            return packed.forward(x)
        return self.linear(x, getattr(self, name), bias, self.packed.get(name))

    def use_kernels(self, plan: KernelPlan, device: torch.device) -> int:
        """Build this layer's projections for ``plan``: a packed one into its format's route
        (bias included), a float one beside the copy the plan's linear reads (oneDNN's blocked
        layout for batched CPU fp32 steps; the skinny GEMV streams the plain weight). Returns
        the bytes of the packed segments and of those copies (the float weights are the
        model's parameters)."""
        self.backend, self.linear = plan.backend, plan.linear
        bias = {"qkv_proj": self.qkv_bias, "o_proj": self.o_bias}
        self.projections = {name: build_projection(segs, bias.get(name), plan.packed, device)
                            for name, segs in self.segments.items()}
        packed = {name: self.linear.prepack(getattr(self, name).data) for name in PROJECTIONS
                  if name not in self.segments}
        self.packed = {name: p for name, p in packed.items() if p is not None}
        return sum(weight_nbytes(w) for w in [*self.packed.values(),
                                              *(s for segs in self.segments.values() for s in segs)])


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head for one Llama-family checkpoint."""

    def __init__(self, config, plan: KernelPlan, device, max_positions: int) -> None:
        """The model's layers with empty (meta) weights in the plan's dtype, the compute dtype;
        :meth:`load_weights` places the weights, :meth:`use_kernels` packs them."""
        super().__init__()
        dtype = plan.backend.dtype
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
        self.device = torch.device(device)
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device="meta"), False
        )
        self.backend = plan.backend
        self.layers = nn.ModuleList(
            DecoderLayer(config, qkv_bias, o_bias, qk_norm, dtype, plan)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = nn.Parameter(torch.empty(config.hidden_size, dtype=dtype, device="meta"), False)
        self.lm_head = None if self.tied else nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device="meta"), False
        )
        self.embed_packed: QuantWeight | None = None  # the embedding's packed rows, if packed
        self._embed_rows: PackedEmbedding | None = None  # their dequantized rows, as used
        self.head_packed: QuantWeight | None = None  # an untied LM head's, if packed
        self.head_projection: Any = None  # the packed head's runtime object (use_kernels)
        self.head_linear: LinearChoice = plan.linear
        self.packed_head: torch.Tensor | None = None
        self.weight_bytes = 0  # what the weights take in memory, counted by use_kernels
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
        x = self.embed(input_ids)
        rope = self.rope[positions]
        if self.fused_step(ctx):
            kv_heads = self.num_kv_heads
            rows = ctx.plan.derived(
                "cpu_layer_rows", lambda plan: kernel_rows(plan, list(range(plan.num_seqs)), kv_heads)
            )
            first = self.layers[0]
            caches = ([k for k, _ in ctx.kv_caches], [v for _, v in ctx.kv_caches],
                      ctx.slot_mapping.long().contiguous(), rows.block_table, rows.rows,
                      first.num_heads, rows.heads_per_item, rows.grain)
            if self.packed_weights:
                x = self.backend.ops.decoder_layers_packed(
                    x, rope, *self.fused_weights(), *caches, first.eps, first.scale)
            else:
                x = self.backend.ops.decoder_layers(
                    x, rope, *self.fused_weights(), *caches, first.linear.skinny_rows,
                    first.linear.isa, first.eps, first.scale)
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x, rope, i, ctx)
        return rms_norm(x, self.norm, self.eps, self.backend)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``input_ids``; packed tables dequantize just those rows, once per
        token id (packed_embedding.py)."""
        if self.embed_packed is None:
            return F.embedding(input_ids, self.embed_tokens)
        table = self._embed_rows
        if table is None or table.weight is not self.embed_packed:  # new weights: a new cache
            table = self._embed_rows = PackedEmbedding(self.embed_packed, self.norm.dtype)
        return table.rows(input_ids)

    @property
    def packed_weights(self) -> bool:
        """Whether the projections are packed (then every layer's are: load_weights)."""
        return bool(self.layers[0].segments)

    def fused_step(self, ctx: AttentionContext) -> bool:
        """Whether this step runs in the C++ all-layers op (``decoder_layers``): the backend
        chose it, and the attention kernel takes every query row (decodes and the short chunks
        ``kernel_takes`` picks); a step with a longer chunk keeps the Python layer, whose
        attention gives that chunk to SDPA."""
        return (self.backend.layer == "cpp-fused" and ctx.plan is not None
                and ctx.backend in (None, self.backend.attention) and kernel_takes_step(ctx.plan))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_projection is not None:
            return self.head_projection.forward(hidden).float()
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        return self.head_linear(hidden, head, None, self.packed_head).float()

    # decoder_layers' weight arguments in order; "+" names the layer's oneDNN-packed copy
    FUSED_WEIGHTS = ("input_layernorm", "qkv_proj", "qkv_proj+", "qkv_bias", "q_norm", "k_norm",
                     "o_proj", "o_proj+", "o_bias", "post_attention_layernorm", "gate_up_proj",
                     "gate_up_proj+", "down_proj", "down_proj+")

    # decoder_layers_packed's weight arguments in order; "*" names a packed projection
    FUSED_PACKED = ("input_layernorm", "q_norm", "k_norm", "post_attention_layernorm", "qkv_proj*",
                    "o_proj*", "gate_up_proj*", "down_proj*")

    def fused_weights(self) -> tuple[list, ...]:
        """One list per FUSED_WEIGHTS (FUSED_PACKED) entry, one item per layer, built once. A
        list whose tensor no layer has (no bias, no q/k norm, no packing) is empty, as the op
        expects."""
        if self._fused_weights is None:
            def per_layer(name: str) -> list:
                if name.endswith("*"):
                    return [layer.projections[name[:-1]] for layer in self.layers]
                got = [layer.packed.get(name[:-1]) if name.endswith("+") else getattr(layer, name)
                       for layer in self.layers]
                return [] if all(t is None for t in got) else got

            names = self.FUSED_PACKED if self.packed_weights else self.FUSED_WEIGHTS
            self._fused_weights = tuple(per_layer(name) for name in names)
        return self._fused_weights

    @property
    def head_table(self) -> QuantWeight | None:
        """The packed table the LM head reads: its own, or the embedding's when tied."""
        return self.head_packed or (self.embed_packed if self.tied else None)

    def packed_formats(self) -> set[str]:
        """The packed formats the projections and the LM head hold, once the weights are
        loaded: the ones whose GEMV/GEMM crossover matters (kernels/crossover.py)."""
        table = self.head_table
        held = [s for layer in self.layers for segs in layer.segments.values() for s in segs]
        return {segment_format(s) for s in held + ([table] if table is not None else [])
                if isinstance(s, QuantWeight)}

    def weight_slots(self) -> list[Slot]:
        """Where each loaded weight tensor lives, for huge_pages.onto to move: every
        parameter's data, each packed segment's blocks (a float segment as its list entry), the
        packed tables'; a tensor shared by two holders (a tied table) is listed once."""
        slots: list[Slot] = [(p, "data") for p in self.parameters() if not p.is_meta]
        for layer in self.layers:
            for segs in layer.segments.values():
                slots += [(s, "data") if isinstance(s, QuantWeight) else (segs, i)
                          for i, s in enumerate(segs)]
        tables = {id(t): t for t in (self.embed_packed, self.head_packed) if t is not None}
        return slots + [(t, "data") for t in tables.values()]

    def use_kernels(self, plan: KernelPlan) -> None:
        """Run on ``plan``'s kernels from now on, packing the weights for them in one pass:
        each layer's projections (:meth:`DecoderLayer.use_kernels`), then the packed tables,
        placed on the device here like the layers' segments, and the LM head built as a
        projection over its table (a tied one over the embedding's) or beside the copy its
        linear reads. ``weight_bytes`` is counted from what this built: float weights, the
        kernels' prepacked copies and the packed blocks (a tied head's counted once)."""
        self.backend = plan.backend
        layer_bytes = sum(layer.use_kernels(plan, self.device) for layer in self.layers)
        if self.embed_packed is not None:
            self.embed_packed = self.embed_packed.to(self.device)
        if self.head_packed is not None:
            self.head_packed = self.head_packed.to(self.device)
        table = self.head_table
        self.head_projection = (None if table is None else
                                build_projection([table], None, plan.packed, self.device))
        self.head_linear, self.packed_head = plan.linear, None
        if self.head_projection is None:
            head = self.lm_head if self.lm_head is not None else self.embed_tokens
            self.packed_head = self.head_linear.prepack(head.data)
        self._fused_weights = None
        weights = [*(p for p in self.parameters() if not p.is_meta), self.packed_head,
                   self.embed_packed, self.head_packed]
        self.weight_bytes = layer_bytes + sum(weight_nbytes(w) for w in weights if w is not None)

    # -- weights --------------------------------------------------------------------------
    def load_weights(self, weights: dict[str, torch.Tensor | QuantWeight]
                     | Iterable[tuple[str, torch.Tensor | QuantWeight]]) -> None:
        """Take HF-named weights in, fusing q/k/v and gate/up; fail loudly on gaps.

        ``weights``: a dict (read in full by the models layer, pagedq.worker.models.build),
        which this empties as it places each tensor, so a fused tensor's parts are freed as it
        goes; or (name, tensor) pairs. When any projection arrives packed, every projection is
        kept as packed segments (a float one, from a GGUF type no kernel reads, as an fp32
        segment), so one layer form runs throughout; a packed embedding or LM head stays packed
        too. Packed weights reach the device when :meth:`use_kernels` packs them.
        """
        parts = weights if isinstance(weights, dict) else dict(weights)
        for name in [n for n in parts if "rotary_emb" in n or n.startswith("model.")]:
            tensor = parts.pop(name)
            if "rotary_emb" not in name:
                parts[name.removeprefix("model.")] = tensor
        if self.tied:
            parts.pop("lm_head.weight", None)
        packed = any(isinstance(w, QuantWeight) for n, w in parts.items() if n.startswith("layers."))

        def take(key: str) -> torch.Tensor | QuantWeight:
            if key not in parts:
                raise UnsupportedModelError(f"checkpoint is missing weight {key!r}")
            return parts.pop(key)

        def check(shape, want) -> None:
            if tuple(shape) != tuple(want):
                raise UnsupportedModelError(f"weight shape {tuple(shape)} != {tuple(want)}")

        def put(owner: nn.Module, attr: str, *srcs) -> None:
            dst = getattr(owner, attr)
            if packed and attr in PROJECTIONS:
                check((sum(s.shape[0] for s in srcs), srcs[0].shape[1]), dst.shape)
                owner.segments[attr] = [s if isinstance(s, QuantWeight) else s.float().contiguous()
                                        for s in srcs]
                setattr(owner, attr, None)
                return
            src = torch.cat([dequantize(s) if isinstance(s, QuantWeight) else s for s in srcs])
            check(src.shape, dst.shape)
            setattr(owner, attr, nn.Parameter(src.to(self.device, dst.dtype).contiguous(), False))

        def table(attr: str, src) -> QuantWeight | None:
            """The embedding / LM head: kept packed when it arrives packed (use_kernels places
            it with the projections that read it)."""
            if not isinstance(src, QuantWeight):
                put(self, attr, src)
                return None
            check(src.shape, getattr(self, attr).shape)
            setattr(self, attr, None)
            return src

        with torch.no_grad():
            self.embed_packed = table("embed_tokens", take("embed_tokens.weight"))
            put(self, "norm", take("norm.weight"))
            if not self.tied:
                self.head_packed = table("lm_head", take("lm_head.weight"))
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                a = p + "self_attn."
                put(layer, "qkv_proj", *(take(f"{a}{n}_proj.weight") for n in "qkv"))
                if layer.qkv_bias is not None:
                    put(layer, "qkv_bias", *(take(f"{a}{n}_proj.bias") for n in "qkv"))
                put(layer, "o_proj", take(a + "o_proj.weight"))
                if layer.o_bias is not None:
                    put(layer, "o_bias", take(a + "o_proj.bias"))
                if layer.q_norm is not None:
                    put(layer, "q_norm", take(a + "q_norm.weight"))
                    put(layer, "k_norm", take(a + "k_norm.weight"))
                m = p + "mlp."
                put(layer, "gate_up_proj", take(m + "gate_proj.weight"), take(m + "up_proj.weight"))
                put(layer, "down_proj", take(m + "down_proj.weight"))
                put(layer, "input_layernorm", take(p + "input_layernorm.weight"))
                put(layer, "post_attention_layernorm", take(p + "post_attention_layernorm.weight"))
        if parts:
            raise UnsupportedModelError(f"checkpoint has weights this model does not use: "
                                        f"{sorted(parts)[:5]}")
