"""The Engine: the step API the queue worker drives, and offline ``generate``/``chat``.

One ``step()`` = schedule (token budget) -> one forward pass over the paged cache -> sample ->
append tokens, detokenize, check stops -> free finished sequences' blocks. Request checks live
in intake.py, KV sizing in sizing.py, how requests end in live_requests.py, and
``generate``/``chat``/``beam_search`` (batches run to completion on this API) in offline.py.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import Any

import torch

from pagedq.errors import InvalidParamsError, InvalidRequestError
from pagedq.logging import get_logger
from pagedq.params import SamplingParams
from pagedq.worker.config import EngineConfig, default_block_size, default_device
from pagedq.worker.engine import sizing
from pagedq.worker.engine.drafts import Drafter
from pagedq.worker.engine.intake import (
    check_logit_bias,
    coerce_params,
    eos_token_ids,
    fit_lengths,
    settle_reasoning,
    tokenize,
)
from pagedq.worker.engine.kv_cache_manager import KVCacheManager
from pagedq.worker.engine.live_requests import LiveRequests
from pagedq.worker.engine.model_runner import ModelRunner
from pagedq.worker.engine.offline import OfflineAPI
from pagedq.worker.engine.output_processor import OutputProcessor
from pagedq.worker.engine.outputs import StepOutput
from pagedq.worker.engine.prompt_logprobs import PromptLogprobCollector
from pagedq.worker.engine.sampler import Sampler, greedy_argmax
from pagedq.worker.engine.scheduler import Scheduler
from pagedq.worker.engine.sequence import Request, SamplingHook, Sequence
from pagedq.worker.engine.structured import StructuredOutputs
from pagedq.worker.engine.threads import ThreadGovernor, performance_cores, usable_cpus
from pagedq.worker.models.build import ModelFiles, build_model

log = get_logger("pagedq.engine")


class Engine(OfflineAPI):
    """A paged-KV, continuously batched LLM engine for one model on one device.

    ``Engine(model, **knobs)`` takes every field of EngineConfig as a keyword (or a whole
    ``config=``); ``self.config`` is that config with the device's block size filled in. The
    model comes from the models layer's one room (pagedq.worker.models.build), which resolves
    it, picks its weight form (``self.weight_form``), chooses its kernels (``self.backend``),
    loads it and packs it for them, and says what the weights take (``self.weight_bytes``);
    ``files=`` hands it a model already opened there (the CLI opens it to size the cache for
    its prompts).
    """

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                 files: ModelFiles | None = None, **knobs: Any) -> None:
        if model is not None:
            knobs["model"] = model
        config = replace(config, **knobs) if config else EngineConfig(**knobs)
        self.device = torch.device(config.device or default_device())
        self.config = config = replace(
            config, block_size=config.block_size or default_block_size(self.device.type))
        self.governor = thread_governor(config, self.device)
        self.kv_dtype = sizing.kv_cache_dtype(config, self.device.type)
        self.kv_dtype_name = str(self.kv_dtype).removeprefix("torch.")
        started = time.perf_counter()
        built = build_model(config, self.device, self.kv_dtype, files)
        self.model, self.weight_form, self.backend = built.model, built.form, built.backend
        self.packed_weights = built.packed  # they run the packed GEMV and GEMM
        self.model_path = built.files.path
        self.hf_config = built.files.hf_config
        self.tokenizer = built.files.tokenizer
        budget = sizing.kv_budget(config, config.block_size, self.device, self.model)
        plan = sizing.plan_kv(self.hf_config, config, self.kv_dtype, config.block_size, budget)
        self.max_model_len = plan.max_model_len
        self.kv = KVCacheManager(plan.num_blocks, plan.block_size, config.enable_prefix_caching)
        self.runner = ModelRunner(self.model, plan.num_blocks, plan.block_size, self.kv_dtype,
                                  self.device)
        self.eos_token_ids = eos_token_ids(self.model_path, self.hf_config, self.tokenizer)
        self.structured = StructuredOutputs(
            self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids,
            cache_size=config.grammar_cache_size, compile_threads=config.grammar_compile_threads,
            compile_timeout_s=config.grammar_compile_timeout)
        self.drafter = (Drafter(config.speculative_config, self.max_model_len,
                                self.structured.allowed_draft, self.structured.forced_tokens,
                                self.tokenizer)
                        if config.speculative_config else None)
        self.scheduler = Scheduler(config, self.kv, self.drafter)
        self.sampler = Sampler(config.seed, constrain=self.structured.apply,
                               argmax=greedy_argmax(self.backend.ops))
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.live = LiveRequests(self.scheduler, self.outputs)
        self.requests = self.live.by_id  # request id -> Request, until it ends
        self._arrivals = itertools.count()
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_computed_tokens = 0
        self.weight_bytes = built.weight_bytes
        log.info("engine ready", model=str(self.model_path), device=str(self.device),
                 dtype=config.dtype, quantization=config.quantization,
                 compute_dtype=str(built.form.compute).removeprefix("torch."),
                 weight_bytes=self.weight_bytes, kv_cache_dtype=self.kv_dtype_name,
                 load_s=round(time.perf_counter() - started, 2), **plan.log_fields())

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | None,
                    params: SamplingParams | dict | None = None, *,
                    prompt_token_ids: list[int] | None = None, priority: int = 0,
                    resume: list[list[int]] | None = None, deadline: float | None = None,
                    hook: SamplingHook | None = None) -> Request:
        """Queue a request. Raises InvalidRequestError / RequestTooLongError / InvalidParamsError.

        ``resume`` holds, per sample, the tokens a previous owner of the job already streamed:
        they are replayed without being emitted again. ``hook`` picks the request's tokens
        instead of the sampler (beam search). A request with ``structured_outputs`` waits,
        unscheduled, until its grammar compiles; a constraint that fails to compile is reported
        by ``take_rejected`` (InvalidParamsError).
        """
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already running; use a new id")
        params = coerce_params(params)
        text, ids = tokenize(self.tokenizer, self.hf_config.vocab_size, self.model_path, prompt,
                             prompt_token_ids)
        params = settle_reasoning(fit_lengths(ids, params, self.max_model_len), self.tokenizer,
                                  ids)
        check_logit_bias(params, self.hf_config.vocab_size)
        req = Request(request_id, text, ids, params, priority=priority,
                      arrival=next(self._arrivals), deadline=deadline,
                      eos_token_ids=self.eos_token_ids, hook=hook)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = PromptLogprobCollector(params.prompt_logprobs, list(ids))
        if resume and len(resume) != params.n:
            raise InvalidRequestError(f"resume has {len(resume)} samples, params.n is {params.n}")
        compiling = self._constrain(req)
        for index, done in enumerate(resume or [[]]):
            seq = Sequence(req, index, ids + list(done), len(ids))
            self.outputs.start(seq, resumed=list(done))
            req.seqs.append(seq)
            if seq.is_finished:
                self.live.pending.append(self.outputs.delta(seq))
            elif not compiling:
                self.scheduler.add(seq)
        req.forked = bool(resume) or params.n == 1
        self.live.add(req)
        return req

    def _constrain(self, req: Request) -> bool:
        """Start a structured request's grammar compile; returns whether it must wait for it."""
        if req.params.structured_outputs is None:
            return False
        if req.hook is not None:
            raise InvalidParamsError(
                "structured_outputs with beam search is not supported: use sampling (n > 1 "
                "samples each follow the constraint)")
        if self.tokenizer is None:
            raise InvalidParamsError(
                f"structured_outputs needs a tokenizer; model {self.model_path} has none")
        return self.structured.add(req)

    def take_rejected(self) -> list[tuple[str, Exception]]:
        """(request id, error) of requests that failed after ``add_request`` accepted them (a
        constraint that did not compile); each is gone from the engine."""
        return self.live.take_rejected()

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; no further outputs are produced for it."""
        return self.live.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.live.pending)

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, e.g. to time a trace again; only while no request is in
        flight (their block hashes would dangle). Returns whether it reset."""
        if self.has_unfinished_requests():
            return False
        self.kv.pool.reset_cache()
        return True

    # -- the step -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Run one engine iteration; returns the stream deltas it produced."""
        outputs = self.live.take_pending()
        self.live.expire(outputs)
        self._admit_compiled()
        generated = self.num_generated_tokens
        sched = self.scheduler.schedule()
        if not sched:
            if self.structured.num_compiling:  # only compiles to wait for: don't spin
                self.structured.wait_compiling(timeout=0.01)
            return outputs
        decode_only = self.drafter is not None and all(
            n == 1 + len(seq.draft_token_ids) for seq, n in sched.scheduled)
        drafted = decode_only and any(seq.draft_token_ids for seq, _ in sched.scheduled)
        logits, sample_seqs = self.governor.run(sched.num_batched_tokens,
                                                lambda: self.runner.execute(sched))
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n - len(seq.draft_token_ids)  # drafts: once verified
            self.kv.commit(seq)
        self.num_computed_tokens += sched.num_batched_tokens
        self.num_steps += 1
        if sample_seqs:
            outputs.extend(self._sample(logits, sample_seqs))
        if self.drafter is not None:  # the speculation governor times the whole step
            self.drafter.governor.record(self.num_generated_tokens - generated, decode_only,
                                         drafted, sched.num_batched_tokens)
        return outputs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[StepOutput]:
        """One token per sequence (hooked requests pick their own), then more for sequences
        whose draft matches what they sample; returns the deltas, one per sequence."""
        logits, drafted = split_draft_rows(logits, seqs)
        outputs: list[StepOutput] = []
        hooked: dict[int, list[int]] = {}  # id(request) -> its rows, in row order
        plain: list[int] = []
        for row, seq in enumerate(seqs):
            (plain if seq.request.hook is None else hooked.setdefault(id(seq.request), [])
             ).append(row)
        for rows in hooked.values():
            hook = seqs[rows[0]].request.hook
            outputs += hook.sample([seqs[r] for r in rows], logits[rows])
        if not plain:
            return outputs
        if len(plain) != len(seqs):
            logits, seqs = logits[plain], [seqs[r] for r in plain]
        rows, seqs = self._fork_samples(seqs)
        rejected: set[int] = set()  # id() of requests a constraint ended in this step
        sampled = self._draw(logits[rows] if len(rows) != len(logits) else logits, seqs,
                             rejected)
        if drafted:
            self._verify(drafted, rejected)
        for seq in sampled:
            if id(seq.request) in rejected:
                continue
            outputs.append(self.outputs.delta(seq))
            if seq.is_finished:
                self.finish(seq)
        return outputs

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence], rejected: set[int]
              ) -> list[Sequence]:
        """Sample one token for each of ``seqs`` (row i of ``logits`` is seqs[i]) and add it;
        returns the sequences that took one (a constraint refusing a token ends its request)."""
        result = self.sampler(logits, seqs)
        self.num_generated_tokens += len(seqs)
        took: list[Sequence] = []
        for k, seq in enumerate(seqs):
            if seq.is_finished:  # a sibling's rejection ended it in this loop
                continue
            lp = None if result.logprobs is None else result.logprobs[k]
            top = None if result.top_logprobs is None else result.top_logprobs[k]
            try:
                complete = self.structured.advance(seq, result.token_ids[k])
            except InvalidRequestError as exc:
                rejected.add(id(seq.request))
                self.live.reject(seq.request, exc)
                continue
            self.outputs.add(seq, result.token_ids[k], lp, top, complete)
            took.append(seq)
        return took

    def _verify(self, drafted: list[tuple[Sequence, list[int], torch.Tensor]],
                rejected: set[int]) -> None:
        """Accept draft tokens while each equals the token sampled at its position.

        Depth j samples, for every sequence whose draft matched so far, from the logits row
        computed after its j-th draft token: the same sampler call, penalties, grammar mask
        and seeded draw (by position) that plain decoding would make there, since the tokens
        before it are the same. The first mismatch is itself the sampled token and ends the
        run; so does a stop. Then the rejected drafts' KV is rolled back: computed tokens
        cover the accepted ones only, tail blocks return to the pool, and only verified
        tokens reach the prefix cache."""
        accepted = [0] * len(drafted)
        for depth in range(max(len(d) for _, d, _ in drafted)):
            live = [i for i, (seq, draft, _) in enumerate(drafted)
                    if accepted[i] == depth < len(draft) and not seq.is_finished
                    and seq.token_ids[-1] == draft[depth]]
            if not live:
                break
            for i in live:
                accepted[i] += 1
            self._draw(torch.stack([drafted[i][2][depth] for i in live]),
                       [drafted[i][0] for i in live], rejected)
        for (seq, draft, _), num in zip(drafted, accepted, strict=True):
            seq.draft_token_ids = []
            self.drafter.verified(seq, len(draft), num)
            if seq.is_finished:
                continue
            seq.num_computed_tokens += num
            self.kv.commit(seq)
            self.kv.trim(seq)

    def _admit_compiled(self) -> None:
        """Schedule the requests whose grammar has compiled; reject those that failed."""
        if not self.structured.num_compiling:
            return
        ready, failed = self.structured.take_compiled()
        for req in ready:
            for seq in req.seqs:
                if not seq.is_finished:
                    self.scheduler.add(seq)
        for req, exc in failed:
            self.live.reject(req, exc)

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
                child = self.fork(seq, index)
                self.outputs.start(child, resumed=[])
                rows.append(row)
                out.append(child)
            req.forked = True
        return rows, out

    def fork(self, seq: Sequence, index: int) -> Sequence:
        """A running sibling of ``seq`` in its request, sharing its blocks (copy-on-write)."""
        child = seq.fork(index)
        self.kv.share(seq, child)
        seq.request.seqs.append(child)
        self.scheduler.add_running(child)
        return child

    def finish(self, seq: Sequence, reason: str | None = None) -> None:
        """Free a sequence's blocks (ending it with ``reason`` if given); see LiveRequests."""
        if self.drafter is not None and reason is None:
            self.drafter.finished(seq)
        self.live.finish(seq, reason)

    # -- introspection --------------------------------------------------------------------
    def free_capacity(self, prompt_len_hint: int = 256) -> int:
        """How many more requests could be admitted now (sequence slots and KV blocks)."""
        free = self.scheduler.free_capacity(min(prompt_len_hint, self.max_model_len))
        return max(0, free - self.structured.num_compiling)

    def stats(self) -> dict[str, Any]:
        return {**self.kv.stats(self.scheduler.running), "kv_cache_dtype": self.kv_dtype_name,
                "weight_bytes": self.weight_bytes,
                **self.scheduler.stats(), "requests": len(self.requests),
                "num_steps": self.num_steps, "num_generated_tokens": self.num_generated_tokens,
                "num_computed_tokens": self.num_computed_tokens,
                "max_model_len": self.max_model_len, "max_num_seqs": self.config.max_num_seqs,
                "threads": self.governor.chosen, **self.structured.stats(),
                **(self.drafter.stats() if self.drafter is not None else {})}


