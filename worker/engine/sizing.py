"""KV cache sizing: how many blocks a memory budget buys, and what they hold.

The capacity math is a function of the model's shape (its Hugging Face config), the cache's
dtype, the block size and a byte budget, so it can be printed before any weight is loaded. Only
the CUDA budget needs a live model: vLLM's rule subtracts the activation peak of one full-budget
forward pass, which is measured, not computed.

``KVPlan.log_fields()`` is what the engine logs at start: blocks, bytes, and how many sequences
fit at the longest allowed length and at a typical one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import torch

from pagedq.errors import InvalidRequestError
from pagedq.params import SamplingParams
from pagedq.worker.config import EngineConfig
from pagedq.worker.engine.intake import fit_lengths
from pagedq.worker.engine.kv_cache_manager import cdiv
from pagedq.worker.engine.model_runner import ModelRunner
from pagedq.worker.engine.scheduler import SchedulerOutput
from pagedq.worker.engine.sequence import Request, Sequence

DEFAULT_CPU_KV_BYTES = 2 << 30
TYPICAL_SEQ_LEN = 512  # the "concurrency at a typical length" of the start-up log


def kv_cache_dtype(config: EngineConfig, device_type: str) -> torch.dtype:
    """The cache's dtype. A float16/bfloat16 cache under a float32 model halves the bytes
    attention streams per token (llama.cpp's default is an f16 cache for f32 weights too);
    values are rounded on the way in and attention runs in float32. CPU only: the Triton
    kernels take the cache in the model's dtype."""
    model = getattr(torch, config.dtype)
    kv = model if config.kv_cache_dtype == "auto" else getattr(torch, config.kv_cache_dtype)
    if kv != model and (device_type != "cpu" or model != torch.float32):
        raise InvalidRequestError(
            f"kv_cache_dtype={config.kv_cache_dtype!r} with dtype={config.dtype!r} on "
            f"{device_type}: a cache dtype other than the model's needs a float32 "
            "model on the CPU; use kv_cache_dtype='auto'")
    return kv


def kv_bytes_per_token(hf_config, kv_dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    elem = torch.empty((), dtype=kv_dtype).element_size()
    return 2 * hf_config.num_hidden_layers * kv_heads * head_dim * elem


def cpu_kv_budget(config: EngineConfig) -> int:
    """Bytes for the KV cache on the CPU: as configured, else 2 GiB or a quarter of the
    memory still available to this process, whichever is smaller (weights, activations and
    the OS need the rest)."""
    return config.kv_cache_memory or min(DEFAULT_CPU_KV_BYTES, available_memory() // 4)


CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


def available_memory(cgroup_root: Path = CGROUP_ROOT,
                     proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """Bytes this process can still allocate: the machine's available RAM, or less when its
    memory cgroup (a container's --memory, a pod's limit) leaves less. A container sees the
    host's RAM in /proc/meminfo, so sizing from that alone would overrun the limit."""
    available = psutil.virtual_memory().available
    cgroup = cgroup_headroom(cgroup_root, proc_cgroup)
    return available if cgroup is None else min(available, cgroup)


def cgroup_headroom(cgroup_root: Path = CGROUP_ROOT,
                    proc_cgroup: Path = Path("/proc/self/cgroup")) -> int | None:
    """Limit minus usage of this process's memory cgroup, v2 or v1, the tightest limit on its
    path; None when no limit applies. Reclaimable file cache (inactive_file) does not count
    as used, as ``docker stats`` reports it."""
    for version, directory in _cgroup_dirs(cgroup_root, proc_cgroup):
        limit_file, usage_file = (("memory.max", "memory.current") if version == 2 else
                                  ("memory.limit_in_bytes", "memory.usage_in_bytes"))
        limits = [_read_int(d / limit_file) for d in [directory, *directory.parents]
                  if d.is_relative_to(cgroup_root / ("" if version == 2 else "memory"))]
        limits = [x for x in limits if x is not None and x < UNLIMITED]
        usage = _read_int(directory / usage_file)
        if not limits or usage is None:
            continue
        inactive = _memory_stat(directory / "memory.stat",
                                "inactive_file" if version == 2 else "total_inactive_file")
        return max(0, min(limits) - max(0, usage - inactive))
    return None


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[tuple[int, Path]]:
    """(version, directory) of this process's memory cgroup: v2 first, then v1; the namespace
    root too, where /proc/self/cgroup names a path outside the container's view."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    found: list[tuple[int, Path]] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            found.append((2, root / path.lstrip("/")))
        elif "memory" in controllers.split(","):
            found.append((1, root / "memory" / path.lstrip("/")))
    found += [(2, root), (1, root / "memory")]
    return [(v, d) for v, d in found if d.is_dir()]


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return UNLIMITED if text == "max" else int(text) if text.isdigit() else None


def _memory_stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def blocks_for(lengths: list[int], block_size: int) -> int:
    """KV blocks that hold sequences of these lengths (prompt + output each) all at once."""
    return sum(cdiv(length, block_size) for length in lengths)


def fit_cache(config: EngineConfig, hf_config, prompts: list[list[int]],
              params: SamplingParams) -> EngineConfig:
    """``config`` with a KV cache just large enough to run ``prompts`` (token ids) all at once,
    ``params.n`` samples each, unless a size was asked for. Raises RequestTooLongError (via
    fit_lengths) for a prompt the model cannot take, before any weight is loaded."""
    limit = config.max_model_len or hf_config.max_position_embeddings
    lengths = [len(ids) + fit_lengths(ids, params, limit).max_tokens for ids in prompts]
    if config.num_kv_blocks is not None or config.kv_cache_memory is not None:
        return config
    return replace(config, num_kv_blocks=blocks_for(lengths * params.n,
                                                    config.resolved_block_size()))


def kv_budget(config: EngineConfig, block_size: int, device: torch.device, model) -> int | None:
    """Bytes the KV cache may take on ``device`` (None when ``num_kv_blocks`` fixes its size)."""
    if config.num_kv_blocks:
        return None
    if device.type == "cuda":
        return measure_cuda_kv_budget(model, config, block_size, device)
    return cpu_kv_budget(config)


def cuda_kv_budget(total: int, free: int, utilization: float, activation_peak: int) -> int:
    """vLLM's rule: ``utilization`` x total memory, minus what is already in use (weights,
    other processes) and the activation peak of a full-budget step."""
    return int(total * utilization - (total - free) - activation_peak)


def measure_cuda_kv_budget(model, config: EngineConfig, block_size: int,
                           device: torch.device) -> int:
    """``cuda_kv_budget`` on this GPU now, with the model's weights loaded."""
    free, total = torch.cuda.mem_get_info(device)
    peak = profile_activation_peak(model, config, block_size, device)
    return cuda_kv_budget(total, free, config.gpu_memory_utilization, peak)


def profile_activation_peak(model, config: EngineConfig, block_size: int,
                            device: torch.device) -> int:
    """Bytes one forward of a full token budget allocates on the GPU beyond what it started
    with (its throwaway cache included)."""
    tokens = config.max_num_batched_tokens
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    runner = ModelRunner(model, cdiv(tokens, block_size), block_size,
                         getattr(torch, config.dtype), device)
    req = Request("profile", None, [0] * tokens, SamplingParams(max_tokens=1))
    seq = Sequence(req, 0, [0] * tokens, tokens,
                   block_table=list(range(runner.kv_cache.shape[2])))
    runner.execute(SchedulerOutput(scheduled=[(seq, tokens)]))
    peak = torch.cuda.max_memory_allocated(device) - before
    del runner
    torch.cuda.empty_cache()
    return peak


@dataclass(frozen=True)
class KVPlan:
    """What a KV cache of ``num_blocks`` blocks holds for one model."""

    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    max_model_len: int  # the model's positions (or the configured cap), bounded by the cache

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token

    def concurrency_at(self, seq_len: int) -> float:
        """Sequences of ``seq_len`` tokens the cache holds at once."""
        return self.kv_tokens / seq_len

    def log_fields(self) -> dict[str, int | float]:
        typical = min(TYPICAL_SEQ_LEN, self.max_model_len)
        return dict(kv_blocks=self.num_blocks, block_size=self.block_size,
                    kv_tokens=self.kv_tokens, kv_bytes_per_token=self.kv_bytes_per_token,
                    kv_bytes=self.kv_bytes, max_model_len=self.max_model_len,
                    concurrency_at_max_len=round(self.concurrency_at(self.max_model_len), 2),
                    concurrency_at_typical_len=round(self.concurrency_at(typical), 2),
                    typical_len=typical)


def plan_kv(hf_config, config: EngineConfig, kv_dtype: torch.dtype, block_size: int,
            budget_bytes: int | None) -> KVPlan:
    """Blocks for ``budget_bytes`` (or ``config.num_kv_blocks``, which wins) and the longest
    sequence they allow. Raises InvalidRequestError when the budget holds no block."""
    per_token = kv_bytes_per_token(hf_config, kv_dtype)
    per_block = per_token * block_size
    blocks = config.num_kv_blocks or int((budget_bytes or 0) // per_block)
    if blocks < 1:
        raise InvalidRequestError(
            f"KV cache budget of {budget_bytes} bytes holds no block of {per_block} bytes: raise "
            "kv_cache_memory / gpu_memory_utilization or pass num_kv_blocks")
    positions = config.max_model_len or hf_config.max_position_embeddings
    return KVPlan(blocks, block_size, per_token, min(positions, blocks * block_size))
