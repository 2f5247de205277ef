"""The benchmark scenarios: each measures pagedq and its baseline in the same run.

Every scenario is a function of the ``BenchContext`` (pagedq.bench.context), named ``bench``,
that writes its raw measurements into ``bench.results``; the run decides their order and catches
their failures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedq.bench import contiguous, driver, gateway_path, hf_baseline, queue_path
from pagedq.bench import llama_cpp as cpp_peer  # the module; llama_cpp() below is the scenario
from pagedq.bench.context import BenchContext, Unavailable
from pagedq.bench.options import BenchConfig
from pagedq.bench.timeline import Timeline
from pagedq.bench.workload import BenchRequest, fixed_shape, sharegpt_like, trace_summary
from pagedq.client import SamplingParams
from pagedq.errors import InvalidRequestError
from pagedq.logging import get_logger

__all__ = ["Unavailable"]  # re-exported: scenarios raise it, the run catches it

log = get_logger("pagedq.bench")


@dataclass
class BatchedBenchRow:
    """One row of llama.cpp's ``llama-batched-bench`` table (same column names)."""

    pp: int
    tg: int
    b: int
    n_kv: int
    t_pp: float
    s_pp: float
    t_tg: float
    s_tg: float
    t: float
    s: float

    @classmethod
    def from_phases(cls, pp: int, tg: int, b: int, t_pp: float, decode_tokens: int,
                    t_tg: float, total: float) -> BatchedBenchRow:
        return cls(pp=pp, tg=tg, b=b, n_kv=b * (pp + tg), t_pp=t_pp,
                   s_pp=b * pp / max(t_pp, 1e-9), t_tg=t_tg,
                   s_tg=decode_tokens / max(t_tg, 1e-9), t=total,
                   s=b * (pp + tg) / max(total, 1e-9))


# -- pagedq on the serving engine ----------------------------------------------------------
def serving_scenarios(bench: BenchContext, wanted: set[str]) -> None:
    """Throughput, decode sweep and prefix share one engine (built once)."""
    engine = bench.engine(**bench.serving_engine_kwargs())
    bench.results["serving_engine"] = {
        k: engine.stats()[k] for k in ("kv_blocks_total", "block_size", "max_num_seqs",
                                       "max_model_len")
    }
    if wanted & {"throughput", "queue"}:
        bench._timed("throughput_pagedq", lambda: throughput_pagedq(bench, engine))
    if "queue" in wanted:  # right after its in-process baseline, see queue()
        bench._timed("queue", lambda: queue(bench, engine))
    if "decode" in wanted:
        bench._timed("decode_pagedq", lambda: decode_pagedq(bench, engine))
        kv = bench.config.decode_kv_cache_dtype
        if kv and kv != bench.config.kv_cache_dtype:
            bench._timed("decode_pagedq_kv", lambda: decode_pagedq_kv(bench, kv))
    if "prefix" in wanted:
        bench._timed("prefix", lambda: prefix(bench, engine))
    if "sharing" in wanted:
        bench._timed("sharing", lambda: sharing(bench, engine))


def sharing(bench: BenchContext, engine: Any) -> None:
    """Peak KV blocks of one n=4 request and one beam-width-4 search on a long prompt, next
    to what four unshared copies of the same sequences would hold."""
    # the engine side is lazy in bench/: see context.py's setup
    from pagedq.worker.engine.beam_search import BeamParams, add_beam_request

    c = bench.config
    new = min(c.sharing_new_tokens, engine.max_model_len // 4)
    plen = min(c.sharing_prompt_tokens, engine.max_model_len - new)  # fits the engine
    prompt = bench.space.sample(np.random.default_rng(c.seed + 9), plen)
    unshared = 4 * bench.blocks_for(plen + new)
    out: dict[str, Any] = {"prompt_tokens": plen, "new_tokens": new,
                           "unshared_blocks": unshared}
    cases = {
        "n4": lambda rid: engine.add_request(rid, prompt, SamplingParams(
            n=4, temperature=1.0, seed=c.seed, max_tokens=new, ignore_eos=True)),
        "beam4": lambda rid: add_beam_request(engine, rid, prompt, BeamParams(4, new)),
    }
    for name, add in cases.items():
        base = engine.stats()["kv_blocks_used"]
        add(f"share-{name}")
        peak = 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.stats()["kv_blocks_used"] - base)
        out[f"{name}_peak_blocks"] = peak
    bench.results["sharing"] = out


