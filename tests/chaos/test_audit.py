"""The chaos audit's own oracle: a near-tie flip is told apart from a protocol fault."""

from __future__ import annotations

from pagedq.params import SamplingParams
from tests.chaos.harness import Job, expected_tokens, near_tie


def test_near_tie_explains_a_flip_and_never_a_corrupted_stream(tiny_model_dir):
    model = str(tiny_model_dir("llama"))
    jobs = [Job([5, 9, 2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)),
            Job([7, 1], SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=24,
                                       ignore_eos=True))]
    for job, (*samples,) in zip(jobs, expected_tokens(model, jobs), strict=True):
        true = [list(s) for s in samples]
        other = [list(s) for s in true]
        other[-1][10] = (other[-1][10] + 1) % 300
        # the stream is the engine's own run; the reference picked otherwise at one position
        assert near_tie(model, job, true, other) != ""
        # the stream has a wrong token and then carries on as if it had not: not a flip
        assert near_tie(model, job, other, true) == ""
        shifted = [s[:5] + s[6:] + [s[5]] for s in true]  # a token lost, another repeated
        assert near_tie(model, job, shifted, true) == ""
