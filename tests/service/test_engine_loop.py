"""The engine thread: one request whose step fails never fails its batch mates.

Oracle: the in-process engine's tokens for every innocent request; the streams the thread
reports must equal them with nothing lost or repeated across the recovery.
"""

from __future__ import annotations

import threading
import time

from pagedq.errors import EngineError
from pagedq.params import SamplingParams
from pagedq.worker.service.engine_loop import AddCmd, EngineLoop
from tests.service.harness import ENGINE


class PoisonedEngine:
    """A real engine whose step raises whenever the poisoned request is in it and has
    generated at least ``after`` tokens (a bad parameter that blows up in the sampler, say)."""

    def __init__(self, engine, poison: str, after: int = 3):
        self._engine = engine
        self.poison = poison
        self.after = after
        self.failures = 0

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def step(self):
        req = self._engine.requests.get(self.poison)
        if req is not None and max(s.num_generated for s in req.seqs) >= self.after:
            self.failures += 1
            raise RuntimeError("Overflow when unpacking long long")
        return self._engine.step()


def test_a_failing_request_is_isolated_and_its_batch_mates_finish_exactly(model, reference):
    from pagedq.worker import Engine

    jobs = {
        "greedy#1": ([1, 5, 9], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
        "seeded#1": ([2, 6], SamplingParams(temperature=0.8, seed=7, max_tokens=40,
                                            ignore_eos=True)),
        "pair#1": ([3, 3, 3], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=30,
                                             ignore_eos=True)),
        "poison#1": ([4, 4], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
    }
    engine = PoisonedEngine(Engine(model, **ENGINE), "poison#1")
    loop = EngineLoop(engine)
    tokens: dict[tuple[str, int], list[int]] = {}
    positions: dict[tuple[str, int], int] = {}
    finished, rejected = set(), {}
    done = threading.Event()

    def on_report(report):
        for out in report.outputs:
            key = (out.request_id, out.index)
            assert out.num_generated - len(out.new_token_ids) == positions.get(key, 0)
            positions[key] = out.num_generated
            tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.finished:
                finished.add(key)
        rejected.update(dict(report.rejected))
        if len(finished) == 4 and rejected:
            done.set()

    loop.start(on_report)
    for rid, (prompt, params) in jobs.items():
        loop.send(AddCmd(rid, params, prompt))
    try:
        assert done.wait(120), (finished, rejected)
    finally:
        loop.stop()
    assert set(rejected) == {"poison#1"} and isinstance(rejected["poison#1"], EngineError)
    assert "Overflow" in str(rejected["poison#1"])
    assert engine.failures >= 1
    for rid, (prompt, params) in jobs.items():
        if rid == "poison#1":
            continue
        want = reference(prompt, params)
        assert [tokens[(rid, i)] for i in range(params.n)] == want, rid


def test_a_step_that_fails_once_for_everyone_costs_nobody_their_job(model, reference):
    """A failure no single request explains (it does not come back) ends no job."""
    from pagedq.worker import Engine

    class Hiccup:
        def __init__(self, engine):
            self._engine = engine
            self.failed = False

        def __getattr__(self, name):
            return getattr(self._engine, name)

        def step(self):
            busy = sum(len(r.seqs) for r in self._engine.requests.values())
            if not self.failed and busy >= 3 and self._engine.num_steps > 4:
                self.failed = True
                raise MemoryError("a transient failure")
            return self._engine.step()

    params = [SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)] * 3
    prompts = [[1, 2], [3, 4, 5], [6]]
    loop = EngineLoop(Hiccup(Engine(model, **ENGINE)))
    tokens, rejected, finished = {}, [], set()

    def on_report(report):
        for out in report.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished.add(out.request_id)
        rejected.extend(report.rejected)

    loop.start(on_report)
    for k, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        loop.send(AddCmd(f"r{k}#1", sp, prompt))
    end = time.monotonic() + 120
    while len(finished) < 3 and time.monotonic() < end:
        time.sleep(0.05)
    loop.stop()
    assert loop.engine.failed and rejected == []
    for k, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        assert tokens[f"r{k}#1"] == reference(prompt, sp)[0]
