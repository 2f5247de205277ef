"""The scheduler's rules, without a model: token budget, chunked prefill, decode-first packing,
preemption of the newest sequence when blocks run out, and priorities."""

from __future__ import annotations

import random

import pytest

from pagedq.worker.config import EngineConfig
from pagedq.worker.engine.kv_cache_manager import KVCacheManager
from pagedq.worker.engine.scheduler import Scheduler
from pagedq.worker.engine.sequence import SeqStatus
from tests.engine.sequences import assert_ref_counts, fake_step, make_seq


def scheduler(num_blocks: int = 64, block_size: int = 4, prefix: bool = False,
              **knobs) -> Scheduler:
    return Scheduler(EngineConfig(**knobs), KVCacheManager(num_blocks, block_size, prefix))


def run(sched: Scheduler, steps: int = 1000) -> list:
    """Step until nothing is left; returns every step's plan."""
    plans = []
    for _ in range(steps):
        if not sched.num_unfinished:
            return plans
        out = sched.schedule()
        plans.append([(s, n) for s, n in out.scheduled])
        fake_step(sched, out)
    raise AssertionError("the scheduler made no progress")


def test_computed_catches_up_with_known_within_the_budget():
    sched = scheduler(max_num_batched_tokens=4)
    seq = make_seq(10, max_tokens=3)
    sched.add(seq)
    chunks = []
    while sched.num_unfinished:
        out = sched.schedule()
        assert out.num_batched_tokens <= 4
        for s, n in out.scheduled:
            assert s.num_computed_tokens + n <= s.num_tokens  # never beyond what is known
            chunks.append(n)
        fake_step(sched, out)
    # 10 prompt tokens in chunks of 4, 4, 2; then one token per decode (the last sampled
    # token is never computed: it needs no KV)
    assert chunks == [4, 4, 2, 1, 1]
    assert seq.output_token_ids == [7, 7, 7]


def test_long_prefill_threshold_caps_a_prompts_chunk():
    sched = scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=3)
    sched.add(make_seq(8, max_tokens=1))
    assert [n for plan in run(sched) for _, n in plan] == [3, 3, 2]


def decodes_then_prompt(sched: Scheduler, prompt_len: int, max_tokens: int):
    """Two short requests whose prompts are computed (they decode from now on), then a
    waiting prompt of ``prompt_len`` tokens."""
    a, b = make_seq(2, max_tokens=max_tokens), make_seq(2, max_tokens=max_tokens)
    sched.add(a)
    sched.add(b)
    fake_step(sched, sched.schedule())
    prompt = make_seq(prompt_len, max_tokens=1)
    sched.add(prompt)
    return a, b, prompt


def test_decodes_go_first_and_a_prompt_takes_the_rest_of_the_budget():
    sched = scheduler(max_num_batched_tokens=8)
    a, b, long = decodes_then_prompt(sched, 20, max_tokens=10)
    assert sched.schedule().scheduled == [(a, 1), (b, 1), (long, 6)]


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_that_holds_it():
    sched = scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    a, b, prompt = decodes_then_prompt(sched, 9, max_tokens=3)
    out = sched.schedule()  # 8 tokens left after two decodes: the 9-token prompt must wait
    assert [s for s, _ in out.scheduled] == [a, b] and prompt in sched.waiting
    fake_step(sched, out)
    fake_step(sched, sched.schedule())  # a and b finish
    assert sched.schedule().scheduled == [(prompt, 9)]


def test_chunked_prefill_uses_the_budget_the_decodes_leave():
    sched = scheduler(max_num_batched_tokens=10)
    a, b, prompt = decodes_then_prompt(sched, 9, max_tokens=3)
    assert sched.schedule().scheduled == [(a, 1), (b, 1), (prompt, 8)]


def test_max_num_seqs_caps_the_running_set():
    sched = scheduler(max_num_seqs=2)
    seqs = [make_seq(3, max_tokens=2) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s for s, _ in out.scheduled] == seqs[:2] and sched.waiting == [seqs[2]]


def test_higher_priority_is_admitted_first_then_first_come_first_served():
    sched = scheduler(max_num_seqs=1)
    low, high_early, high_late = (make_seq(3, priority=0), make_seq(3, priority=5),
                                  make_seq(3, priority=5))
    for s in (low, high_early, high_late):
        sched.add(s)
    assert sched.waiting == [high_early, high_late, low]
    admitted = []
    while sched.num_unfinished:
        out = sched.schedule()
        admitted += [s for s, _ in out.scheduled if s not in admitted]
        fake_step(sched, out)
    assert admitted == [high_early, high_late, low]


def test_when_blocks_run_out_the_newest_sequence_is_preempted_and_recomputed():
    # 3 sequences of 4 prompt tokens = 1 full block each; 4 blocks in all. The first decode
    # of each needs a second block: only one is free, so the newest is preempted.
    sched = scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    seqs = [make_seq(4, max_tokens=6) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    fake_step(sched, sched.schedule())
    out = sched.schedule()
    assert out.preempted == [seqs[2]] and seqs[2].status is SeqStatus.WAITING
    assert seqs[2].block_table == [] and seqs[2].num_computed_tokens == 0
    assert [s for s, _ in out.scheduled] == seqs[:2]
    assert sched.num_preemptions == 1 and seqs[2].num_preemptions == 1
    kept = list(seqs[2].output_token_ids)
    run(sched)
    assert all(s.is_finished and s.num_generated == 6 for s in seqs)
    assert seqs[2].output_token_ids[:len(kept)] == kept  # it keeps what it generated
    assert sched.kv.pool.num_free == 4


def test_the_lowest_priority_is_preempted_before_a_newer_higher_one():
    sched = scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    low = make_seq(4, priority=0, max_tokens=6)
    high = [make_seq(4, priority=1, max_tokens=6) for _ in range(2)]
    for s in (low, *high):
        sched.add(s)
    fake_step(sched, sched.schedule())  # admitted high, high, low (priority order)
    assert sched.running == [*high, low]
    out = sched.schedule()
    assert out.preempted == [low]


def test_a_sequence_that_cannot_fit_alone_preempts_itself():
    sched = scheduler(num_blocks=2, block_size=4, max_num_batched_tokens=64)
    seq = make_seq(8, max_tokens=4)  # 2 blocks for the prompt, a third for the first decode
    sched.add(seq)
    fake_step(sched, sched.schedule())
    out = sched.schedule()
    assert out.preempted == [seq] and not out.scheduled and seq in sched.waiting


@pytest.mark.parametrize("seed", range(5))
def test_random_traffic_keeps_the_block_invariants(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    sched = scheduler(num_blocks=40, block_size=block_size, prefix=rng.random() < 0.5,
                      max_num_batched_tokens=rng.randint(4, 32), max_num_seqs=rng.randint(1, 6),
                      long_prefill_token_threshold=rng.choice([0, 3]))
    pending = [make_seq([rng.randint(0, 5) for _ in range(rng.randint(1, 30))],
                        priority=rng.randint(0, 2), max_tokens=rng.randint(1, 8))
               for _ in range(12)]
    seqs = list(pending)
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            sched.add(pending.pop())
        if not pending and not sched.num_unfinished:
            break
        out = sched.schedule()
        for s, n in out.scheduled:
            assert s.num_computed_tokens + n <= s.num_tokens
        fake_step(sched, out)
        assert_ref_counts(sched.kv.pool, sched.running + sched.waiting)
        for s in sched.running:
            assert len(s.block_table) * block_size >= s.num_computed_tokens
    assert all(s.is_finished for s in seqs)
    assert sched.kv.pool.num_free == 40
