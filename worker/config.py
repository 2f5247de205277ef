"""The config: every knob and every environment switch pagedq reads, defined once.

- ``Settings``: the environment, read once per process (``settings()``); no other module of the
  worker reads ``os.environ`` (the client resolves its Redis URL; pagedq.kernel_switches reads
  the kernel switches, which are EngineConfig fields' defaults).
- ``EngineConfig``: what the engine was asked for; every command derives its engine flags from
  its fields (pagedq.worker.cli).
- ``QueueConfig``: where the queue is (Redis URL, TLS files) and its names (queue, prefix, ttl),
  shared by the worker, the gateway, ``pagedq submit``/``stats`` and the bench.
- ``WorkerConfig``: the queue service's knobs (a QueueConfig), likewise flags.
- ``GatewayConfig``: ``pagedq serve``'s knobs (a QueueConfig; the OpenAI-compatible gateway).
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

from pagedq.client.connection import TLSFiles
from pagedq.client.protocol import DEFAULT_LIMITS, DEFAULT_PREFIX, DEFAULT_QUEUE, DEFAULT_TTL_S, Limits
from pagedq.errors import InvalidRequestError
from pagedq.kernel_switches import (
    DEFAULT_PACKED_PRECISION,
    PACKED_ACTIVATIONS,
    PACKED_GEMM_PRECISIONS,
    PackedActivations,
    PackedGemmPrecision,
    Switches,
    environment_switches,
)
from pagedq.redis_url import pagedq_cache_dir

Dtype = Literal["float32", "bfloat16", "float16"]
KVCacheDtype = Literal["auto", "float32", "bfloat16", "float16"]  # auto: the model's dtype
Quantization = Literal["auto", "none", "int8", "int4"]
CpuIsa = Literal["auto", "avx2", "avx2_vnni", "avx512", "avx512_vnni", "amx"]  # pagedq.kernels.ISA_LEVELS
KernelCrossovers = Literal["measure", "table"]
DTYPES: tuple[str, ...] = get_args(Dtype)


def parse_bytes(text: str | int) -> int:
    """A byte count from ``2GiB``, ``512MiB``, ``1.5G``, ``300MB`` or a plain integer.

    Binary units (KiB, MiB, GiB, TiB) count in 1024s, SI ones (KB, MB, GB, TB) in 1000s, and a
    bare letter (K, M, G, T) in 1024s, as ``docker run --memory`` reads it."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*", str(text), re.I)
    if not match or (match.group(3) and not match.group(4)):
        raise ValueError(f"{text!r} is not a size: write e.g. 2GiB, 512MiB or a number of bytes")
    number, unit, binary, b = match.groups()
    power = "kmgt".index(unit.lower()) + 1 if unit else 0
    return int(float(number) * (1024 if binary or not b else 1000) ** power)


# An int read from text by parse_bytes; flags of this type take "2GiB" (config_flags.py).
ByteSize = Annotated[int, parse_bytes]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDtype)
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
CPU_ISAS: tuple[str, ...] = get_args(CpuIsa)


