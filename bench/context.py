"""What every benchmark scenario shares: the run's config, model, traces and results.

``BenchContext`` is the state of one ``pagedq bench`` invocation; scenarios take it and write
their raw measurements into ``results``. It imports no scenario, so scenarios, the report and
the orchestration (pagedq.bench.run, which subclasses it as ``BenchRun``) all import it
downward and the bench has no import cycle.
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedq.bench import driver, hf_baseline
from pagedq.bench.options import BenchConfig
from pagedq.bench.workload import BenchRequest, TokenSpace, fixed_shape, sharegpt_like
from pagedq.logging import get_logger

log = get_logger("pagedq.bench")


class Unavailable(Exception):
    """A figure cannot be measured here; the message says why and what would enable it."""


def peak_rss_mb() -> float:
    """This process's peak resident set so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@dataclass
class BenchContext:
    """One ``pagedq bench`` invocation's config, shared inputs and everything it measured: what
    every scenario reads and writes (``BenchRun`` in pagedq.bench.run adds the orchestration)."""

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
        # lazy, measured: the engine side (engine, model layer, gguf, jsonschema) adds ~0.9 s
        # to importing the bench after torch; `pagedq bench --from-json` renders a report without it
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
            # a config converted from a GGUF names no architectures: its model_type says it
            "architecture": (cfg.architectures or [getattr(cfg, "model_type", None) or "?"])[0],
            "vocab_size": int(cfg.vocab_size),
            "max_position_embeddings": int(cfg.max_position_embeddings),
        }

    def engine(self, **overrides: Any) -> Any:
        """A fresh Engine on the run's model with the run's knobs, overridden per scenario."""
        # the engine side is lazy in bench/: see context.py's setup
        from pagedq.worker import Engine

        engine = Engine(config=self.config.engine_config(
            **{"model": str(self.model_dir), **overrides}))
        driver.warm_up(engine, self.space.low)
        return engine

    def hf(self) -> hf_baseline.HFModel:
        if self._hf is None:
            # the engine side is lazy in bench/: see setup
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
