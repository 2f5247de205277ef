"""What a benchmark run does: model, engine knobs and the size of every scenario.

``quick()`` is sized to finish in under 3 minutes on 2 CPU cores with the default model;
``full()`` runs the target shapes (the 64-request mixed trace, 128-token decode sweeps). Tests
build a config by hand with tiny sizes. Every number here ends up in the report's ``config``.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, ClassVar

from pagedq.bench.workload import SHAREGPT_OUTPUT, SHAREGPT_PROMPT, LengthDist
from pagedq.worker.config import EngineConfig, QueueConfig

SCENARIOS = ("throughput", "decode", "capacity", "itl", "prefix", "sharing", "queue", "gateway",
             "structured", "llama_cpp", "quant")
# Asked for by name only (--scenarios shared,memory): "shared" loads the machine on purpose,
# "memory" writes a 3.4 GB model and needs llama.cpp's llama-quantize, "spec" runs three
# engines side by side for tens of minutes (bench/spec_scenario.py).
OPT_IN_SCENARIOS = ("shared", "memory", "spec")
ALL_SCENARIOS = SCENARIOS + OPT_IN_SCENARIOS


@dataclass(frozen=True)
class BenchConfig(EngineConfig, QueueConfig):
    """Every knob of a run: the engine's knobs (EngineConfig's fields, with its defaults), the
    queue's (QueueConfig's: the queue and gateway scenarios' Redis, TLS files, prefix and ttl)
    plus the size of every scenario. The engine knobs apply to every engine the run builds
    unless a scenario needs a different value to mean anything (capacity sizes its own KV cache,
    ITL switches chunking); ``seed`` also seeds the synthetic traces, and ``num_threads`` applies
    to the Hugging Face baseline and llama.cpp alike."""

    FLAG_HELP: ClassVar[dict[str, str]] = {
        "redis_url": "Redis for the queue and gateway scenarios (default: a private "
                     "redis-server for the run, not $REDIS_URL: a run never touches a shared "
                     "queue unless told).",
        "queue": "Stem of the run's queue names: each scenario serves a fresh queue "
                 "QUEUE-SCENARIO-PID-TIME, so runs never share jobs.",
    }

    max_model_len: int | None = 2048
    """Most tokens per sequence in the serving engine (default: 2048, a fixed length so figures
    do not depend on the model's context length; llama-server gets the same context)."""
    scenarios: tuple[str, ...] = SCENARIOS
    profile: str = "full"

    # shared: one stream on a CPU other processes keep busy (bench/shared_cpu.py)
    shared_new_tokens: int = 64
    shared_repeats: int = 3
    shared_load_seconds: float = 600.0  # a bound: the load is stopped when the rounds end

    # throughput: a ShareGPT-like mixed trace, pagedq vs HF generate in static batches
    throughput_requests: int = 64
    prompt_dist: LengthDist = SHAREGPT_PROMPT
    output_dist: LengthDist = SHAREGPT_OUTPUT
    hf_batch_size: int = 16

    # decode sweep (llama-batched-bench shape)
    decode_batches: tuple[int, ...] = (1, 8, 32, 64)
    decode_prompt_tokens: int = 128
    decode_new_tokens: int = 128
    # a second pagedq sweep with this KV cache dtype (None: skip). float16 is llama.cpp's
    # default cache type for f32 weights, so that row is the like-for-like comparison with
    # its figures; a float32 model on the CPU only
    decode_kv_cache_dtype: str | None = "float16"

    # capacity: KV budget = reserved_slots * capacity_max_model_len tokens, for both layouts
    capacity_requests: int = 128
    capacity_reserved_slots: int = 8
    capacity_max_model_len: int = 2048
    capacity_max_num_seqs: int = 256  # high, so KV memory (not a sequence cap) is the limit

    # ITL: decodes running while one long prompt arrives
    itl_decodes: int = 8
    itl_decode_prompt_tokens: int = 64
    # 63 gaps per stream: one stall per stream is 1.6% of the gaps, so p99 can see it
    itl_decode_new_tokens: int = 64
    itl_long_prompt_tokens: int = 2048
    itl_inject_after_tokens: int = 16
    # chunked run: cap on the long prompt's chunk per step (long_prefill_token_threshold), so a
    # step stays within ~2 decode steps on a CPU where one prompt token costs ~1 ms of compute
    itl_prefill_chunk: int = 32

    # prefix: TTFT with a cached prefix vs cold
    prefix_tokens: int = 1024
    prefix_suffix_tokens: int = 32
    prefix_repeats: int = 3

    # sharing: KV blocks of n=4 sampling and beam width 4 vs four unshared copies
    sharing_prompt_tokens: int = 512
    sharing_new_tokens: int = 64

    # structured: extraction requests with a JSON schema vs the same requests unconstrained
    # with the same output lengths (greedy: the least other sampling work beside the mask)
    structured_requests: int = 64
    structured_max_tokens: int = 160
    structured_temperature: float = 0.0

    # spec: speculation off / ngram / suffix on extraction, edit and chat jobs, alternated
    # (bench/spec_scenario.py); rounds (batches per engine) per stream count (the last value
    # repeats past its end), and more extraction rounds at spec_learning_streams so the suffix
    # engine sees 50 jobs first. One stream runs 4 jobs: single jobs' speed-ups ran 1.4-2.4x on
    # the same build (extraction, Zen 5), so 2 were too few to judge a 2x target by.
    spec_streams: tuple[int, ...] = (1, 8, 64)
    # 8 streams: 4 rounds, as the cell's ratios spread 0.86-0.98x over 2 (chat, ngram, Zen 5)
    # and its first round carries the bucket's choice from the workload before; 64 streams:
    # one round swung +-10% between runs
    spec_rounds: tuple[int, ...] = (4, 4, 2)
    spec_workloads: tuple[str, ...] = ("extraction", "edit", "chat")
    # one stream: where every step may speculate, so the learning figure measures drafts, not
    # the governor; 64 jobs there also steady its decode tok/s (single jobs spread 1.4-2.4x)
    spec_learning_streams: int = 1
    spec_learning_rounds: int = 64
    spec_max_tokens: int = 96
    spec_prompt_tokens_max: int = 256  # KV sizing per stream (the chat prompts are shorter)
    spec_num_speculative_tokens: int = 6
    spec_disable_by_batch_size: int | None = None  # None: SpeculativeConfig's default
    spec_adaptive: bool = True  # grid ngram/suffix: the governor (False: always below the cap)
    # ngram forced on at every batch size vs off (where verification stops paying), and beside
    # them ngram with the governor deciding (no cap), on each of spec_threshold_workloads
    spec_threshold_streams: tuple[int, ...] = (4, 16, 32)
    spec_threshold_rounds: int = 1  # alternated off / forced-on / governed rounds per count
    spec_threshold_workloads: tuple[str, ...] = ("extraction",)
    spec_threshold_governed: bool = True
    # a differing greedy output is a near-tie flip only within this many logits, in the packed
    # model and its fp32 twin alike; None: by the packed GEMM's precision (bench/spec_judge.py:
    # margin_for, NEAR_TIE_MARGINS, why these values)
    spec_tie_margin: float | None = None

    # queue: the throughput trace through Redis (worker subprocess + client), on QueueConfig's
    # redis_url (None: a private redis-server for the run) and a queue of the run's own
    queue_timeout_s: float = 600.0

    # llama_cpp: llama.cpp measured in the same run (llama-batched-bench on the decode shape,
    # llama-server on the throughput trace); unavailable without its binaries
    llama_cpp: str | None = None  # directory of the binaries (None: $PAGEDQ_LLAMA_CPP)
    llama_cpp_model: str | None = None  # a GGUF of the same weights (None: the default model's)
    llama_cpp_server_slots: int = 16  # llama-server's parallel sequences (-np)

    # quant: GGUF files served packed, against llama.cpp on the same files (see quant.py);
    # beyond the bundled Q4_1 they are made by llama-quantize from its F32 dequantization
    quant_types: tuple[str, ...] = ("Q4_1", "Q8_0", "Q4_K_M")
    quant_fidelity_tokens: int = 32  # greedy tokens per fidelity prompt
    # decode sweeps per engine and file, alternated (pagedq, llama.cpp, pagedq, ...): each side's
    # best per stream count is reported, as a shared machine only ever slows a run down
    quant_repeats: int = 2

    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def engine_config(self, **overrides: Any) -> EngineConfig:
        """The run's engine knobs as an EngineConfig, with a scenario's ``overrides``."""
        knobs = {f.name: getattr(self, f.name) for f in fields(EngineConfig)}
        return EngineConfig(**{**knobs, **overrides})

    def run_queue(self, url: str, scenario: str) -> QueueConfig:
        """The queue a scenario serves on ``url``: a fresh name from the ``queue`` stem, with
        this run's prefix, ttl and TLS files (what its worker, gateway and clients are given)."""
        name = f"{self.queue}-{scenario}-{os.getpid()}-{int(time.time())}"
        return replace(self.queue_config, redis_url=url, queue=name)

    def with_(self, **changes: Any) -> BenchConfig:
        return replace(self, **changes)

    def with_settings(self, settings: list[str]) -> BenchConfig:
        """Apply ``FIELD=VALUE`` strings (the CLI's ``--set``), typed like the field's default:
        ints, floats, bools, comma-separated int tuples, or ``none``."""
        changes: dict[str, Any] = {}
        names = sorted(f.name for f in fields(self) if f.name != "extra")
        for item in settings:
            name, sep, raw = item.partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in names:
                raise ValueError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of "
                                 f"{names}")
            changes[name] = _parse_like(getattr(self, name), raw.strip(), name)
        return replace(self, **changes)