@dataclass(frozen=True)
class Settings:
    """The environment variables pagedq honours, read once."""

    cache_dir: Path  # $PAGEDQ_CACHE or ~/.cache/pagedq: converted models, kernels' builds
    hf_hub_cache: Path  # $HF_HUB_CACHE, $HF_HOME/hub or ~/.cache/huggingface/hub
    queue: str  # $PAGEDQ_QUEUE: the default queue name of every command
    model: str | None  # $PAGEDQ_MODEL: the default model of every command
    consumer_name: str | None  # $PAGEDQ_CONSUMER_NAME: a worker's stable consumer name
    default_gguf: Path | None  # $PAGEDQ_DEFAULT_GGUF: the default model's GGUF, pre-fetched
    llama_cpp_dir: Path | None  # $PAGEDQ_LLAMA_CPP: llama.cpp binaries for the bench
    api_keys: tuple[str, ...] = ()  # $PAGEDQ_API_KEY: the gateway's Bearer keys (comma-separated)
    admin_keys: tuple[str, ...] = ()  # $PAGEDQ_ADMIN_KEY: keys that see every tenant's objects

    @classmethod
    def from_environ(cls, env: dict[str, str] | os._Environ = os.environ) -> Settings:
        def path(name: str) -> Path | None:
            return Path(env[name]).expanduser() if env.get(name) else None

        home_cache = path("XDG_CACHE_HOME") or Path.home() / ".cache"
        hub = path("HF_HUB_CACHE") or ((path("HF_HOME") / "hub") if env.get("HF_HOME")
                                        else home_cache / "huggingface" / "hub")
        return cls(cache_dir=pagedq_cache_dir(env),
                   hf_hub_cache=hub, queue=env.get("PAGEDQ_QUEUE") or DEFAULT_QUEUE,
                   consumer_name=env.get("PAGEDQ_CONSUMER_NAME") or None,
                   model=env.get("PAGEDQ_MODEL") or None,
                   default_gguf=path("PAGEDQ_DEFAULT_GGUF"), llama_cpp_dir=path("PAGEDQ_LLAMA_CPP"),
                   api_keys=_keys(env.get("PAGEDQ_API_KEY", "")),
                   admin_keys=_keys(env.get("PAGEDQ_ADMIN_KEY", "")))


def _keys(text: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in text.split(",") if k.strip())


@functools.cache
def settings() -> Settings:
    """The process's settings, read from the environment on first use.

    Tests that change the environment call ``settings.cache_clear()`` afterwards."""
    return Settings.from_environ()


# Tokens per KV block when EngineConfig.block_size is None. A sequence wastes half a block on
# average: 8 on the CPU costs the C++ attention kernel nothing measurable and keeps that waste
# small for short sequences; 16 on CUDA is the Triton kernels' tile.
DEFAULT_BLOCK_SIZE = {"cpu": 8, "cuda": 16}


def default_device() -> str:
    """The device an engine uses when not told: cuda when this machine has one, else cpu."""
    import torch  # here, so the SDK-side commands that read this module never import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_block_size(device_type: str) -> int:
    """The block size an engine on ``device_type`` ("cpu", "cuda") uses when not told."""
    return DEFAULT_BLOCK_SIZE.get(device_type, 16)


