"""The one room that builds the model: resolve it, pick its weight form, choose its kernels,
load it and pack it for them.

The engine asks here once (as nano-vllm's ``ModelRunner`` loads its model) and gets a
:class:`BuiltModel` back; ``EngineConfig.quantization`` is read in :func:`choose_form` and
nowhere else. The steps, in order, each handing the next what it decided:

1. :func:`kernel_selector`: the kernels' side first: a ``cpu_isa`` above this CPU is refused
   before anything resolves, and on a CPU the C++ library is built or loaded (whether it runs
   decides the weights' form).
2. :func:`open_model`: the model's directory (``quantization="auto"`` keeps a GGUF's blocks, so
   its directory holds config and tokenizer only, the bundled model included), its config and
   tokenizer. No weight is read, so a caller can check prompts against the model first (the
   CLI does) and hand the opened files on.
3. :func:`choose_form`: the weights' form (:class:`WeightForm`: a pack mode and the
   activations' dtype) from ``quantization``, whether the weights come from a GGUF, and what
   this CPU's kernels compute; then the kernels for that compute dtype, resolved once into a
   :class:`~pagedq.kernels.backend.KernelPlan` (the float weights' linear, each packed
   format's route).
4. :func:`read_weights`: every weight read in that form (through :func:`pack_weights`).
5. :class:`~pagedq.worker.models.llama.CausalLM` built from the plan, given the weights (it
   places them) and packed for the plan's kernels in one pass, which also counts the bytes
   the weights then take; the engine's summary reads them, and the compute dtype, from the
   :class:`BuiltModel`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pagedq.kernels.backend import Backend, Selector, process_selector
from pagedq.kernels.block_formats import (
    QK,
    QuantWeight,
    as_bf16,
    dequantize,
    quantize_int4,
    quantize_int8,
)
from pagedq.kernels.crossover import measured_plan
from pagedq.kernels.huge_pages import onto as onto_huge_pages
from pagedq.logging import get_logger
from pagedq.progress import waiting
from pagedq.worker.config import EngineConfig
from pagedq.worker.models.llama import CausalLM, head_dim
from pagedq.worker.models.loader import iter_weights, load_config, load_tokenizer, resolve_model
from pagedq.worker.models.model_cache import packed_source, release_freed_heap

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

__all__ = ["BuiltModel", "ModelFiles", "WeightForm", "build_model", "choose_form",
           "kernel_selector", "open_model", "pack_weights", "read_weights"]

log = get_logger("pagedq.models")

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TABLES = ("model.embed_tokens.weight", "lm_head.weight")  # the embedding and the LM head
MODES = ("keep", "float", "int8", "int4", "bf16")


@dataclass(frozen=True)
class ModelFiles:
    """A model's files, opened without its weights: where they are, its config and tokenizer,
    and the GGUF its weights are read from when they stay packed (None otherwise)."""

    path: Path
    hf_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None
    gguf: Path | None


@dataclass(frozen=True)
class WeightForm:
    """How the weights sit in memory: ``mode`` for :func:`pack_weights` (``keep``: GGUF blocks
    as stored; ``float``: widened; ``int8``/``int4``: quantized at load; ``bf16``: bf16 rows)
    and ``compute``, the activations' dtype (float32 where the CPU kernels take packed
    weights)."""

    mode: str
    compute: torch.dtype


@dataclass
class BuiltModel:
    """What the engine runs: the opened files, the form chosen, the loaded model, the kernels
    it runs on and the bytes its weights take (packed blocks, float weights and the copies the
    kernels read)."""

    files: ModelFiles
    form: WeightForm
    model: CausalLM
    backend: Backend
    weight_bytes: int

    @property
    def packed(self) -> bool:
        """Whether the projections hold packed blocks (and so run the packed GEMV and GEMM):
        a GGUF kept as stored, int8/int4 quantized at load, bf16 rows; not float weights."""
        mode = self.form.mode
        return mode != "float" and (mode != "keep" or self.files.gguf is not None)


def kernel_selector(config: EngineConfig, device: torch.device) -> Selector:
    """The process's selector for ``config``'s switches, asked before the model resolves: a
    ``cpu_isa`` above this CPU is refused here, and on a CPU the C++ library builds or loads
    here (minutes the first time on a machine), since whether it runs decides the weights'
    form (Selector.compute_dtype) and every kernel chosen after."""
    selector = process_selector(config.cpu_isa, config.kernel_switches())
    selector.ops_for(device)  # loaded once per process; what the selector reads from now on
    return selector


def open_model(config: EngineConfig) -> ModelFiles:
    """Resolve ``config.model`` for its weight form and read its config and tokenizer.
    Quantization ``auto`` serves a GGUF's blocks as stored, so a GGUF resolves to a directory
    of config and tokenizer reading the GGUF (the bundled model too), not to an fp32 copy."""
    path = resolve_model(config.model, packed=config.quantization == "auto")
    hf_config = load_config(path)
    return ModelFiles(path, hf_config, load_tokenizer(path, hf_config), packed_source(path))


def choose_form(config: EngineConfig, files: ModelFiles, device: torch.device,
                selector: Selector) -> WeightForm:
    """``auto`` keeps a GGUF's blocks and, where bf16 rows are the fast path
    (Selector.compute_dtype), packs a bfloat16 model's matrices as bf16 rows; ``none`` widens;
    ``int8``/``int4`` quantize."""
    dtype = getattr(torch, config.dtype)
    if config.quantization == "none":
        return WeightForm("float", dtype)
    if config.quantization in ("int8", "int4"):
        return WeightForm(config.quantization, selector.compute_dtype(device, dtype, packed=True))
    gguf = files.gguf is not None
    compute = selector.compute_dtype(device, dtype, packed=gguf)
    bf16_rows = dtype == torch.bfloat16 and compute == torch.float32 and not gguf
    return WeightForm("bf16" if bf16_rows else "keep", compute)


def build_model(config: EngineConfig, device: torch.device, kv_dtype: torch.dtype,
                files: ModelFiles | None = None) -> BuiltModel:
    """The model of ``config`` on ``device``, its weights in the chosen form and packed for the
    kernels chosen (``files``: already opened by :func:`open_model`). RoPE tables are sized for
    ``max_model_len``; the C++ kernels build or load here, not on the first step."""
    selector = kernel_selector(config, device)
    files = files or open_model(config)
    form = choose_form(config, files, device, selector)
    if form.compute != getattr(torch, config.dtype):
        log.info("weights kept packed; activations in float32 for the CPU kernels",
                 dtype=config.dtype, pack=form.mode)
    hf_config = files.hf_config
    plan = selector.select(device, form.compute, kv_dtype, head_dim(hf_config),
                           config.packed_gemm_precision, config.packed_activations).plan()
    positions = config.max_model_len or hf_config.max_position_embeddings
    with waiting(f"loading the weights of {files.path.name}", log):
        weights = read_weights(files.path, form.mode, config.huge_pages and form.mode == "keep"
                               and device.type == "cpu")
        model = CausalLM(hf_config, plan, device, positions)
        model.load_weights(weights)
        model.eval()
        if config.huge_pages and device.type == "cpu":  # what a GGUF read did not put there
            arena = onto_huge_pages(model.weight_slots())
            if arena.used:
                log.info("weights moved onto transparent huge pages", bytes=arena.used,
                         huge_bytes=arena.huge_bytes())
    if config.kernel_crossovers == "measure":
        with waiting("timing the packed kernels on this CPU (once per machine)", log):
            plan = measured_plan(plan, model.packed_formats())
    with waiting("packing the weights for the kernels", log):
        model.use_kernels(plan)
    release_freed_heap()
    return BuiltModel(files, form, model, plan.backend, model.weight_bytes)


# --------------------------------------------------------------------------- weight forms


def is_matrix(name: str) -> bool:
    """Whether a checkpoint tensor is a projection, the embedding or the LM head (the tensors
    that are ever packed; norms and biases stay float)."""
    return name in TABLES or (name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS)


Weight = torch.Tensor | QuantWeight


def pack_weights(weights: Iterable[tuple[str, Weight]], mode: str) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's tensors in the form ``mode`` asks for, one at a time.

    ``keep``: as they come (GGUF blocks packed, float tensors float); ``float``: every packed
    weight dequantized; ``int8`` / ``int4``: projections quantized per channel / in groups of 32
    (the embedding and LM head int8 either way, as llama.cpp's 4-bit recipes keep them at 6-8
    bits); ``bf16``: matrices as bf16 rows. A matrix whose width is not a multiple of 32 stays
    float (the kernels' block), with a log line.
    """
    if mode not in MODES:
        raise ValueError(f"pack mode must be one of {MODES}, got {mode!r}")
    requantized = 0
    for name, weight in weights:
        if mode == "keep" or not is_matrix(name):
            yield name, weight
            continue
        if isinstance(weight, QuantWeight):
            requantized += mode != "float"
            weight = dequantize(weight)
        yield name, _to_form(name, weight, mode)
    if requantized:
        log.info("packed checkpoint weights dequantized and quantized again", mode=mode,
                 tensors=requantized)


def read_weights(path: Path, mode: str, huge_pages: bool = False) -> dict[str, Weight]:
    """Every checkpoint tensor of ``path`` in the form ``mode`` asks for, read here, before the
    model takes them: the stream (loader, GGUF reader, :func:`pack_weights`) runs out in this
    room instead of inside ``CausalLM.load_weights``. The peak is a stream's all the same: the
    model gathers every tensor before it places any (q/k/v and gate/up fuse across names), and
    it pops each from this dict as it places it, so a fused tensor's parts are freed as it goes.
    ``huge_pages``: a GGUF's packed blocks are read onto huge pages (mode ``keep`` only: any
    other mode replaces them).
    """
    return dict(pack_weights(iter_weights(path, huge_pages), mode))


def _to_form(name: str, weight: torch.Tensor, mode: str) -> Any:
    """One float matrix in ``mode``'s form (pack_weights)."""
    if mode == "float":
        return weight
    if weight.shape[1] % QK:
        log.info("weight kept in float: its width is not a multiple of 32", weight=name,
                 shape=tuple(weight.shape))
        return weight
    if mode == "bf16":
        return as_bf16(weight)
    if mode == "int4" and name not in TABLES:
        return quantize_int4(weight)
    return quantize_int8(weight)
