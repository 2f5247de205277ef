"""The baseline: Hugging Face transformers ``generate`` over static batches.

This is "traditional" serving: requests are cut into fixed batches in arrival order,
each batch is left-padded to its longest prompt and decoded until its longest request is done,
and the next batch waits for the whole previous one. To keep the comparison fair it runs the
same model files, dtype, device, thread count and trace as pagedq, under
``torch.inference_mode``, greedy, with EOS disabled exactly like pagedq's ``ignore_eos`` so
both produce the same tokens count; only each request's own ``max_tokens`` count as useful.

Token times come from a logits processor: ``generate`` calls it once per forward pass, right
after the logits of that step exist, so its clock marks when each step's tokens appeared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any

import torch

from pagedq.bench.timeline import Timeline
from pagedq.bench.workload import BenchRequest


class StepClock:
    """A no-op logits processor that records the wall time of every generation step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.is_cuda:  # the step's kernels are queued, not done: wait like pagedq does
            torch.cuda.synchronize(scores.device)
        self.times.append(perf_counter())
        return scores


@dataclass
class HFModel:
    """A loaded transformers model plus the one id it pads with."""

    model: Any
    pad_token_id: int
    device: torch.device
    vocab_size: int
    special_ids: list[int | None] = field(default_factory=list)


def load_hf_model(model_dir: str | Path, dtype: str = "float32",
                  device: str | None = None) -> HFModel:
    """Load the same files the engine serves; EOS is switched off in its generation config."""
    # transformers costs ~3 s to import: only the HF baseline's scenarios load its models
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the bench's own output is the table, not load bars
    path = Path(model_dir)
    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype)}
    if path.suffix == ".gguf":
        kwargs["gguf_file"] = path.name
        path = path.parent
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    # The engine's rule for device=None, so both sides always run on the same device.
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.to(dev).eval()
    cfg = model.config
    gen = model.generation_config
    eos = gen.eos_token_id if gen.eos_token_id is not None else cfg.eos_token_id
    eos_list = eos if isinstance(eos, list) else [eos]
    pad = gen.pad_token_id if gen.pad_token_id is not None else cfg.pad_token_id
    pad = pad if pad is not None else (eos_list[0] if eos_list[0] is not None else 0)
    # Like pagedq's ignore_eos: generation runs to max_new_tokens whatever the model says.
    gen.eos_token_id = None
    gen.pad_token_id = pad
    specials = [*eos_list, pad, getattr(cfg, "bos_token_id", None)]
    return HFModel(model, int(pad), dev, int(cfg.vocab_size), specials)


@dataclass
class HFBatch:
    """One static batch's timings: when it started and each step's clock time."""

    started: float
    step_times: list[float]
    finished: float


@torch.inference_mode()
def generate_batch(hf: HFModel, requests: list[BenchRequest]) -> tuple[HFBatch, list[list[int]]]:
    """Greedy ``generate`` on one left-padded batch; returns timings and each request's tokens."""
    width = max(r.prompt_len for r in requests)
    ids = torch.full((len(requests), width), hf.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for row, req in enumerate(requests):
        ids[row, width - req.prompt_len :] = torch.tensor(req.prompt_token_ids)
        mask[row, width - req.prompt_len :] = 1
    # transformers costs ~3 s to import: only the HF baseline's scenarios load its models
    from transformers import LogitsProcessorList

    clock = StepClock()
    max_new = max(r.max_tokens for r in requests)
    started = perf_counter()
    out = hf.model.generate(
        input_ids=ids.to(hf.device),
        attention_mask=mask.to(hf.device),
        max_new_tokens=max_new,
        do_sample=False,
        num_beams=1,
        logits_processor=LogitsProcessorList([clock]),
        pad_token_id=hf.pad_token_id,
    )
    finished = perf_counter()
    new = out[:, width:].tolist()
    tokens = [row[: req.max_tokens] for row, req in zip(new, requests, strict=True)]
    return HFBatch(started, clock.times, finished), tokens


def serve_static(
    hf: HFModel, requests: list[BenchRequest], batch_size: int
) -> tuple[Timeline, dict[str, list[int]]]:
    """Serve a trace (all arrived at once) in static batches; only useful tokens are stamped."""
    timeline = Timeline(start=perf_counter())
    outputs: dict[str, list[int]] = {}
    for req in requests:
        timeline.arrive(req.request_id, timeline.start)
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        timing, tokens = generate_batch(hf, batch)
        for req, toks in zip(batch, tokens, strict=True):
            for at in timing.step_times[: req.max_tokens]:
                timeline.tokens(req.request_id, at, 1)
            outputs[req.request_id] = toks
    timeline.end = perf_counter()
    return timeline, outputs


def warm_up(hf: HFModel, low_id: int) -> None:
    """A throwaway batch so lazy initialisation stays out of the measured runs."""
    generate_batch(hf, [BenchRequest("hf-warmup", list(range(low_id, low_id + 16)), 4)])
