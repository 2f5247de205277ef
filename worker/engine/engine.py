"""The Engine: offline ``generate``/``chat`` and the step API the queue worker drives.

One ``step()`` = schedule (token budget) -> one forward pass over the paged cache -> sample ->
append tokens, detokenize, check stops -> free finished sequences' blocks. Everything else here
is request intake (validation, tokenization) and bookkeeping.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import Any

import psutil
import torch

from pagedq.errors import InvalidRequestError, RequestTooLongError
from pagedq.kernels import select_backend
from pagedq.params import SamplingParams
from pagedq.worker.config import EngineConfig
from pagedq.worker.engine.beam_search import BeamParams, BeamState, Hypothesis, select
from pagedq.worker.engine.kv_cache_manager import KVCacheManager, cdiv
from pagedq.worker.engine.model_runner import ModelRunner, kv_bytes_per_token
from pagedq.worker.engine.output_processor import OutputProcessor
from pagedq.worker.engine.outputs import (
    BeamSearchOutput,
    CompletionOutput,
    RequestOutput,
    StepOutput,
)
from pagedq.worker.engine.sampler import Sampler
from pagedq.worker.engine.scheduler import Scheduler, SchedulerOutput
from pagedq.worker.engine.sequence import Request, SeqStatus, Sequence
from pagedq.worker.logging import get_logger
from pagedq.worker.models.llama import CausalLM
from pagedq.worker.models.loader import iter_weights, load_config, load_tokenizer, resolve_model

log = get_logger("pagedq.engine")

DEFAULT_CPU_KV_BYTES = 2 << 30
# Tokens per KV block when the caller does not say. A sequence wastes half a block on average:
# with 8 on the CPU, ~4 slots per sequence (KV utilization 0.97 on the bench's short trace, 0.95
# with 16) at no measurable cost to the C++ attention kernel; 16 on CUDA, the Triton tile.
DEFAULT_BLOCK_SIZE = {"cpu": 8, "cuda": 16}
TYPICAL_SEQ_LEN = 512  # for the "concurrency at a typical length" line in the start-up log


class Engine:
    """A paged-KV, continuously batched LLM engine for one model on one device."""

    def __init__(self, model: str | None = None, *, block_size: int | None = None,
                 num_kv_blocks: int | None = None, kv_cache_memory: int | None = None,
                 gpu_memory_utilization: float = 0.9, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, max_model_len: int | None = None,
                 long_prefill_token_threshold: int = 0, enable_chunked_prefill: bool = True,
                 enable_prefix_caching: bool = True, dtype: str = "float32",
                 kv_cache_dtype: str = "auto", device: str | None = None, num_threads: int | None = None,
                 seed: int = 0) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        block_size = block_size or DEFAULT_BLOCK_SIZE.get(self.device.type, 16)
        self.config = EngineConfig(
            model=model, block_size=block_size, num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory, gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, long_prefill_token_threshold=long_prefill_token_threshold,
            enable_chunked_prefill=enable_chunked_prefill,
            enable_prefix_caching=enable_prefix_caching, dtype=dtype,
            kv_cache_dtype=kv_cache_dtype, device=device,
            num_threads=num_threads)
        if num_threads:
            torch.set_num_threads(num_threads)
        self.dtype = getattr(torch, dtype)
        self.kv_dtype = self._kv_dtype(kv_cache_dtype)
        self.kv_dtype_name = str(self.kv_dtype).removeprefix("torch.")
        started = time.perf_counter()
        self.model_path = resolve_model(model)
        self.hf_config = load_config(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        positions = max_model_len or self.hf_config.max_position_embeddings
        self.model = CausalLM(self.hf_config, self.dtype, self.device, positions)
        self.model.load_weights(iter_weights(self.model_path))
        self.model.use_backend(select_backend(self.device, self.dtype, self.kv_dtype, self.model.head_dim))
        self.model.eval()
        num_blocks = self._num_blocks()
        self.max_model_len = min(positions, num_blocks * block_size)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.runner = ModelRunner(self.model, num_blocks, block_size, self.kv_dtype, self.device)
        self.scheduler = Scheduler(self.config, self.kv)
        self.sampler = Sampler(seed)
        self.eos_token_ids = self._eos_token_ids()
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._pending: list[StepOutput] = []
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_computed_tokens = 0
        self._log_capacity(num_blocks, time.perf_counter() - started)

    # -- set-up ---------------------------------------------------------------------------
    def _kv_dtype(self, name: str) -> torch.dtype:
        """The cache's dtype. A float16/bfloat16 cache under a float32 model halves the bytes
        attention streams per token (llama.cpp's default is an f16 cache for f32 weights too);
        values are rounded on the way in and attention runs in float32. CPU only: the Triton
        kernels take the cache in the model's dtype."""
        kv = self.dtype if name == "auto" else getattr(torch, name)
        if kv != self.dtype and (self.device.type != "cpu" or self.dtype != torch.float32):
            raise InvalidRequestError(
                f"kv_cache_dtype={name!r} with dtype={self.config.dtype!r} on "
                f"{self.device.type}: a cache dtype other than the model's needs a float32 "
                "model on the CPU; use kv_cache_dtype='auto'")
        return kv

    def _num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        per_block = kv_bytes_per_token(self.model, self.kv_dtype) * cfg.block_size
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            budget = cfg.kv_cache_memory or min(DEFAULT_CPU_KV_BYTES,
                                                psutil.virtual_memory().available // 4)
        blocks = int(budget // per_block)
        if blocks < 1:
            raise InvalidRequestError(
                f"KV cache budget of {budget} bytes holds no block of {per_block} bytes: raise "
                "kv_cache_memory / gpu_memory_utilization or pass num_kv_blocks")
        return blocks

    def _cuda_kv_budget(self) -> int:
        """vLLM's rule: utilization x total memory, minus weights and a profiled activation peak."""
        free, total = torch.cuda.mem_get_info(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._profile_forward()
        activation_peak = torch.cuda.max_memory_allocated(self.device) - before
        used_by_others = total - free  # weights and other processes
        return int(total * self.config.gpu_memory_utilization - used_by_others - activation_peak)

    def _profile_forward(self) -> None:
        """One forward of a full token budget through a throwaway cache, to size activations."""
        cfg = self.config
        tokens = cfg.max_num_batched_tokens
        runner = ModelRunner(self.model, cdiv(tokens, cfg.block_size), cfg.block_size,
                             self.dtype, self.device)
        req = Request("profile", None, [0] * tokens, SamplingParams(max_tokens=1))
        seq = Sequence(req, 0, [0] * tokens, tokens, block_table=list(range(runner.kv_cache.shape[2])))
        runner.execute(SchedulerOutput(scheduled=[(seq, tokens)]))
        del runner
        torch.cuda.empty_cache()

    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.hf_config, getattr(self.tokenizer, "generation_config", None)):
            eos = getattr(source, "eos_token_id", None)
            ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        try:
            from transformers import GenerationConfig

            gen = GenerationConfig.from_pretrained(self.model_path)
            eos = gen.eos_token_id
            ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        except (OSError, ValueError):
            pass
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def _log_capacity(self, num_blocks: int, load_s: float) -> None:
        bs = self.config.block_size
        per_token = kv_bytes_per_token(self.model, self.kv_dtype)
        log.info("engine ready", model=str(self.model_path), device=str(self.device),
                 dtype=self.config.dtype, kv_cache_dtype=self.kv_dtype_name,
                 load_s=round(load_s, 2), kv_blocks=num_blocks,
                 block_size=bs, kv_tokens=num_blocks * bs, kv_bytes_per_token=per_token,
                 kv_bytes=num_blocks * bs * per_token, max_model_len=self.max_model_len,
                 concurrency_at_max_len=round(num_blocks * bs / self.max_model_len, 2),
                 concurrency_at_typical_len=round(
                     num_blocks * bs / min(TYPICAL_SEQ_LEN, self.max_model_len), 2),
                 typical_len=min(TYPICAL_SEQ_LEN, self.max_model_len))

    # -- request intake -------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | None,
                    params: SamplingParams | dict | None = None, *,
                    prompt_token_ids: list[int] | None = None, priority: int = 0,
                    resume: list[list[int]] | None = None, deadline: float | None = None,
                    beam: Any = None) -> Request:
        """Queue a request. Raises InvalidRequestError / RequestTooLongError / InvalidParamsError."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running; use a new id")
        params = self._coerce_params(params)
        text, ids = self._tokenize(prompt, prompt_token_ids)
        params = self._check_lengths(ids, params)
        req = Request(request_id, text, ids, params, priority=priority,
                      arrival=next(self._arrivals), deadline=deadline,
                      eos_token_ids=self.eos_token_ids, beam=beam)
        samples = resume if resume else [[]]
        if resume and len(resume) != params.n:
            raise InvalidRequestError(f"resume has {len(resume)} samples, params.n is {params.n}")
        for index, done in enumerate(samples):
            seq = Sequence(req, index, ids + list(done), len(ids))
            self.outputs.start(seq, resumed=list(done))
            req.seqs.append(seq)
            if seq.is_finished:
                self._pending.append(self.outputs.delta(seq))
            else:
                self.scheduler.add(seq)
        req.forked = bool(resume) or params.n == 1
        self.requests[request_id] = req
        if req.finished:
            del self.requests[request_id]
        return req

    def _coerce_params(self, params: SamplingParams | dict | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if isinstance(params, dict):
            return SamplingParams.from_dict(params)
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        return params

    def _tokenize(self, prompt: str | list[int] | None,
                  prompt_token_ids: list[int] | None) -> tuple[str | None, list[int]]:
        if prompt_token_ids is None and isinstance(prompt, (list, tuple)):
            prompt, prompt_token_ids = None, list(prompt)
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise InvalidRequestError("prompt must be a string or a list of token ids")
            if self.tokenizer is None:
                raise InvalidRequestError(
                    f"model {self.model_path} has no tokenizer: send token ids instead of text")
            prompt_token_ids = self.tokenizer(prompt).input_ids
        ids = list(prompt_token_ids)
        if not ids:
            raise InvalidRequestError("prompt is empty: send at least one token")
        vocab = self.hf_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        return (prompt if isinstance(prompt, str) else None), ids

    def _check_lengths(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        limit = self.max_model_len
        if len(ids) >= limit:
            raise RequestTooLongError(
                f"prompt has {len(ids)} tokens; this engine fits at most {limit} tokens per "
                "sequence (prompt + output): shorten the prompt")
        if params.max_tokens is None:
            return replace(params, max_tokens=limit - len(ids))
        if len(ids) + params.max_tokens > limit:
            raise RequestTooLongError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"{limit}, the most one sequence can hold (max_model_len, bounded by the KV cache): "
                "lower max_tokens or shorten the prompt")
        return params

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; no further outputs are produced for it."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                seq.status, seq.finish_reason = SeqStatus.FINISHED, "abort"
                self.scheduler.remove(seq)
        return True

    # -- the step -------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``): later requests compute
        their prompts from scratch, e.g. to time a trace again or after changing weights.
        Only while no request is in flight (their block hashes would dangle); returns whether
        it reset."""
        if self.has_unfinished_requests():
            return False
        self.kv.pool.reset_cache()
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Run one engine iteration; returns the stream deltas it produced."""
        outputs, self._pending = self._pending, []
        self._expire_deadlines(outputs)
        sched = self.scheduler.schedule()
        if not sched:
            return outputs
        logits, sample_seqs = self.runner.execute(sched)
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            self.kv.commit(seq)
        self.num_computed_tokens += sched.num_batched_tokens
        self.num_steps += 1
        if sample_seqs and any(seq.request.beam is not None for seq in sample_seqs):
            logits, sample_seqs = self._beam_rows(logits, sample_seqs, outputs)
        if sample_seqs:
            rows, sample_seqs = self._fork_samples(sample_seqs)
            result = self.sampler(logits[rows] if len(rows) != len(logits) else logits,
                                  sample_seqs)
            self.num_generated_tokens += len(sample_seqs)
            for k, seq in enumerate(sample_seqs):
                lp = None if result.logprobs is None else result.logprobs[k]
                top = None if result.top_logprobs is None else result.top_logprobs[k]
                delta = self.outputs.append(seq, result.token_ids[k], lp, top)
                if seq.is_finished:
                    self._finish(seq)
                if delta is not None:
                    outputs.append(delta)
        return outputs

    def _fork_samples(self, seqs: list[Sequence]) -> tuple[list[int], list[Sequence]]:
        """n > 1: when a request's prompt is done, fork it into n sequences sharing its blocks.

        Returns the logits row of each sampling sequence (siblings share their parent's row).
        """
        rows: list[int] = []
        out: list[Sequence] = []
        for row, seq in enumerate(seqs):
            rows.append(row)
            out.append(seq)
            req = seq.request
            if req.forked:
                continue
            for index in range(1, req.params.n):
                child = seq.fork(index)
                self.kv.share(seq, child)
                self.outputs.start(child, resumed=[])
                req.seqs.append(child)
                self.scheduler.add_running(child)
                rows.append(row)
                out.append(child)
            req.forked = True
        return rows, out

    # -- beam search ----------------------------------------------------------------------
    def add_beam_request(self, request_id: str, prompt: str | list[int], beam: BeamParams, *,
                         priority: int = 0, deadline: float | None = None) -> Request:
        """Queue a beam search; its beams come out together when it finishes."""
        params = SamplingParams(temperature=0.0, max_tokens=beam.max_tokens, ignore_eos=True)
        return self.add_request(request_id, prompt, params, priority=priority, deadline=deadline,
                                beam=BeamState(beam))

    def _beam_rows(self, logits: torch.Tensor, seqs: list[Sequence], outputs: list[StepOutput]
                   ) -> tuple[torch.Tensor, list[Sequence]]:
        """Take the beam rows out of a step; advance each beam request whose beams are all ready."""
        is_beam = [seq.request.beam is not None for seq in seqs]
        beam_rows = [i for i, b in enumerate(is_beam) if b]
        logprobs = torch.log_softmax(logits[beam_rows], dim=-1)
        touched: dict[str, Request] = {}
        for row, i in enumerate(beam_rows):
            seq = seqs[i]
            seq.request.beam.ready[seq.seq_id] = logprobs[row]
            touched[seq.request.request_id] = seq.request
        for req in touched.values():
            live = [s for s in req.seqs if not s.is_finished]
            if all(s.seq_id in req.beam.ready for s in live):
                self._beam_advance(req, live, outputs)
        keep = [i for i, b in enumerate(is_beam) if not b]
        return logits[keep], [seqs[i] for i in keep]

    def _beam_advance(self, req: Request, live: list[Sequence], outputs: list[StepOutput]) -> None:
        state, p = req.beam, req.beam.params
        rows = torch.stack([state.ready.pop(s.seq_id) for s in live])
        chosen, ended = select(rows, [s.cum_logprob for s in live], p.beam_width,
                               req.eos_token_ids, p.ignore_eos)
        for c in ended:
            state.completed.append(
                Hypothesis(live[c.parent].output_token_ids + [c.token], c.cum_logprob, True))
        used: set[int] = set()
        next_index = max(s.index for s in req.seqs) + 1
        survivors: list[tuple[Sequence, int, float]] = []
        for c in chosen:  # fork before any token is appended: children copy the parent's state
            seq = live[c.parent]
            if c.parent in used:
                child = seq.fork(next_index)
                next_index += 1
                self.kv.share(seq, child)
                req.seqs.append(child)
                self.scheduler.add_running(child)
                seq = child
            used.add(c.parent)
            survivors.append((seq, c.token, c.cum_logprob))
        for i, seq in enumerate(live):
            if i not in used:
                self._drop_beam(seq)
        self.num_generated_tokens += len(survivors)
        for seq, token, cum in survivors:
            seq.token_ids.append(token)
            seq.cum_logprob = cum
        done = not survivors or survivors[0][0].num_generated >= p.max_tokens or any(
            s.num_tokens >= self.max_model_len for s, _, _ in survivors)
        if done:
            for seq, _, _ in survivors:
                state.completed.append(Hypothesis(seq.output_token_ids, seq.cum_logprob))
                self._drop_beam(seq)
            outputs.extend(self._beam_outputs(req))
            self.requests.pop(req.request_id, None)

    def _drop_beam(self, seq: Sequence) -> None:
        seq.status, seq.finish_reason = SeqStatus.FINISHED, "length"
        self.scheduler.remove(seq)
        seq.request.seqs.remove(seq)  # its hypothesis, if any, lives in the beam state

    def _beam_outputs(self, req: Request) -> list[StepOutput]:
        outs = []
        for rank, c in enumerate(self._beam_completions(req)):
            usage = {"prompt_tokens": len(req.prompt_token_ids), "completion_tokens": len(c.token_ids)}
            outs.append(StepOutput(req.request_id, rank, c.token_ids, c.text, len(c.token_ids),
                                   True, c.finish_reason, None, usage))
        return outs

    def _beam_completions(self, req: Request) -> list[CompletionOutput]:
        decode = self.tokenizer.decode if self.tokenizer is not None else (lambda ids, **_: "")
        return [CompletionOutput(rank, h.token_ids, decode(h.token_ids, skip_special_tokens=True),
                                 "stop" if h.ends_with_eos else "length", h.cum_logprob)
                for rank, h in enumerate(req.beam.ranked())]

    def beam_search(self, prompts: Seq[str] | Seq[list[int]], beam_width: int = 4,
                    max_tokens: int = 16, length_penalty: float = 1.0,
                    ignore_eos: bool = False) -> list[BeamSearchOutput]:
        """Beam search per prompt; each result's ``beams`` are best first."""
        beam = BeamParams(beam_width, max_tokens, length_penalty, ignore_eos)
        reqs = self._run_all("beam", [
            lambda rid, prompt=prompt: self.add_beam_request(rid, prompt, beam) for prompt in prompts])
        return [BeamSearchOutput(r.request_id, r.prompt, r.prompt_token_ids,
                                 self._beam_completions(r)) for r in reqs]

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        req = seq.request
        if req.finished:
            self.requests.pop(req.request_id, None)

    def _expire_deadlines(self, outputs: list[StepOutput]) -> None:
        now = time.time()
        for req in [r for r in self.requests.values() if r.deadline and r.deadline <= now]:
            for seq in req.seqs:
                if not seq.is_finished:
                    seq.status, seq.finish_reason = SeqStatus.FINISHED, "deadline"
                    self.scheduler.remove(seq)
                    outputs.append(self.outputs.delta(seq))
            if not req.forked:  # deadline hit before the fork: the missing samples end too
                req.forked = True
            self.requests.pop(req.request_id, None)

    # -- offline API ----------------------------------------------------------------------
    def generate(self, prompts: Seq[str] | Seq[list[int]] | str,
                 params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts to completion with continuous batching; results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError(f"{len(plist)} params for {len(prompts)} prompts")
        reqs = self._run_all("offline", [
            lambda rid, prompt=prompt, p=p: self.add_request(rid, prompt, p)
            for prompt, p in zip(prompts, plist, strict=True)])
        return [self.request_output(r) for r in reqs]

    def _run_all(self, kind: str, adders: list) -> list[Request]:
        """Add every request (all or none: a bad one aborts the rest), then run them to the end."""
        ids = [f"{kind}-{next(self._arrivals)}" for _ in adders]
        reqs: list[Request] = []
        try:
            for rid, add in zip(ids, adders, strict=True):
                reqs.append(add(rid))
        except Exception:
            for rid in ids:
                self.abort_request(rid)
            raise
        self.run_until_done(ids)
        return reqs

    def chat(self, conversations: list[dict] | list[list[dict]],
             params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then ``generate``."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        return self.generate([self.apply_chat_template(c) for c in conversations], params)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(f"model {self.model_path} has no chat template")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def run_until_done(self, request_ids: list[str]) -> None:
        wanted = set(request_ids)
        while wanted & self.requests.keys() or self._pending:
            self.step()

    def request_output(self, req: Request) -> RequestOutput:
        if req.beam is not None:
            return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids,
                                 self._beam_completions(req), finished=req.finished)
        outs = [CompletionOutput(s.index, s.output_token_ids, s.text, s.finish_reason,
                                 s.cum_logprob, s.logprobs)
                for s in sorted(req.seqs, key=lambda s: s.index)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs,
                             finished=req.finished, num_cached_tokens=req.num_cached_tokens)

    # -- introspection --------------------------------------------------------------------
    def free_capacity(self, prompt_len_hint: int = 256) -> int:
        """How many more requests could be admitted now (sequence slots and KV blocks)."""
        slots = self.config.max_num_seqs - len(self.scheduler.running) - len(
            self.scheduler.waiting)
        bs = self.config.block_size
        reserved = sum(cdiv(s.num_tokens, bs) for s in self.scheduler.waiting)
        per_request = cdiv(min(prompt_len_hint, self.max_model_len) + 1, bs)
        by_blocks = (self.kv.pool.num_free - reserved) // per_request
        return max(0, min(slots, by_blocks))

    def stats(self) -> dict[str, Any]:
        pool = self.kv.pool
        running = self.scheduler.running
        return {
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used,
            "kv_blocks_free": pool.num_free,
            "kv_tokens_live": self.kv.live_tokens(running),
            "kv_usage": pool.num_used / pool.num_blocks,
            "block_size": self.config.block_size,
            "kv_cache_dtype": self.kv_dtype_name,
            "running": len(running),
            "waiting": len(self.scheduler.waiting),
            "requests": len(self.requests),
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.kv.prefix_cache_queries,
            "prefix_cache_hits": self.kv.prefix_cache_hits,
            "prefix_cache_evictions": pool.num_evictions,
            "num_steps": self.num_steps,
            "num_generated_tokens": self.num_generated_tokens,
            "num_computed_tokens": self.num_computed_tokens,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.config.max_num_seqs,
        }
