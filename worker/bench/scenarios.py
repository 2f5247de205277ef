"""The benchmark scenarios: each measures pagedq and its baseline in the same run.

``BenchRun.execute()`` runs the selected scenarios in an order that keeps the comparisons
clean: every pagedq measurement first (so the peak RSS recorded after them is pagedq's own),
then the Redis path (a worker subprocess), then the Hugging Face baseline. Each scenario writes
its raw results into ``self.results``; ``report.assemble`` turns them into the report's figures.

A scenario whose dependency is missing (no Redis worker, no prefix caching) raises
``Unavailable`` and its figures are reported as unavailable with the reason; any other error is
logged, recorded under ``errors`` and the run carries on, so one broken part never hides the rest.
"""

from __future__ import annotations

import gc
import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedq.worker.logging import get_logger

from . import contiguous, driver, hf_baseline, quant
from .config import BenchConfig
from .timeline import Timeline
from .workload import BenchRequest, TokenSpace, fixed_shape, sharegpt_like, trace_summary

log = get_logger("pagedq.bench")


class Unavailable(Exception):
    """A figure cannot be measured here; the message says why and what would enable it."""


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


def peak_rss_mb() -> float:
    """This process's peak resident set so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@dataclass
class BenchRun:
    """One ``pagedq bench`` invocation: its config, shared inputs and everything it measured."""

    config: BenchConfig
    results: dict[str, Any] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    elapsed_s: dict[str, float] = field(default_factory=dict)
    model_dir: Path | None = None
    space: TokenSpace | None = None
    _hf: hf_baseline.HFModel | None = None

    def __post_init__(self) -> None:
        if self.config.block_size is None:  # the engine's own default for the run's device
            self.config = self.config.with_(block_size=self.config.resolved_block_size())

    # -- set-up -----------------------------------------------------------------------------
    def setup(self) -> None:
        """Resolve the model once (both systems load the same directory) and set threads."""
        from pagedq.worker.models.loader import load_config, load_tokenizer, resolve_model

        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        # pagedq serves the model as its quantization asks (a GGUF's blocks kept packed); the
        # HF baseline loads the fp32 conversion (see hf())
        self.model_dir = resolve_model(self.config.model,
                                       packed=self.config.quantization == "auto")
        cfg = load_config(self.model_dir)
        tok = load_tokenizer(self.model_dir)
        specials: list[int | None] = [cfg.bos_token_id, getattr(cfg, "pad_token_id", None)]
        eos = cfg.eos_token_id
        specials += eos if isinstance(eos, list) else [eos]
        if tok is not None:
            specials += list(tok.all_special_ids)
        self.space = TokenSpace.for_model(int(cfg.vocab_size), specials)
        self.results["model"] = {
            "dir": str(self.model_dir),
            "architecture": (cfg.architectures or ["?"])[0],
            "vocab_size": int(cfg.vocab_size),
            "max_position_embeddings": int(cfg.max_position_embeddings),
        }

    def engine(self, **overrides: Any) -> Any:
        """A fresh Engine on the run's model with the run's knobs, overridden per scenario."""
        from pagedq.worker import Engine

        engine = Engine(config=self.config.engine_config(
            **{"model": str(self.model_dir), **overrides}))
        driver.warm_up(engine, self.space.low)
        return engine

    def hf(self) -> hf_baseline.HFModel:
        if self._hf is None:
            from pagedq.worker.models.loader import resolve_model

            self._hf = hf_baseline.load_hf_model(resolve_model(self.config.model),
                                                 self.config.dtype, self.config.device)
            hf_baseline.warm_up(self._hf, self.space.low)
        return self._hf

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.config.block_size)

    # -- traces -----------------------------------------------------------------------------
    def throughput_trace(self) -> list[BenchRequest]:
        c = self.config
        return sharegpt_like(c.throughput_requests, self.space, seed=c.seed,
                             prompt=c.prompt_dist, output=c.output_dist, prefix="tp")

    def decode_trace(self, batch: int) -> list[BenchRequest]:
        c = self.config
        return fixed_shape(batch, c.decode_prompt_tokens, c.decode_new_tokens, self.space,
                           seed=c.seed + batch, prefix=f"dec{batch}")

    def serving_engine_kwargs(self) -> dict[str, Any]:
        """The serving engine holds the whole throughput trace or the largest decode batch at
        once, so neither run is limited by KV memory (HF's dynamic cache is not either)."""
        c = self.config
        trace_blocks = sum(self.blocks_for(r.total_len) for r in self.throughput_trace())
        sweep_blocks = max(c.decode_batches) * self.blocks_for(
            c.decode_prompt_tokens + c.decode_new_tokens)
        prefix_blocks = 4 * self.blocks_for(c.prefix_tokens + c.prefix_suffix_tokens + 1)
        sharing_blocks = 4 * self.blocks_for(c.sharing_prompt_tokens + c.sharing_new_tokens)
        return dict(num_kv_blocks=max(trace_blocks, sweep_blocks, prefix_blocks,
                                      sharing_blocks) + 16,
                    max_num_seqs=max(c.max_num_seqs, max(c.decode_batches)))

    # -- orchestration ----------------------------------------------------------------------
    def execute(self) -> None:
        """Run the selected scenarios (pagedq first, then Redis, then HF) and keep going on
        failure."""
        wanted = set(self.config.scenarios)
        began = time.perf_counter()
        self._timed("setup", self.setup)
        if self.model_dir is None:
            return
        engine_parts: list[tuple[str, Callable[[], None]]] = []
        if wanted & {"throughput", "decode", "prefix", "sharing", "queue"}:
            engine_parts.append(("serving", lambda: self.serving_scenarios(wanted)))
        if "capacity" in wanted:
            engine_parts.append(("capacity", self.capacity))
        if "itl" in wanted:
            engine_parts.append(("itl", self.itl))
        for name, part in engine_parts:
            self._timed(name, part)
            gc.collect()  # the part's engine (and its KV cache) is gone before the next one
        self.results["peak_rss_mb_pagedq"] = peak_rss_mb()
        if "throughput" in wanted:
            self._timed("throughput_hf", self.throughput_hf)
        if "decode" in wanted:
            self._timed("decode_hf", self.decode_hf)
        self._hf = None
        gc.collect()
        if "llama_cpp" in wanted and wanted & {"throughput", "decode"}:
            self._timed("llama_cpp", lambda: self.llama_cpp(wanted))
        if "quant" in wanted:
            self._timed("quant", lambda: quant.measure(self))
        self.results["peak_rss_mb_total"] = peak_rss_mb()
        self.elapsed_s["total"] = round(time.perf_counter() - began, 3)

    def _timed(self, name: str, fn: Callable[[], None]) -> None:
        began = time.perf_counter()
        log.info("bench scenario", scenario=name)
        try:
            fn()
        except Unavailable as exc:
            self.unavailable[name] = str(exc)
            log.warning("bench scenario unavailable", scenario=name, why=str(exc))
        except Exception as exc:  # noqa: BLE001 - one broken part must not hide the others
            self.errors[name] = f"{type(exc).__name__}: {exc}"
            log.exception("bench scenario failed", scenario=name)
        finally:
            self.elapsed_s[name] = round(time.perf_counter() - began, 3)

    # -- pagedq on the serving engine ----------------------------------------------------------
    def serving_scenarios(self, wanted: set[str]) -> None:
        """Throughput, decode sweep and prefix share one engine (built once)."""
        engine = self.engine(**self.serving_engine_kwargs())
        self.results["serving_engine"] = {
            k: engine.stats()[k] for k in ("kv_blocks_total", "block_size", "max_num_seqs",
                                           "max_model_len")
        }
        if wanted & {"throughput", "queue"}:
            self._timed("throughput_pagedq", lambda: self.throughput_pagedq(engine))
        if "queue" in wanted:  # right after its in-process baseline, see queue()
            self._timed("queue", lambda: self.queue(engine))
        if "decode" in wanted:
            self._timed("decode_pagedq", lambda: self.decode_pagedq(engine))
            kv = self.config.decode_kv_cache_dtype
            if kv and kv != self.config.kv_cache_dtype:
                self._timed("decode_pagedq_kv", lambda: self.decode_pagedq_kv(kv))
        if "prefix" in wanted:
            self._timed("prefix", lambda: self.prefix(engine))
        if "sharing" in wanted:
            self._timed("sharing", lambda: self.sharing(engine))

    def sharing(self, engine: Any) -> None:
        """Peak KV blocks of one n=4 request and one beam-width-4 search on a long prompt, next
        to what four unshared copies of the same sequences would hold."""
        from pagedq.client import SamplingParams
        from pagedq.worker.engine.beam_search import BeamParams, add_beam_request

        c = self.config
        new = min(c.sharing_new_tokens, engine.max_model_len // 4)
        plen = min(c.sharing_prompt_tokens, engine.max_model_len - new)  # fits the engine
        prompt = self.space.sample(np.random.default_rng(c.seed + 9), plen)
        unshared = 4 * self.blocks_for(plen + new)
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
        self.results["sharing"] = out

    def throughput_pagedq(self, engine: Any) -> None:
        trace = self.throughput_trace()
        run = driver.serve(engine, trace, keep_outputs=True)
        self.results["throughput_trace"] = trace_summary(trace)
        self.results["throughput_pagedq"] = run

    def decode_pagedq(self, engine: Any) -> None:
        self.results["decode_pagedq"] = self.decode_rows(engine)

    def decode_pagedq_kv(self, kv_cache_dtype: str) -> None:
        """The same sweep on an engine whose KV cache is ``kv_cache_dtype``; unavailable (not an
        error) where the engine refuses that cache, e.g. a bfloat16 model or CUDA."""
        from pagedq.errors import InvalidRequestError

        try:
            engine = self.engine(**self.serving_engine_kwargs(), kv_cache_dtype=kv_cache_dtype)
        except InvalidRequestError as exc:
            raise Unavailable(str(exc)) from exc
        self.results["decode_pagedq_kv"] = {"kv_cache_dtype": kv_cache_dtype,
                                            "rows": self.decode_rows(engine)}

    def decode_rows(self, engine: Any) -> list[dict[str, float]]:
        rows = []
        for batch in self.config.decode_batches:
            run = driver.serve(engine, self.decode_trace(batch), record_kv=False)
            rows.append(pagedq_batched_row(run.timeline, batch, self.config))
        return rows

    def prefix(self, engine: Any) -> None:
        """TTFT of prefix+suffix with the prefix cached (primed by another request sharing it)
        over the TTFT of an equally long request whose prefix was never seen."""
        c = self.config
        rng = np.random.default_rng(c.seed + 7)
        cold, warm, hits = [], [], []
        for rep in range(c.prefix_repeats):
            fresh = self.space.sample(rng, c.prefix_tokens)
            cached = self.space.sample(rng, c.prefix_tokens)
            suffix = self.space.sample(rng, c.prefix_suffix_tokens)
            other = self.space.sample(rng, c.prefix_suffix_tokens)
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
        self.results["prefix"] = {"ttft_cold_s": cold, "ttft_cached_s": warm,
                                  "prefix_cache_hits": hits,
                                  "prefix_tokens": c.prefix_tokens,
                                  "suffix_tokens": c.prefix_suffix_tokens}

    # -- capacity: KV utilization and concurrency at equal memory ----------------------------
    def capacity(self) -> None:
        c = self.config
        budget = c.capacity_reserved_slots * c.capacity_max_model_len
        trace = sharegpt_like(c.capacity_requests, self.space, seed=c.seed + 1,
                              prompt=c.prompt_dist, output=c.output_dist, prefix="cap")
        engine = self.engine(num_kv_blocks=budget // c.block_size,
                             max_num_seqs=c.capacity_max_num_seqs,
                             max_model_len=c.capacity_max_model_len)
        run = driver.serve(engine, trace)
        del engine
        sim = contiguous.simulate_reservation(trace, budget, c.capacity_max_model_len)
        self.results["capacity"] = {"run": run, "sim": sim, "budget_tokens": budget,
                                    "trace": trace_summary(trace)}

    # -- ITL: decodes while a long prompt arrives --------------------------------------------
    def itl(self) -> None:
        out = {}
        for chunked in (True, False):
            out["chunked" if chunked else "unchunked"] = self._itl_run(chunked)
        self.results["itl"] = out

    def _itl_run(self, chunked: bool) -> dict[str, Any]:
        c = self.config
        if not 0 < c.itl_inject_after_tokens < c.itl_decode_new_tokens:
            raise ValueError("itl_inject_after_tokens must be in (0, itl_decode_new_tokens): the "
                             "long prompt has to arrive while the decodes are still running")
        long_new = 4
        long_len = c.itl_long_prompt_tokens + long_new
        per_decode = c.itl_decode_prompt_tokens + c.itl_decode_new_tokens
        blocks = self.blocks_for(long_len) + c.itl_decodes * self.blocks_for(per_decode) + 8
        budget = (c.max_num_batched_tokens if chunked
                  else max(c.max_num_batched_tokens, long_len + c.itl_decodes))
        engine = self.engine(num_kv_blocks=blocks, max_num_seqs=c.itl_decodes + 1,
                             max_model_len=max(long_len, per_decode),
                             max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                             enable_prefix_caching=False,
                             long_prefill_token_threshold=c.itl_prefill_chunk if chunked else 0)
        decodes = fixed_shape(c.itl_decodes, c.itl_decode_prompt_tokens,
                              c.itl_decode_new_tokens, self.space, seed=c.seed + 11, prefix="itl")
        long = fixed_shape(1, c.itl_long_prompt_tokens, long_new, self.space, seed=c.seed + 12,
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
    def queue(self, engine: Any) -> None:
        from .queue_path import serve_through_redis

        inproc = self.results.get("throughput_pagedq")
        if inproc is None:
            raise Unavailable("the in-process throughput run failed, so there is no baseline")
        self.results["queue"] = serve_through_redis(self, self.throughput_trace())
        # the in-process run again, right after the Redis run (its prefix cache reset, or the
        # repeated prompts would hit it): the baseline is the mean of the two in-process runs
        # that bracket the Redis run, so a drift of the machine's speed cancels to first order
        if not engine.reset_prefix_cache():
            raise RuntimeError("the serving engine still has requests; cannot rerun the trace")
        after = driver.serve(engine, self.throughput_trace(), record_kv=False)
        self.results["queue_inprocess_after_tok_s"] = after.timeline.tokens_per_s

    # -- the Hugging Face baseline --------------------------------------------------------------
    def throughput_hf(self) -> None:
        timeline, outputs = hf_baseline.serve_static(self.hf(), self.throughput_trace(),
                                                     self.config.hf_batch_size)
        self.results["throughput_hf"] = {"timeline": timeline, "outputs": outputs}

    # -- llama.cpp, the CPU peer ---------------------------------------------------------------
    def llama_cpp(self, wanted: set[str]) -> None:
        """The decode sweep through llama-batched-bench and the throughput trace through
        llama-server, on the GGUF pagedq serves packed (auto quantization), else an F32 GGUF of
        the same weights (see llama_cpp.py)."""
        from pagedq.worker.models.default_model import default_gguf
        from pagedq.worker.models.loader import cache_dir, packed_source

        from . import llama_cpp

        c = self.config
        if torch.device(c.device or ("cuda" if torch.cuda.is_available() else "cpu")).type != "cpu":
            raise Unavailable("llama.cpp is the CPU peer: its figures are measured on CPU runs")
        if c.dtype != "float32":
            raise Unavailable(f"llama.cpp runs the GGUF in float32; this run's dtype is {c.dtype}")
        try:
            cpp = llama_cpp.LlamaCpp.locate(c.llama_cpp)
        except llama_cpp.LlamaCppUnavailable as exc:
            raise Unavailable(str(exc)) from exc
        packed = packed_source(self.model_dir)  # the GGUF pagedq serves as shipped, if any
        if c.llama_cpp_model:
            gguf = Path(c.llama_cpp_model).expanduser()
        elif packed is not None:
            gguf = packed
        elif c.model is None:
            gguf = llama_cpp.f32_gguf(cpp, default_gguf(), cache_dir() / "llama_cpp")
        else:
            raise Unavailable("llama.cpp needs a GGUF of this run's model: --set "
                              "llama_cpp_model=PATH.gguf (f32, the same weights)")
        no_repack = not gguf.name.endswith(".F32.gguf")  # -nr: see quant.py
        threads = c.num_threads or torch.get_num_threads()
        out: dict[str, Any] = {"version": cpp.version(), "gguf": str(gguf), "threads": threads}
        if "decode" in wanted:
            out["decode_rows"] = llama_cpp.batched_bench(
                cpp, gguf, c.decode_prompt_tokens, c.decode_new_tokens, c.decode_batches, threads,
                no_repack=no_repack)
        if "throughput" in wanted:
            out["throughput"] = llama_cpp.serve_trace(
                cpp, gguf, self.throughput_trace(), c.llama_cpp_server_slots, c.max_model_len,
                threads, c.queue_timeout_s, no_repack=no_repack)
        self.results["llama_cpp"] = out

    def decode_hf(self) -> None:
        rows = []
        for batch in self.config.decode_batches:
            timing, _ = hf_baseline.generate_batch(self.hf(), self.decode_trace(batch))
            rows.append(hf_batched_row(timing, batch, self.config))
        self.results["decode_hf"] = rows


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