def throughput_pagedq(bench: BenchContext, engine: Any) -> None:
    trace = bench.throughput_trace()
    run = driver.serve(engine, trace, keep_outputs=True)
    bench.results["throughput_trace"] = trace_summary(trace)
    bench.results["throughput_pagedq"] = run


def decode_pagedq(bench: BenchContext, engine: Any) -> None:
    bench.results["decode_pagedq"] = decode_rows(bench, engine)


def decode_pagedq_kv(bench: BenchContext, kv_cache_dtype: str) -> None:
    """The same sweep on an engine whose KV cache is ``kv_cache_dtype``; unavailable (not an
    error) where the engine refuses that cache, e.g. a bfloat16 model or CUDA."""
    try:
        engine = bench.engine(**bench.serving_engine_kwargs(), kv_cache_dtype=kv_cache_dtype)
    except InvalidRequestError as exc:
        raise Unavailable(str(exc)) from exc
    bench.results["decode_pagedq_kv"] = {"kv_cache_dtype": kv_cache_dtype,
                                        "rows": decode_rows(bench, engine)}


def decode_rows(bench: BenchContext, engine: Any,
                batches: tuple[int, ...] | None = None) -> list[dict[str, float]]:
    """The decode sweep over ``batches`` streams (default: the run's decode_batches)."""
    rows = []
    for batch in batches or bench.config.decode_batches:
        run = driver.serve(engine, bench.decode_trace(batch), record_kv=False)
        rows.append(pagedq_batched_row(run.timeline, batch, bench.config))
    return rows


def prefix(bench: BenchContext, engine: Any) -> None:
    """TTFT of prefix+suffix with the prefix cached (primed by another request sharing it)
    over the TTFT of an equally long request whose prefix was never seen."""
    c = bench.config
    rng = np.random.default_rng(c.seed + 7)
    cold, warm, hits = [], [], []
    for rep in range(c.prefix_repeats):
        fresh = bench.space.sample(rng, c.prefix_tokens)
        cached = bench.space.sample(rng, c.prefix_tokens)
        suffix = bench.space.sample(rng, c.prefix_suffix_tokens)
        other = bench.space.sample(rng, c.prefix_suffix_tokens)
        cold.append(single_ttft(engine, f"pfx-cold-{rep}", fresh + suffix))
        single_ttft(engine, f"pfx-prime-{rep}", cached + other)
        before = engine.stats().get("prefix_cache_hits", 0)
        warm.append(single_ttft(engine, f"pfx-warm-{rep}", cached + suffix))
        hits.append(engine.stats().get("prefix_cache_hits", 0) - before)
    if not any(h > 0 for h in hits):
        raise Unavailable(
            "prefix caching did not hit (engine.stats()['prefix_cache_hits'] stayed the same "
            "for a request whose prefix was just computed): enable_prefix_caching is off or "
            "not implemented in this engine")
    bench.results["prefix"] = {"ttft_cold_s": cold, "ttft_cached_s": warm,
                              "prefix_cache_hits": hits,
                              "prefix_tokens": c.prefix_tokens,
                              "suffix_tokens": c.prefix_suffix_tokens}


# -- capacity: KV utilization and concurrency at equal memory ----------------------------
def capacity(bench: BenchContext) -> None:
    c = bench.config
    budget = c.capacity_reserved_slots * c.capacity_max_model_len
    trace = sharegpt_like(c.capacity_requests, bench.space, seed=c.seed + 1,
                          prompt=c.prompt_dist, output=c.output_dist, prefix="cap")
    engine = bench.engine(num_kv_blocks=budget // c.block_size,
                         max_num_seqs=c.capacity_max_num_seqs,
                         max_model_len=c.capacity_max_model_len)
    run = driver.serve(engine, trace)
    del engine
    sim = contiguous.simulate_reservation(trace, budget, c.capacity_max_model_len)
    bench.results["capacity"] = {"run": run, "sim": sim, "budget_tokens": budget,
                                "trace": trace_summary(trace)}


