"""Engine configuration: every knob in one dataclass, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from pagedq.errors import InvalidRequestError

DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", *DTYPES)  # auto: the model's dtype


@dataclass
class EngineConfig:
    """What the engine was asked for. Derived sizes (blocks, max_model_len) live on the Engine."""

    model: str | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes for the KV cache on CPU (default: see Engine)
    gpu_memory_utilization: float = 0.9  # fraction of the GPU the engine may fill (CUDA only)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    long_prefill_token_threshold: int = 0  # 0: a prompt chunk may use the whole budget
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    device: str | None = None
    num_threads: int | None = None  # torch intra-op threads on CPU (None: torch's default)

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise InvalidRequestError(f"engine config: {what}")

        need(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
             f"num_kv_blocks must be >= 1 or None, got {self.num_kv_blocks}")
        need(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        need(self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        need(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold must be >= 0")
        need(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]")
        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
