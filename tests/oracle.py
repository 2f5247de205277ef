"""The transformers oracle: does a token sequence equal the model's own greedy choice?

We teacher-force our output through transformers' forward pass and check every generated token
is its argmax. Only a near-tie (top-1 minus our token's logit < TIE) may excuse a difference;
after an excused divergence the rest of the sequence legitimately differs, so checking stops.
"""

from __future__ import annotations

import functools

import torch

TIE = 1e-3


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def hf_logits(path, token_ids: list[int]) -> torch.Tensor:
    return hf_model(str(path))(torch.tensor([token_ids])).logits[0].float()


def assert_greedy(path, prompt: list[int], output: list[int]) -> None:
    """Every output token is transformers' greedy choice given the tokens before it."""
    logits = hf_logits(path, prompt + output)
    for i, token in enumerate(output):
        row = logits[len(prompt) - 1 + i]
        best = int(row.argmax())
        if token == best:
            continue
        gap = float(row[best] - row[token])
        assert gap < TIE, (
            f"token {i} of output: got {token}, transformers' greedy is {best} (gap {gap:.4g})"
        )
        return  # a near-tie: the sequences may legitimately diverge from here


def hf_greedy(path, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = hf_model(str(path))
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