# -- ITL: decodes while a long prompt arrives --------------------------------------------
def itl(bench: BenchContext) -> None:
    out = {}
    for chunked in (True, False):
        out["chunked" if chunked else "unchunked"] = _itl_run(bench, chunked)
    bench.results["itl"] = out


def _itl_run(bench: BenchContext, chunked: bool) -> dict[str, Any]:
    c = bench.config
    if not 0 < c.itl_inject_after_tokens < c.itl_decode_new_tokens:
        raise ValueError("itl_inject_after_tokens must be in (0, itl_decode_new_tokens): the "
                         "long prompt has to arrive while the decodes are still running")
    long_new = 4
    long_len = c.itl_long_prompt_tokens + long_new
    per_decode = c.itl_decode_prompt_tokens + c.itl_decode_new_tokens
    blocks = bench.blocks_for(long_len) + c.itl_decodes * bench.blocks_for(per_decode) + 8
    budget = (c.max_num_batched_tokens if chunked
              else max(c.max_num_batched_tokens, long_len + c.itl_decodes))
    engine = bench.engine(num_kv_blocks=blocks, max_num_seqs=c.itl_decodes + 1,
                         max_model_len=max(long_len, per_decode),
                         max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                         enable_prefix_caching=False,
                         long_prefill_token_threshold=c.itl_prefill_chunk if chunked else 0)
    decodes = fixed_shape(c.itl_decodes, c.itl_decode_prompt_tokens,
                          c.itl_decode_new_tokens, bench.space, seed=c.seed + 11, prefix="itl")
    long = fixed_shape(1, c.itl_long_prompt_tokens, long_new, bench.space, seed=c.seed + 12,
                       prefix="long")
    drv = driver.EngineDriver(engine, record_kv=False)
    drv.add(decodes)
    times = drv.run.timeline.requests
    drv.run_until(lambda: all(len(times[r.request_id].token_times)
                              >= c.itl_inject_after_tokens for r in decodes))
    injected_at = time.perf_counter() - drv.run.timeline.start
    drv.add(long)
    run = drv.run_until()
    ids = [r.request_id for r in decodes]
    itls = run.timeline.itls(ids)
    if len(ids) < 0.01 * itls.size:
        log.warning("itl: one stall per stream is under 1% of the gaps, so p99 may not see "
                    "it; use fewer itl_decode_new_tokens", gaps=int(itls.size), streams=len(ids))
    return {"itls": itls, "streams": ids, "injected_at_s": injected_at,
            "long_ttft_s": run.timeline.requests[long[0].request_id].ttft,
            "max_num_batched_tokens": budget}


# -- the Redis path -----------------------------------------------------------------------
def queue(bench: BenchContext, engine: Any) -> None:
    inproc = bench.results.get("throughput_pagedq")
    if inproc is None:
        raise Unavailable("the in-process throughput run failed, so there is no baseline")
    bench.results["queue"] = queue_path.serve_through_redis(bench, bench.throughput_trace())
    # the in-process run again, right after the Redis run (its prefix cache reset, or the
    # repeated prompts would hit it): the baseline is the mean of the two in-process runs
    # that bracket the Redis run, so a drift of the machine's speed cancels to first order
    if not engine.reset_prefix_cache():
        raise RuntimeError("the serving engine still has requests; cannot rerun the trace")
    after = driver.serve(engine, bench.throughput_trace(), record_kv=False)
    bench.results["queue_inprocess_after_tok_s"] = after.timeline.tokens_per_s


# -- the Hugging Face baseline --------------------------------------------------------------
def gateway(bench: BenchContext) -> None:
    bench.results["gateway"] = gateway_path.serve_through_gateway(bench, bench.throughput_trace())


def throughput_hf(bench: BenchContext) -> None:
    timeline, outputs = hf_baseline.serve_static(bench.hf(), bench.throughput_trace(),
                                                 bench.config.hf_batch_size)
    bench.results["throughput_hf"] = {"timeline": timeline, "outputs": outputs}


