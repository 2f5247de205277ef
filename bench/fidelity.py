"""How closely a quantized engine follows its reference: greedy agreement and perplexity.

- :func:`mean_matching_prefix`: greedy continuations of fixed prompts, the share of each
  continuation that equals the reference's before the first differing token, averaged. Greedy
  paths part at near-ties, so this is a mean over many prompts, not a per-token identity.
- :func:`perplexity`: teacher-forced perplexity of a fixed text (one prefill over its tokens).

The bench's ``quant`` scenario and the fidelity tests measure with these.
"""

from __future__ import annotations

import math

import torch

from pagedq.params import SamplingParams

PROMPTS = (
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
    "The three primary colors are", "In 1969, the first human to walk on the moon was",
    "To make a cup of tea, you first", "The largest planet in our solar system is",
    "Water boils at a temperature of", "A haiku is a short poem that", "The quick brown fox",
    "import numpy as np\n", "My favorite food is", "The theory of relativity was developed by",
    "Paris is known for", "The best way to learn a new language is",
    "Photosynthesis is the process",
)

TEXT = (
    "The river runs through the middle of the old town, past the market square and the stone "
    "bridge that was rebuilt after the flood. In the morning the bakers open their shops and "
    "the smell of fresh bread fills the narrow streets. Children walk to school along the "
    "water, and fishermen sit on the banks with their long rods, waiting patiently for a bite. "
    "At noon the bells of the church ring twelve times, and the workers gather in the square "
    "to eat their lunch in the sun. In the afternoon the tourists arrive by bus; they take "
    "photographs of the bridge, buy postcards and ice cream, and ask for directions to the "
    "museum, which holds a small collection of paintings and old maps of the region. When the "
    "evening comes, the lights along the river are switched on one by one, and the town grows "
    "quiet again. Cats sleep on the warm steps, and an old man plays the violin under a tree. "
    "Tomorrow the market will open early, as it has every Saturday for more than three hundred "
    "years."
)


def matching_prefix(tokens: list[int], reference: list[int]) -> float:
    """The share of ``tokens`` equal to ``reference`` before the first difference."""
    same = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b),
                min(len(tokens), len(reference)))
    return same / max(len(reference), 1)


def greedy(engine, prompts=PROMPTS, max_tokens: int = 32) -> list[list[int]]:
    """Greedy continuations of ``prompts``; a model without a tokenizer gets each text as token
    ids (its bytes folded into the vocabulary, past the first ids where specials live)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if engine.tokenizer is None:
        prompts = [token_ids(engine, p) for p in prompts]
    return [out.outputs[0].token_ids for out in engine.generate(list(prompts), params)]


def token_ids(engine, text: str | list[int]) -> list[int]:
    """``text`` as the engine's token ids: its tokenizer's, or without one the text's bytes
    folded into the vocabulary past the first ids (where specials live)."""
    if not isinstance(text, str):
        return list(text)
    if engine.tokenizer is not None:
        return engine.tokenizer(text).input_ids
    vocab = engine.hf_config.vocab_size
    return [3 + byte % (vocab - 3) for byte in text.encode()]


def mean_matching_prefix(outputs: list[list[int]], references: list[list[int]]) -> float:
    shares = [matching_prefix(o, r) for o, r in zip(outputs, references, strict=True)]
    return sum(shares) / len(shares)


@torch.inference_mode()
def perplexity(engine, text: str | list[int] = TEXT) -> float:
    """exp(mean negative log-likelihood) of each token of ``text`` given the ones before it,
    from one prefill of the text (its first ``max_model_len`` tokens) through the engine's
    model; its KV cache must hold them."""
    # the engine side is lazy in bench/: see context.py's setup
    from pagedq.worker.engine.scheduler import SchedulerOutput
    from pagedq.worker.engine.sequence import Request, Sequence

    ids = token_ids(engine, text)[:engine.max_model_len]
    runner = engine.runner
    blocks = math.ceil(len(ids) / runner.block_size)
    seq = Sequence(Request("perplexity", None, ids, SamplingParams(max_tokens=1)), 0, ids, len(ids),
                   block_table=list(range(blocks)))
    hidden = runner.forward(runner.prepare(SchedulerOutput(scheduled=[(seq, len(ids))])))
    logits = engine.model.compute_logits(hidden[:-1]).float()
    target = torch.tensor(ids[1:], device=logits.device)
    return math.exp(torch.nn.functional.cross_entropy(logits, target).item())
