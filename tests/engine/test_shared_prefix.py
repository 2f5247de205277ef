"""Shared-prefix scheduling: requests arriving together with one long prefix compute it once.

Model-free tests drive the scheduler with hand-built sequences (tests/engine/sequences.py) and
count the tokens each step schedules; engine tests on a tiny seeded model count the engine's
computed tokens and compare the outputs with each request run alone and with transformers'
greedy choice. The oracle for "computed once" is arithmetic: the prefix's length plus each
request's own tail, against the prefix times the number of requests without the feature.
"""

from __future__ import annotations

import pytest
import torch

from pagedq.client import SamplingParams
from pagedq.worker import Engine
from pagedq.worker.config import EngineConfig
from pagedq.worker.engine.kv_cache_manager import KVCacheManager
from pagedq.worker.engine.scheduler import Scheduler, SchedulerOutput
from pagedq.worker.engine.sequence import SeqStatus
from pagedq.worker.engine.shared_prefix import MIN_SHARED_TOKENS
from tests.engine.sequences import assert_ref_counts, fake_step, make_seq
from tests.engine.test_block_accounting import check_invariants
from tests.oracle import assert_greedy

BS = 4


def toks(n: int, seed: int) -> list[int]:
    return torch.randint(3, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def scheduler(share: bool = True, num_blocks: int = 256, **knobs) -> Scheduler:
    sched = Scheduler(EngineConfig(**knobs), KVCacheManager(num_blocks, BS, True))
    sched.share_inflight_prefixes = share
    return sched


def prefill_tokens(sched: Scheduler, seqs: list, steps: int = 500) -> int:
    """Run to the end; returns the tokens scheduled for prompts (decodes excluded)."""
    total = 0
    for _ in range(steps):
        if not sched.num_unfinished:
            return total
        out = sched.schedule()
        total += sum(min(n, s.num_prompt_tokens - s.num_computed_tokens)
                     for s, n in out.scheduled if s.num_computed_tokens < s.num_prompt_tokens)
        fake_step(sched, out)
        assert_ref_counts(sched.kv.pool, sched.running + sched.waiting)
    raise AssertionError("the scheduler made no progress")


@pytest.mark.parametrize("budget", [2048, 40])  # whole prompts in one step; chunked prefill
def test_concurrent_requests_compute_a_shared_prefix_once(budget):
    prefix = toks(64, 1)
    tails = [toks(6, 10 + i) for i in range(8)]
    counts = {}
    for share in (True, False):
        sched = scheduler(share, max_num_batched_tokens=budget)
        seqs = [make_seq(prefix + t, max_tokens=3) for t in tails]
        for s in seqs:
            sched.add(s)
        counts[share] = prefill_tokens(sched, seqs)
        assert all(s.status is SeqStatus.FINISHED and s.num_generated == 3 for s in seqs)
        assert sched.kv.pool.num_free == sched.kv.pool.num_blocks
        if share:
            assert sched.num_prefix_holds >= len(tails) - 1
            assert all(s.request.num_cached_tokens == 64 for s in seqs[1:])
    assert counts[True] == 64 + 6 * len(tails)
    if budget >= (64 + 6) * len(tails):  # all admitted at once: each computes the prefix
        assert counts[False] == (64 + 6) * len(tails)
    else:  # chunks: later requests find some blocks the first one's earlier steps cached
        assert counts[False] > counts[True]


def test_a_short_shared_run_is_not_held():
    """Below MIN_SHARED_TOKENS the waiter prefills alongside the first request, as before."""
    prefix = toks(MIN_SHARED_TOKENS - BS, 2)
    sched = scheduler()
    seqs = [make_seq(prefix + toks(5, 20 + i)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s for s, _ in out.scheduled] == seqs and sched.num_prefix_holds == 0


def test_unrelated_requests_pass_a_held_one():
    prefix = toks(48, 3)
    sched = scheduler()
    producer, waiter = make_seq(prefix + [5, 6, 7]), make_seq(prefix + [8, 9])
    other = make_seq(toks(20, 4))
    for s in (producer, waiter, other):
        sched.add(s)
    out = sched.schedule()
    assert [s for s, _ in out.scheduled] == [producer, other]
    assert sched.waiting == [waiter]
    fake_step(sched, out)
    out = sched.schedule()  # the prefix is cached now: the waiter computes its tail only
    assert (waiter, 2) in out.scheduled and waiter.request.num_cached_tokens == 48


def test_waiters_proceed_when_the_producer_is_aborted():
    prefix = toks(48, 5)
    sched = scheduler(max_num_batched_tokens=16)  # the prefix takes 4 steps
    producer = make_seq(prefix + [1])
    waiters = [make_seq(prefix + [2 + i]) for i in range(3)]
    for s in (producer, *waiters):
        sched.add(s)
    fake_step(sched, sched.schedule())  # 16 of its tokens computed, 4 blocks cached
    assert sched.running == [producer] and sched.waiting == waiters
    sched.remove(producer)  # cancelled
    out = sched.schedule()
    first = waiters[0]
    # the first waiter takes the 4 committed blocks as hits and becomes the producer of the rest
    assert out.scheduled == [(first, 16)] and first.num_computed_tokens == 16
    prefill_tokens(sched, waiters)
    assert all(s.status is SeqStatus.FINISHED for s in waiters)
    assert sched.kv.pool.num_free == sched.kv.pool.num_blocks


def test_waiters_proceed_when_the_producer_is_preempted():
    """A decoding request needs blocks the prefilling producer holds, so the producer (lowest
    priority) is preempted; the held waiter, ahead of it now, is admitted with the blocks the
    producer committed as hits, and the producer waits on the waiter in turn."""
    prefix = toks(48, 6)
    sched = scheduler(num_blocks=16, max_num_batched_tokens=9, max_num_seqs=3)
    decoder = make_seq(toks(7, 7), max_tokens=40, priority=2)
    sched.add(decoder)
    fake_step(sched, sched.schedule())
    producer = make_seq(prefix + [1], max_tokens=1, priority=0)
    sched.add(producer)
    fake_step(sched, sched.schedule())
    waiter = make_seq(prefix + [2], max_tokens=1, priority=1)
    sched.add(waiter)
    events = []
    for _ in range(300):
        if not sched.num_unfinished:
            break
        out = sched.schedule()
        if producer in out.preempted:
            events.append(("preempted", producer.num_computed_tokens))
        if waiter in [s for s, _ in out.scheduled] and waiter.status is SeqStatus.RUNNING:
            if not events or events[-1][0] != "waiter":
                events.append(("waiter", waiter.num_computed_tokens))
        fake_step(sched, out)
        assert_ref_counts(sched.kv.pool, sched.running + sched.waiting)
    assert events[0][0] == "preempted" and events[1][0] == "waiter", events
    assert events[1][1] > 0  # the waiter started from the producer's committed blocks
    assert sched.num_prefix_holds > 0
    assert all(s.status is SeqStatus.FINISHED for s in (decoder, producer, waiter))
    assert sched.kv.pool.num_free == sched.kv.pool.num_blocks


def test_off_without_prefix_caching():
    sched = Scheduler(EngineConfig(), KVCacheManager(64, BS, False))
    assert not sched.share_inflight_prefixes
    assert isinstance(sched.schedule(), SchedulerOutput)


# -- the engine, on a tiny seeded model ---------------------------------------------------------
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tiny_model_dir):
    return str(tiny_model_dir("qwen2"))


def engine(path: str, **kw) -> Engine:
    kw.setdefault("num_kv_blocks", 512)
    return Engine(path, block_size=BS, **kw)


def alone(path: str, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    """Each prompt run by itself on a fresh engine without prefix caching."""
    cold = engine(path, enable_prefix_caching=False)
    return [cold.generate([p], params)[0].outputs[0].token_ids for p in prompts]


def test_engine_computes_the_shared_prefix_once(path):
    prefix, n = toks(96, 11), 6
    prompts = [prefix + toks(5 + i, 30 + i) for i in range(n)]
    tails = sum(len(p) - len(prefix) for p in prompts)
    decode = n * (GREEDY.max_tokens - 1)  # the last sampled token needs no KV
    computed = {}
    for share in (True, False):
        eng = engine(path, max_num_batched_tokens=2048)  # every prompt fits in one step
        eng.scheduler.share_inflight_prefixes = share
        outs = eng.generate(prompts, GREEDY)
        computed[share] = eng.num_computed_tokens
        if share:
            shared = [o.outputs[0].token_ids for o in outs]
            assert [o.num_cached_tokens for o in outs] == [0] + [len(prefix)] * (n - 1)
            assert eng.stats()["prefix_holds"] >= n - 1
        else:
            assert [o.outputs[0].token_ids for o in outs] == shared
    assert computed[True] == len(prefix) + tails + decode
    assert computed[False] == n * len(prefix) + tails + decode
    assert shared == alone(path, prompts)
    for p, o in zip(prompts, shared, strict=True):
        assert_greedy(path, p, o)


def run_steps(eng: Engine, ids: list[str], on_step=None) -> dict[str, list[int]]:
    """Step to the end (calling ``on_step(step)`` first each time); each request's tokens."""
    outs: dict[str, list[int]] = {i: [] for i in ids}
    for step in range(1000):
        if not eng.has_unfinished_requests():
            return outs
        if on_step is not None:
            on_step(step)
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
        check_invariants(eng)
    raise AssertionError("the engine made no progress")


def test_engine_waiters_finish_when_the_producer_is_cancelled(path):
    prefix = toks(80, 12)
    prompts = [prefix + toks(4, 40 + i) for i in range(4)]
    eng = engine(path, max_num_batched_tokens=24)  # the prefix takes several steps
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, GREEDY)

    def cancel_producer(step: int) -> None:
        if step == 2:
            assert [s.request.request_id for s in eng.scheduler.running] == ["r0"]
            assert eng.abort_request("r0")

    outs = run_steps(eng, [f"r{i}" for i in range(4)], cancel_producer)
    assert outs["r0"] == []
    assert [outs[f"r{i}"] for i in range(1, 4)] == alone(path, prompts[1:])
    for p, i in zip(prompts[1:], range(1, 4), strict=True):
        assert_greedy(path, p, outs[f"r{i}"])
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks


def test_engine_waiters_finish_when_the_producer_is_preempted(path):
    """A tight pool: the high-priority request's decodes preempt the prefix's producer (lowest
    priority) while three requests wait on it; every output is still each prompt's alone."""
    prefix = toks(64, 13)
    prompts = [prefix + toks(3, 50 + i) for i in range(4)] + [toks(30, 60)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    eng = engine(path, num_kv_blocks=24, max_num_batched_tokens=12, max_num_seqs=4,
                 long_prefill_token_threshold=8)
    ids = ["r0", "r1", "r2", "r3", "long"]
    outs: dict[str, list[int]] = {i: [] for i in ids}

    def step() -> None:
        for o in eng.step():
            outs[o.request_id].extend(o.new_token_ids)
        check_invariants(eng)

    eng.add_request("long", prompts[-1], params, priority=2)
    eng.add_request("r0", prompts[0], params, priority=0)
    producer = eng.requests["r0"].seqs[0]
    while producer not in eng.scheduler.running:
        step()
    for i in (1, 2, 3):
        eng.add_request(f"r{i}", prompts[i], params, priority=1)
    held_when_preempted = None
    while eng.has_unfinished_requests():
        holds = eng.stats()["prefix_holds"]
        step()
        if held_when_preempted is None and producer.num_preemptions:
            held_when_preempted = holds
    assert held_when_preempted and producer.num_preemptions
    assert [outs[i] for i in ids] == alone(path, prompts, params)
    assert eng.kv.pool.num_free == eng.kv.pool.num_blocks


def test_engine_n_forks_and_drafts_share_the_prefix(path):
    """n > 1 requests and speculative decoding beside held requests: outputs unchanged."""
    prefix = toks(64, 14)
    prompts = [prefix + toks(4, 70 + i) for i in range(3)]
    params = [SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                             repetition_penalty=0.6),
              SamplingParams(temperature=0.8, seed=9, max_tokens=10, ignore_eos=True)]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}  # every step
    results = {}
    for share in (True, False):
        eng = engine(path, speculative_config=spec)
        eng.scheduler.share_inflight_prefixes = share
        outs = eng.generate(prompts, params)
        results[share] = [[c.token_ids for c in o.outputs] for o in outs]
        if share:
            assert eng.stats()["prefix_holds"] > 0
            assert [o.num_cached_tokens for o in outs] == [0, 64, 64]
            assert eng.stats()["spec_decode_num_drafts"] > 0
    assert results[True] == results[False]
    assert len(results[True][0]) == 3