def _is_float(raw: str) -> bool:
    try:
        float(raw)
    except ValueError:
        return False
    return True


def _parse_like(current: Any, raw: str, name: str) -> Any:
    if raw.lower() == "none":
        return None
    try:
        if isinstance(current, bool):
            return raw.lower() in ("1", "true", "yes", "on")
        if isinstance(current, tuple):
            return tuple(int(v) if v.strip().lstrip("-").isdigit() else v.strip()
                         for v in raw.split(",") if v.strip())
        if isinstance(current, LengthDist):
            median, sigma, low, high = (float(v) for v in raw.split(","))
            return LengthDist(median, sigma, int(low), int(high))
        if isinstance(current, int):
            return int(raw)
        if isinstance(current, float):
            return float(raw)
        if current is None and raw.lstrip("-").isdigit():  # an optional int such as block_size
            return int(raw)
        if current is None and _is_float(raw):  # an optional float such as spec_tie_margin
            return float(raw)
    except ValueError as exc:
        raise ValueError(f"--set {name}={raw!r}: {exc}") from exc
    return raw


def full(**overrides: Any) -> BenchConfig:
    """The target shapes: expect 10-20 minutes on 2 CPU cores."""
    return BenchConfig(profile="full", **overrides)


def quick(**overrides: Any) -> BenchConfig:
    """Smaller traces and shorter decodes with the same structure (target: < 3 min, 2 cores)."""
    base = dict(
        profile="quick",
        throughput_requests=16,
        prompt_dist=LengthDist(median=96.0, sigma=0.8, low=32, high=256),
        output_dist=LengthDist(median=40.0, sigma=0.6, low=16, high=64),
        hf_batch_size=16,
        decode_prompt_tokens=32,  # the full profile keeps llama-batched-bench's 128/128 shape
        decode_new_tokens=24,  # 24 decode steps per batch size keep the run under 3 minutes
        decode_kv_cache_dtype=None,  # the fp16-cache sweep is the full run's (time)
        capacity_requests=24,
        capacity_reserved_slots=2,
        capacity_max_model_len=1024,
        itl_decodes=8,
        itl_decode_new_tokens=48,
        itl_inject_after_tokens=8,
        itl_long_prompt_tokens=1024,
        prefix_repeats=2,
        sharing_new_tokens=32,
        quant_types=("Q4_1",),  # the full run adds Q8_0 and Q4_K_M
        shared_new_tokens=32,
        shared_repeats=2,
        quant_fidelity_tokens=16,
        structured_requests=16,
        spec_rounds=(1, 1, 1),
        spec_learning_rounds=1,
        spec_max_tokens=48,
        spec_threshold_streams=(16,),
    )
    base.update(overrides)
    return BenchConfig(**base)
