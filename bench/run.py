"""One ``pagedq bench`` invocation: its shared inputs, its orchestration and ``run_bench``.

``BenchRun.execute()`` runs the selected scenarios (pagedq.bench.scenarios) in an order
that keeps the comparisons clean: every pagedq measurement first (so the peak RSS recorded after
them is pagedq's own), then the Redis path (a worker subprocess), then the Hugging Face and
llama.cpp baselines. Each scenario writes its raw results into ``run.results``;
``report.assemble`` turns them into the report's figures.

A scenario whose dependency is missing (no Redis worker, no prefix caching) raises
``Unavailable`` and its figures are reported as unavailable with the reason; any other error is
logged, recorded under ``errors`` and the run carries on, so one broken part never hides the rest.
"""

from __future__ import annotations

import functools
import gc
import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedq.logging import get_logger

from . import driver, hf_baseline, memory_bound, quant_scenario, scenarios, shared_cpu, structured_scenario
from .options import BenchConfig
from .scenarios import Unavailable
from .workload import BenchRequest, TokenSpace, fixed_shape, sharegpt_like

log = get_logger("pagedq.bench")


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
            engine_parts.append(("serving", lambda: scenarios.serving_scenarios(self, wanted)))
        if "capacity" in wanted:
            engine_parts.append(("capacity", functools.partial(scenarios.capacity, self)))
        if "itl" in wanted:
            engine_parts.append(("itl", functools.partial(scenarios.itl, self)))
        if "structured" in wanted:
            engine_parts.append(("structured", functools.partial(structured_scenario.structured, self)))
        if "shared" in wanted:
            engine_parts.append(("shared", functools.partial(shared_cpu.measure, self)))
        for name, part in engine_parts:
            self._timed(name, part)
            gc.collect()  # the part's engine (and its KV cache) is gone before the next one
        if "gateway" in wanted:
            self._timed("gateway", functools.partial(scenarios.gateway, self))
        self.results["peak_rss_mb_pagedq"] = peak_rss_mb()
        if "throughput" in wanted:
            self._timed("throughput_hf", functools.partial(scenarios.throughput_hf, self))
        if "decode" in wanted:
            self._timed("decode_hf", functools.partial(scenarios.decode_hf, self))
        self._hf = None
        gc.collect()
        if "llama_cpp" in wanted and wanted & {"throughput", "decode"}:
            self._timed("llama_cpp", lambda: scenarios.llama_cpp(self, wanted))
        if "quant" in wanted:
            self._timed("quant", functools.partial(quant_scenario.measure, self))
        if "memory" in wanted:
            self._timed("memory", functools.partial(memory_bound.measure, self))
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


def run_bench(config: BenchConfig, json_path: str | None = None,
              plot_dir: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """Run, assemble, write; returns the JSON document and the plot paths."""
    from . import report

    run = BenchRun(config)
    run.execute()
    doc = report.assemble(run)
    plots: list[str] = []
    if plot_dir:
        plots = [str(p) for p in report.plot(run, doc, plot_dir)]
        doc["plots"] = plots
    if json_path:
        report.write_json(doc, json_path)
    return doc, plots