def thread_governor(config: EngineConfig, device: torch.device) -> ThreadGovernor:
    """The step's thread counts: num_threads (default torch's, capped at the usable CPUs) and,
    on the CPU with adaptive_threads, one thread too, and on a hybrid CPU with the default
    count its P-cores' count (threads.py says why)."""
    threads = config.num_threads or min(torch.get_num_threads(), usable_cpus())
    torch.set_num_threads(threads)
    adaptive = config.adaptive_threads and device.type == "cpu" and threads > 1
    if not adaptive:
        return ThreadGovernor((threads,))
    p_cores = None if config.num_threads else performance_cores()
    return ThreadGovernor((threads, p_cores, 1) if p_cores and 1 < p_cores < threads else (threads, 1))


def split_draft_rows(logits: torch.Tensor, seqs: list[Sequence]
                     ) -> tuple[torch.Tensor, list[tuple[Sequence, list[int], torch.Tensor]]]:
    """(each sequence's first logits row, (sequence, its draft, its draft rows) for those with
    a draft): the runner returns 1 + len(draft) rows per sampling sequence."""
    counts = [1 + len(s.draft_token_ids) for s in seqs]
    if len(counts) == len(logits):
        return logits, []
    starts = [0]
    for c in counts[:-1]:
        starts.append(starts[-1] + c)
    drafted = [(s, s.draft_token_ids, logits[st + 1:st + c])
               for s, st, c in zip(seqs, starts, counts, strict=True) if c > 1]
    return logits[starts], drafted