SpeculativeMethod = Literal["ngram", "suffix"]
SPECULATIVE_METHODS: tuple[str, ...] = get_args(SpeculativeMethod)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding with no draft model (vLLM's ``speculative_config`` keys).

    Each decoding sequence proposes up to ``num_speculative_tokens`` tokens that continue an
    earlier occurrence of its last tokens, and the step verifies them as extra query rows. The
    output is the output without speculation (see docs/engine.md, "Speculative decoding").
    """

    method: SpeculativeMethod = "ngram"
    """ngram: drafts from the sequence's own prompt and output (prompt lookup); suffix: also
    from this engine's recent prompts and outputs (a bounded LRU corpus)."""
    num_speculative_tokens: int = 6
    """Most draft tokens per sequence and step (each sequence adapts below it to its recent
    acceptance: a first draft of at most 4, one longer after each fully accepted draft)."""
    prompt_lookup_min: int = 2
    """Shortest suffix of the sequence that must match earlier tokens to propose a draft."""
    prompt_lookup_max: int = 5
    """Longest suffix tried (longer matches are tried first)."""
    suffix_decoding_max_tree_depth: int = 24
    """suffix: the longest match looked for in the corpus of earlier requests, in tokens."""
    suffix_decoding_max_cached_requests: int = 1000
    """suffix: earlier requests' prompts and outputs kept (least recently used leave first)."""
    disable_by_batch_size: int = 32
    """A hard cap: no drafts in a step that already runs this many sequences. Below it the
    governor (``adaptive``) decides per batch size from measured throughput; with
    ``adaptive=False`` every step below it speculates. Measured on two 2-core CPUs (AMD EPYC,
    Intel Xeon): from 32 sequences up, steps are compute bound and the governor's own tries
    of speculation left it at 0.88-0.93x of plain decoding on extraction, so the cap keeps
    speculation out of them (docs/engine.md, "Speculative decoding")."""
    adaptive: bool = True
    """Measure, per batch-size bucket, tokens per second of steps with and without speculation
    and run the better, re-trying the other now and then (worker/engine/spec_governor.py).
    False: speculate in every step below ``disable_by_batch_size``."""

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise InvalidRequestError(f"speculative_config: {what}")

        need(self.method in SPECULATIVE_METHODS,
             f"method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        need(isinstance(self.num_speculative_tokens, int) and self.num_speculative_tokens >= 1,
             f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens!r}")
        need(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
             "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        need(self.suffix_decoding_max_tree_depth >= self.prompt_lookup_min,
             "suffix_decoding_max_tree_depth must be >= prompt_lookup_min")
        need(self.suffix_decoding_max_cached_requests >= 1,
             "suffix_decoding_max_cached_requests must be >= 1")
        need(isinstance(self.disable_by_batch_size, int) and self.disable_by_batch_size >= 1,
             f"disable_by_batch_size must be an integer >= 1, got {self.disable_by_batch_size!r}")
        need(isinstance(self.adaptive, bool),
             f"adaptive must be true or false, got {self.adaptive!r}")

    @classmethod
    def coerce(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """A config from a dict or its JSON text (``--speculative-config '{"method": ...}'``);
        unknown keys are an error that names them."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise InvalidRequestError(f"speculative_config is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise InvalidRequestError("speculative_config must be a JSON object, e.g. "
                                      '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(f"speculative_config: unknown keys {unknown}; "
                                      f"known: {sorted(known)}")
        return cls(**value)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """The ``--speculative-config`` flag's parser: a JSON object (``null``: off)."""
    try:
        return SpeculativeConfig.coerce(text)
    except InvalidRequestError as exc:
        raise ValueError(str(exc)) from None


@dataclass(frozen=True)
class EngineConfig:
    """Every knob of the engine, defined once.

    ``Engine(model, **knobs)`` builds one; every command derives its engine flags from these
    fields (``--max-num-seqs`` for ``max_num_seqs``) and their docstrings, which are the flags'
    help text. Sizes the engine derives (KV blocks, the final max_model_len) live on the Engine.
    """

    model: str | None = field(default_factory=lambda: settings().model)
    """Model to serve: a local Hugging Face directory, a .gguf file or a repo id already in the
    Hugging Face cache (default: $PAGEDQ_MODEL, else the bundled SmolLM2-135M-Instruct)."""
    dtype: Dtype = "float32"
    """Weights' and activations' dtype. On a CPU with AMX or AVX512_BF16, bfloat16 keeps bf16
    weights and computes in float32 (the fast kernels); packed weights compute in float32 on
    any CPU whose C++ kernels run."""
    quantization: Quantization = "auto"
    """Weight format: auto keeps a GGUF's own blocks packed (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
    Q5_K, Q6_K; other types widen) and a float checkpoint in dtype; none widens everything to
    dtype; int8 (per channel) and int4 (groups of 32) quantize the projections at load."""
    packed_gemm_precision: PackedGemmPrecision = DEFAULT_PACKED_PRECISION
    """Products of packed weights for prefill chunks and large batches on the CPU. bf16x2 rounds
    each dequantized weight once to bf16 and multiplies it by the activations' bf16 heads and
    tails (two AMX products: the activations keep fp32 accuracy); bf16x3 adds the weights'
    tails too (three products, the dequantized model to fp32 accuracy, about 1.3x slower); bf16
    rounds both once (one product, about 1.4x faster than bf16x2, but greedy output parts from
    the dequantized model sooner: it misses the fidelity bars on tiny test models); fp32
    dequantizes tiles to fp32 for ATen's GEMM. The bf16 ones need AMX: every other CPU runs fp32
    whatever is asked (the start-up log says so). Decode steps take the integer GEMV either way."""
    packed_activations: PackedActivations = "int16"
    """Width the packed GEMV rounds the activations to, per 32 values, on the CPU. int16 keeps
    the dequantized model's product to ~2^-15 (greedy output matches it); int8 is llama.cpp's
    rounding: one byte product per weight (AVX2 maddubs, one VNNI vpdpbusd) for Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0 and Q4_K, up to ~1.5x faster where the GEMV is compute-bound (many streams,
    AVX2 CPUs), at the cost of greedy output leaving the dequantized model's sooner
    (docs/quantization.md, "int8 activations", has both figures). Other formats keep int16."""
    cpu_isa: CpuIsa = field(default_factory=lambda: environment_switches().cpu_isa)
    """The highest CPU instruction-set level the kernels may use: avx2, avx2_vnni (+ AVX-VNNI, an
    Intel Core without AVX-512: the many-row GEMV on vpdpwssd), avx512 (AVX-512F/VL/DQ/BW),
    avx512_vnni (+ VNNI: integer dot products), amx (+ AMX bf16 tiles); auto: all this CPU has
    (default: $PAGEDQ_CPU_ISA, which also caps the whole process, else auto). A cap runs exactly
    what a CPU of that level runs (pagedq.kernels.cpu_isa_levels() lists the levels this machine
    runs); a level above the CPU's is refused at start."""
    kernel_crossovers: KernelCrossovers = "measure"
    """Where a step of packed weights moves from the integer GEMV to the GEMM, on CPUs without
    AMX (fp32 tiles): measure times both for each packed format of the model once per machine
    (~0.5-2 s a format, kept in $PAGEDQ_CACHE/crossovers.json for later starts); table uses
    the row counts measured on the machines docs/quantization.md names. AMX machines always
    use the table."""
    cpu_kernels: bool = field(default_factory=lambda: environment_switches().cpu_kernels)
    """Run pagedq's C++ CPU kernels (attention, skinny GEMV, packed GEMV/GEMM, the fused layer)
    where the CPU and the build allow; off: torch's SDPA, oneDNN and dequantize-per-call
    (default: off when $PAGEDQ_CPU_KERNEL=0)."""
    onednn: bool = field(default_factory=lambda: environment_switches().onednn)
    """Prepack float32 weights for oneDNN for the CPU's batched linears; off: F.linear (default:
    off when $PAGEDQ_ONEDNN=0)."""
    fused_layer: bool = field(default_factory=lambda: environment_switches().fused_layer)
    """Run every decoder layer of a step in one C++ call where the step's rows fit the
    attention kernel; off: the per-op Python layer (default: off when $PAGEDQ_FUSED_LAYER=0)."""
    kv_cache_dtype: KVCacheDtype = "auto"
    """KV cache dtype (auto: the model's). float16 under a float32 model on the CPU halves the
    memory attention reads per token."""
    huge_pages: bool = True
    """Keep the weights on transparent huge pages where Linux allows it (THP "always" or
    "madvise"; a GGUF's packed blocks are read straight onto them): a decode step streams every
    weight, and 2 MiB pages spare it a TLB miss every 4 KiB (most under a hypervisor). Off:
    ordinary torch memory."""
    device: str | None = None
    """cpu, cuda or cuda:N (default: cuda when available, else cpu)."""
    block_size: int | None = None
    """Tokens per KV block (default: 8 on the CPU, 16 on CUDA)."""
    num_kv_blocks: int | None = None
    """KV cache size in blocks; overrides kv_cache_memory and gpu_memory_utilization."""
    kv_cache_memory: ByteSize | None = None
    """Size of the KV cache on the CPU, e.g. 512MiB or 2GiB (default: 2 GiB or a quarter of the
    memory still available to this process, a container's limit included, whichever is
    smaller; pagedq chat/generate size it to their prompts)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory the engine may fill: weights, activations, then KV cache."""
    max_num_seqs: int = 64
    """Most sequences running at once."""
    max_num_batched_tokens: int = 512
    """Token budget of one step: decodes take 1 each, prompts take chunks of the rest."""
    max_model_len: int | None = None
    """Most tokens one sequence (prompt + output) may hold (default: the model's context length,
    bounded by the KV cache)."""
    long_prefill_token_threshold: int = 0
    """Most tokens of one prompt computed in one step (0: the whole step budget)."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the step budget over several steps, so running decodes keep
    streaming while a long prompt is computed."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes already computed."""
    num_threads: int | None = None
    """CPU threads for torch's intra-op parallelism (default: torch's choice, capped at the CPUs
    this process may use: its affinity and its cgroup's CPU quota)."""
    adaptive_threads: bool = True
    """On the CPU, time each step on num_threads and on one thread and run the faster (per size
    of step, re-tried every few steps): on a shared machine a step's parallel regions wait for
    descheduled threads and one thread can be many times faster; on a quiet one, all threads."""
    seed: int = 0
    """Seed of the random draws of requests that bring no seed of their own."""
    grammar_cache_size: int = 128
    """Compiled structured-output constraints (JSON schemas, regexes, choices, grammars) kept
    for reuse."""
    grammar_compile_threads: int = 2
    """Threads compiling structured-output constraints, beside the engine's steps."""
    grammar_compile_timeout: float = 10.0
    """Seconds a structured-output constraint may take to compile; the requests waiting on one
    that takes longer fail with invalid_params."""
    speculative_config: Annotated[SpeculativeConfig | None, parse_speculative_config] = None
    """Speculative decoding with no draft model, as JSON: {"method": "ngram" or "suffix",
    "num_speculative_tokens": 6, "prompt_lookup_min": 2, "prompt_lookup_max": 5, ...}
    (default: off). Outputs are unchanged; see docs/engine.md."""

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:
                raise InvalidRequestError(f"engine config: {what}")

        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.coerce(self.speculative_config))
        if isinstance(self.kv_cache_memory, str):
            try:
                object.__setattr__(self, "kv_cache_memory", parse_bytes(self.kv_cache_memory))
            except ValueError as exc:
                raise InvalidRequestError(f"engine config: kv_cache_memory: {exc}") from None
        need(self.block_size is None or self.block_size >= 1,
             f"block_size must be >= 1 or None, got {self.block_size}")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
             f"num_kv_blocks must be >= 1 or None, got {self.num_kv_blocks}")
        need(self.kv_cache_memory is None or self.kv_cache_memory >= 1,
             f"kv_cache_memory must be >= 1 byte or None, got {self.kv_cache_memory}")
        need(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        need(self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        need(self.max_model_len is None or self.max_model_len >= 2,
             f"max_model_len must be >= 2 or None, got {self.max_model_len}")
        need(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold must be >= 0")
        need(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]")
        need(self.num_threads is None or self.num_threads >= 1,
             f"num_threads must be >= 1 or None, got {self.num_threads}")
        need(self.grammar_cache_size >= 1, "grammar_cache_size must be >= 1")
        need(self.grammar_compile_threads >= 1, "grammar_compile_threads must be >= 1")
        need(self.grammar_compile_timeout > 0, "grammar_compile_timeout must be > 0 seconds")
        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        need(self.quantization in QUANTIZATIONS,
             f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        need(self.packed_gemm_precision in PACKED_GEMM_PRECISIONS,
             f"packed_gemm_precision must be one of {PACKED_GEMM_PRECISIONS}, "
             f"got {self.packed_gemm_precision!r}")
        need(self.packed_activations in PACKED_ACTIVATIONS,
             f"packed_activations must be one of {PACKED_ACTIVATIONS}, "
             f"got {self.packed_activations!r}")
        need(self.cpu_isa in CPU_ISAS, f"cpu_isa must be one of {CPU_ISAS}, got {self.cpu_isa!r}")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")

    def kernel_switches(self) -> Switches:
        """The switches the backend selector gets: this config's, on the environment's rest
        (TRITON_INTERPRET, TORCH_EXTENSIONS_DIR and the process's PAGEDQ_CPU_ISA cap)."""
        return replace(environment_switches(), cpu_kernels=self.cpu_kernels,
                       onednn=self.onednn, fused_layer=self.fused_layer)

    def resolved_block_size(self) -> int:
        """``block_size``, or the default of the device the engine will run on."""
        device_type = (self.device or default_device()).split(":")[0]
        return self.block_size or default_block_size(device_type)


@dataclass(frozen=True)
class QueueConfig:
    """Where the queue is and how its keys are named: the fields every queue user shares.

    The worker, the gateway, ``pagedq submit``/``stats`` and the bench each take these (their
    configs inherit them, so the flags ``--redis-url``, ``--redis-ca``, ``--redis-cert``,
    ``--redis-key``, ``--queue``, ``--prefix`` and ``--ttl`` are derived from here, once). A
    config's ``FLAG_HELP`` words a field's help for its command where the meaning differs (what
    happens without a Redis URL).
    """

    redis_url: str | None = None
    """Redis holding the queue: a standalone server or any node of a Redis Cluster; rediss://
    for TLS; credentials as redis://user:password@host (default: $REDIS_URL, else the embedded
    Redis a `pagedq worker` on this machine advertises, else redis://localhost:6379/0)."""
    redis_ca: str | None = None
    """CA certificate file a rediss:// server's certificate must chain to (default: the
    system's CAs)."""
    redis_cert: str | None = None
    """Client certificate file for a rediss:// server that verifies clients (mutual TLS)."""
    redis_key: str | None = None
    """Private key file of --redis-cert."""
    queue: str = field(default_factory=lambda: settings().queue)
    """Queue the jobs go to (default: $PAGEDQ_QUEUE, else "default")."""
    prefix: str = DEFAULT_PREFIX
    """Prefix of every Redis key the queue uses."""
    ttl: int = DEFAULT_TTL_S
    """Seconds each request's output stream and state live after their last write (the workers
    and gateways of one queue should agree: a gateway resumes streams for this long)."""

    FLAG_HELP: ClassVar[dict[str, str]] = {}

    @property
    def tls(self) -> TLSFiles | None:
        """The TLS files given (None: none, the system's CAs for rediss://)."""
        if not (self.redis_ca or self.redis_cert or self.redis_key):
            return None
        return TLSFiles(self.redis_ca, self.redis_cert, self.redis_key)

    @property
    def queue_config(self) -> QueueConfig:
        """Just the queue's fields (of a WorkerConfig, GatewayConfig or BenchConfig)."""
        return QueueConfig(**{f.name: getattr(self, f.name) for f in fields(QueueConfig)})

    def client_options(self) -> dict[str, Any]:
        """Keywords for ``Client(url, **options)`` / ``AsyncClient``: queue, prefix, ttl, tls."""
        return {"queue": self.queue, "prefix": self.prefix, "ttl": self.ttl, "tls": self.tls}


@dataclass(frozen=True)
class WorkerConfig(QueueConfig):
    """Everything ``pagedq worker`` takes; engine fields go straight to ``Engine``."""

    FLAG_HELP: ClassVar[dict[str, str]] = {
        "redis_url": "Redis holding the queue: a standalone server or any node of a Redis "
                     "Cluster; rediss:// for TLS; credentials as redis://user:password@host "
                     "(default: $REDIS_URL; without either, the embedded redis-server another "
                     "worker on this machine started, else a new one, which pagedq submit and "
                     "stats on this machine then find).",
        "queue": 'Queue to serve (default: $PAGEDQ_QUEUE, else "default").',
    }

    model: str | None = None
    """The engine's model (the ``--model`` flag); None: EngineConfig's default."""
    consumer_name: str | None = None
    """Stable consumer name in the queue's group, so a restarted worker resumes its own pending
    jobs (default: $PAGEDQ_CONSUMER_NAME, else the host name)."""
    reclaim_after: float = 30.0
    """Seconds without a lease renewal after which another worker takes over a job."""
    max_deliveries: int = 3
    """Deliveries after which a job is a suspect of killing its workers: it then runs on a
    worker alone, so that a death is blamed on it only when nothing else ran."""
    solo_deaths: int = 2
    """Deaths of a suspect job's lone runs after which it is dead-lettered."""
    max_request_bytes: int = DEFAULT_LIMITS.max_request_bytes
    """Largest job payload accepted (bytes of the msgpack request, checked before decoding)."""
    max_prompt_tokens: int | None = None
    """Longest prompt accepted, in tokens (default: the engine's max_model_len)."""
    max_n: int = DEFAULT_LIMITS.max_n
    """Most samples (n) one job may ask for."""
    max_logprobs: int = DEFAULT_LIMITS.max_logprobs
    """Most top logprobs per token one job may ask for."""
    max_stop: int = DEFAULT_LIMITS.max_stop
    """Most stop strings, and most stop token ids, one job may give."""
    max_stop_chars: int = DEFAULT_LIMITS.max_stop_chars
    """Longest stop string accepted, in characters."""
    dead_letter_entry_bytes: int = 8192
    """Bytes of a job's payload kept in the dead-letter stream (the rest is cut off)."""
    dead_letter_max_bytes: int = 32 << 20
    """Bytes the dead-letter stream may hold in all (it keeps the newest entries)."""
    checkpoint_interval: float = 1.0
    """Seconds between the worker's heartbeat and load reports."""
    checkpoint_ttl: float | None = None
    """Seconds a report stays visible without a refresh (default: max(5, 3 intervals))."""
    drain_timeout: float = 30.0
    """On SIGTERM, seconds running jobs get to finish before the rest are handed back."""
    poll_interval: float = 0.1
    """Seconds between reads of the queue's cancel hint."""
    ownership_check_interval: float = 1.0
    """Seconds between checks that jobs which published nothing lately are still this
    worker's."""
    read_block_ms: int = 1000
    """Milliseconds one read of the queue waits for new jobs."""
    prompt_len_hint: int = 256
    """Prompt length assumed for jobs not read yet when counting how many more fit."""
    metrics_port: int | None = None
    """Serve Prometheus /metrics and /healthz on this port (0: any free one)."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics server listens on (0.0.0.0: every interface; it has no auth)."""
    engine: dict[str, Any] = field(default_factory=dict)

    @property
    def limits(self) -> Limits:
        """What one job may ask of this worker (checked before anything is allocated)."""
        return Limits(self.max_request_bytes, self.max_n, self.max_logprobs, self.max_stop,
                      self.max_stop_chars)

    @property
    def checkpoint_ttl_s(self) -> float:
        """How long a checkpoint (and the consumer-name lock) outlives its worker."""
        return self.checkpoint_ttl or max(5.0, 3 * self.checkpoint_interval)


@dataclass(frozen=True)
class GatewayConfig(QueueConfig):
    """Everything ``pagedq serve`` takes. The gateway runs no model: its limits bound what one
    HTTP client can ask of the queue and of Redis."""

    FLAG_HELP: ClassVar[dict[str, str]] = {
        "redis_url": "Redis holding the queue (default: $REDIS_URL, else the embedded Redis a "
                     "`pagedq worker` on this machine advertises; without any, an embedded "
                     "redis-server and one worker on --model start).",
        "ttl": "Seconds a stream stays resumable (match the workers' --ttl).",
    }

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on."""
    api_keys: tuple[str, ...] = field(default_factory=lambda: settings().api_keys)
    """Accepted Bearer keys (default: $PAGEDQ_API_KEY, comma-separated); none: open. Each key
    is a tenant: the files, batches and streams it makes are invisible to the others."""
    admin_keys: tuple[str, ...] = field(default_factory=lambda: settings().admin_keys)
    """Bearer keys that see and manage every tenant's files, batches and streams (default:
    $PAGEDQ_ADMIN_KEY, comma-separated)."""
    allowed_hosts: list[str] = field(default_factory=list)
    """Host names (Host header, and Origin when sent) accepted besides the bound address and
    loopback names; "*" accepts any. Refuses DNS-rebinding and cross-site requests."""
    max_body_bytes: int = 4 << 20
    """Largest JSON request body (413 above); uploads have max_file_bytes."""
    max_queue_depth: int | None = None
    """Answer 429 when a request's interactive (high and normal priority) jobs would take the
    jobs waiting past this, each prompt counted (default: no limit)."""
    max_prompts: int = 2048
    """Most prompts in one /v1/completions request or batch line (OpenAI's limit); each is a
    job (400 above)."""
    min_priority: int = 0
    """Most urgent priority a client may ask for, in vLLM's sense (lower runs earlier); a
    request asking for more is clamped to it. 0: no client reaches pagedq's high stream; -1
    lets them."""
    max_priority: int = 1_000_000
    """Least urgent priority a client may ask for (vLLM's sense); clamped likewise."""
    disconnect_grace: float = 10.0
    """Seconds a dropped stream may take to resume before its job is cancelled."""
    files_dir: str | None = None
    """Keep files in this directory (shared by every gateway) instead of Redis."""
    max_file_bytes: int = 64 << 20
    """Largest uploaded file (413 above)."""
    max_files: int = 100
    """Most files one API key (tenant) keeps at once, batch outputs included (403 above)."""
    max_files_bytes: int = 1 << 30
    """Most bytes of files one API key (tenant) keeps at once (403 above)."""
    max_total_files: int = 1000
    """Most files the gateway keeps at once, all keys together, batch outputs included (403
    above): per-key quotas alone let many keys fill Redis."""
    max_total_files_bytes: int = 4 << 30
    """Most bytes of files the gateway keeps at once, all keys together (403 above); keep it
    under the Redis's maxmemory (the embedded one takes a quarter of the host's memory)."""
    files_ttl: int = 7 * 24 * 3600
    """Seconds files and finished batches are kept."""
    max_batch_lines: int = 50_000
    """Most lines in one batch."""
    batch_window: int = 128
    """Lines of one batch in the queue at once."""
    batch_lease: float = 10.0
    """Seconds of silence after which another gateway takes over a gateway's batches."""
    tool_call_format: Literal["auto", "hermes", "llama", "mistral", "mistral_json"] = "auto"
    """Tool-call format of the served models (pagedq.tools): "auto" reads it from each model's
    chat template, control tokens and architecture where its directory is readable here
    (Hermes where it is not); a name forces that format for every model."""
    fleet_cache: float = 0.25
    """Seconds a reading of the live workers and the queue depth is reused."""
    redis_max_connections: int = 4096
    """Redis connections of one gateway (streams share them: one blocking read serves many);
    a request finding none free waits up to redis_pool_timeout."""
    redis_pool_timeout: float = 5.0
    """Seconds a request waits for a free Redis connection before its 503."""
    limit_concurrency: int | None = None
    """Most open HTTP connections and tasks (uvicorn's; 503 above); default: no limit."""
    timeout_keep_alive: int = 5
    """Seconds an idle keep-alive connection stays open."""
    timeout_header: float = 10.0
    """Seconds a client has to send a request's headers before its connection is closed
    (slowloris)."""
    timeout_body: float = 30.0
    """Seconds a request's body may pause before its connection is closed."""
    ssl_certfile: str | None = None
    """Serve HTTPS with this certificate (PEM, the chain after it); needs ssl_keyfile. Default:
    plain HTTP (or a TLS-terminating reverse proxy in front)."""
    ssl_keyfile: str | None = None
    """Private key (PEM) of ssl_certfile."""
