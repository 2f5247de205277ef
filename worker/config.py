"""The config: every knob and every environment switch pagedq reads, defined once.

- ``Settings``: the environment, read once per process (``settings()``); no other module of the
  worker reads ``os.environ`` (the client resolves its Redis URL, the backend selector in
  pagedq.kernels reads the kernel switches).
- ``EngineConfig``: what the engine was asked for; every command derives its engine flags from
  its fields (pagedq.worker.cli).
- ``WorkerConfig``: the queue service's knobs, likewise.
- ``GatewayConfig``: ``pagedq serve``'s knobs (the OpenAI-compatible HTTP gateway).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedq.client.protocol import DEFAULT_PREFIX, DEFAULT_QUEUE, DEFAULT_TTL_S
from pagedq.errors import InvalidRequestError

DTYPES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", *DTYPES)  # auto: the model's dtype


@dataclass(frozen=True)
class Settings:
    """The environment variables pagedq honours, read once."""

    cache_dir: Path  # $PAGEDQ_CACHE or ~/.cache/pagedq: converted models, kernels' builds
    hf_hub_cache: Path  # $HF_HUB_CACHE, $HF_HOME/hub or ~/.cache/huggingface/hub
    queue: str  # $PAGEDQ_QUEUE: the default queue name of every command
    consumer_name: str | None  # $PAGEDQ_CONSUMER_NAME: a worker's stable consumer name
    default_gguf: Path | None  # $PAGEDQ_DEFAULT_GGUF: the default model's GGUF, pre-fetched
    llama_cpp_dir: Path | None  # $PAGEDQ_LLAMA_CPP: llama.cpp binaries for the bench
    api_keys: tuple[str, ...] = ()  # $PAGEDQ_API_KEY: the gateway's Bearer keys (comma-separated)

    @classmethod
    def from_environ(cls, env: dict[str, str] | os._Environ = os.environ) -> Settings:
        def path(name: str) -> Path | None:
            return Path(env[name]).expanduser() if env.get(name) else None

        home_cache = path("XDG_CACHE_HOME") or Path.home() / ".cache"
        hub = path("HF_HUB_CACHE") or ((path("HF_HOME") / "hub") if env.get("HF_HOME")
                                        else home_cache / "huggingface" / "hub")
        return cls(cache_dir=path("PAGEDQ_CACHE") or Path.home() / ".cache" / "pagedq",
                   hf_hub_cache=hub, queue=env.get("PAGEDQ_QUEUE") or DEFAULT_QUEUE,
                   consumer_name=env.get("PAGEDQ_CONSUMER_NAME") or None,
                   default_gguf=path("PAGEDQ_DEFAULT_GGUF"), llama_cpp_dir=path("PAGEDQ_LLAMA_CPP"),
                   api_keys=tuple(k.strip() for k in env.get("PAGEDQ_API_KEY", "").split(",")
                                  if k.strip()))


@functools.cache
def settings() -> Settings:
    """The process's settings, read from the environment on first use.

    Tests that change the environment call ``settings.cache_clear()`` afterwards."""
    return Settings.from_environ()


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


@dataclass
class WorkerConfig:
    """Everything ``pagedq worker`` takes; engine fields go straight to ``Engine``."""

    model: str | None = None
    redis_url: str | None = None
    queue: str = field(default_factory=lambda: settings().queue)
    prefix: str = DEFAULT_PREFIX
    consumer_name: str | None = None
    reclaim_after: float = 30.0
    max_deliveries: int = 3
    ttl: int = DEFAULT_TTL_S
    checkpoint_interval: float = 1.0
    checkpoint_ttl: float | None = None  # default: max(5 s, 3 intervals)
    drain_timeout: float = 30.0
    poll_interval: float = 0.1  # how often the queue's cancel hint is read
    ownership_check_interval: float = 1.0  # sweep of jobs with no recent publish
    read_block_ms: int = 1000
    prompt_len_hint: int = 256
    metrics_port: int | None = None
    metrics_host: str = "0.0.0.0"
    engine: dict[str, Any] = field(default_factory=dict)

    @property
    def checkpoint_ttl_s(self) -> float:
        return self.checkpoint_ttl or max(5.0, 3 * self.checkpoint_interval)


@dataclass
class GatewayConfig:
    """Everything ``pagedq serve`` takes. The gateway runs no model: limits here bound what one
    HTTP client can ask of the queue and of Redis."""

    redis_url: str | None = None
    queue: str = field(default_factory=lambda: settings().queue)
    prefix: str = DEFAULT_PREFIX
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = field(default_factory=lambda: settings().api_keys)
    max_body_bytes: int = 4 << 20  # JSON request bodies; file uploads have max_file_bytes
    max_queue_depth: int | None = None  # interactive jobs waiting (high + normal) before 429
    disconnect_grace: float = 10.0  # seconds a dropped stream may take to resume before cancel
    ttl: int = DEFAULT_TTL_S  # seconds a request's resume record lives (as its output stream)
    files_dir: str | None = None  # files on disk (shared by every gateway) instead of Redis
    max_file_bytes: int = 64 << 20
    files_ttl: int = 7 * 24 * 3600  # seconds files and finished batches are kept
    max_batch_lines: int = 50_000
    batch_window: int = 128  # lines of one batch in the queue at once
    batch_lease: float = 10.0  # seconds a gateway's claim on driving a batch lasts unrenewed
    fleet_cache: float = 0.25  # seconds the live-worker and depth reading is reused
    redis_max_connections: int = 4096  # one per open stream (each holds a blocking XREAD)