# -- llama.cpp, the CPU peer ---------------------------------------------------------------
def llama_cpp(bench: BenchContext, wanted: set[str]) -> None:
    """The decode sweep through llama-batched-bench and the throughput trace through
    llama-server, on the GGUF pagedq serves packed (auto quantization), else an F32 GGUF of the
    same weights (see llama_cpp.py)."""
    # the engine side is lazy in bench/: see context.py's setup
    from pagedq.worker.models.default_model import default_gguf
    from pagedq.worker.models.model_cache import cache_dir, packed_source

    c = bench.config
    if torch.device(c.device or ("cuda" if torch.cuda.is_available() else "cpu")).type != "cpu":
        raise Unavailable("llama.cpp is the CPU peer: its figures are measured on CPU runs")
    if c.dtype != "float32":
        raise Unavailable(f"llama.cpp runs the GGUF in float32; this run's dtype is {c.dtype}")
    try:
        cpp = cpp_peer.LlamaCpp.locate(c.llama_cpp)
    except cpp_peer.LlamaCppUnavailable as exc:
        raise Unavailable(str(exc)) from exc
    packed = packed_source(bench.model_dir)  # the GGUF pagedq serves as shipped, if any
    if c.llama_cpp_model:
        gguf = Path(c.llama_cpp_model).expanduser()
    elif packed is not None:
        gguf = packed
    elif c.model is None:
        gguf = cpp_peer.f32_gguf(cpp, default_gguf(), cache_dir() / "llama_cpp")
    else:
        raise Unavailable("llama.cpp needs a GGUF of this run's model: --set "
                          "llama_cpp_model=PATH.gguf (f32, the same weights)")
    no_repack = not gguf.name.endswith(".F32.gguf")  # -nr: see quant.py
    threads = c.num_threads or torch.get_num_threads()
    out: dict[str, Any] = {"version": cpp.version(), "gguf": str(gguf), "threads": threads}
    if "decode" in wanted:
        out["decode_rows"] = cpp_peer.batched_bench(
            cpp, gguf, c.decode_prompt_tokens, c.decode_new_tokens, c.decode_batches, threads,
            no_repack=no_repack)
    if "throughput" in wanted:
        out["throughput"] = cpp_peer.serve_trace(
            cpp, gguf, bench.throughput_trace(), c.llama_cpp_server_slots, c.max_model_len,
            threads, c.queue_timeout_s, no_repack=no_repack)
    bench.results["llama_cpp"] = out


def decode_hf(bench: BenchContext) -> None:
    rows = []
    for batch in bench.config.decode_batches:
        timing, _ = hf_baseline.generate_batch(bench.hf(), bench.decode_trace(batch))
        rows.append(hf_batched_row(timing, batch, bench.config))
    bench.results["decode_hf"] = rows


# -- helpers shared by the scenarios -----------------------------------------------------------
def single_ttft(engine: Any, request_id: str, prompt: list[int]) -> float:
    """Serve one request alone (one output token) and return its TTFT."""
    run = driver.serve(engine, [BenchRequest(request_id, prompt, 1)], record_kv=False)
    ttft = run.timeline.requests[request_id].ttft
    if ttft is None:
        raise RuntimeError(f"request {request_id} produced no token")
    return ttft


def pagedq_batched_row(timeline: Timeline, batch: int, c: BenchConfig) -> dict[str, float]:
    """The prompt phase ends when the last sequence has its first token; tokens after that,
    over the time after that, are the decode rate (like llama-batched-bench's S_TG)."""
    firsts = [r.token_times[0] for r in timeline.requests.values()]
    prompt_done = max(firsts)
    last = max(r.token_times[-1] for r in timeline.requests.values())
    decode_tokens = sum(sum(1 for t in r.token_times if t > prompt_done)
                        for r in timeline.requests.values())
    row = BatchedBenchRow.from_phases(
        c.decode_prompt_tokens, c.decode_new_tokens, batch, t_pp=prompt_done - timeline.start,
        decode_tokens=decode_tokens, t_tg=last - prompt_done, total=timeline.elapsed)
    return row.__dict__


def hf_batched_row(timing: hf_baseline.HFBatch, batch: int, c: BenchConfig) -> dict[str, float]:
    """Step 1 of ``generate`` is the prompt forward; steps 2..N are decodes of the batch."""
    steps = timing.step_times
    row = BatchedBenchRow.from_phases(
        c.decode_prompt_tokens, c.decode_new_tokens, batch, t_pp=steps[0] - timing.started,
        decode_tokens=batch * (len(steps) - 1), t_tg=steps[-1] - steps[0],
        total=timing.finished - timing.started)
    return row.__dict__
