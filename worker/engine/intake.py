"""Request intake: what a caller sends, checked and tokenized before the scheduler sees it.

Every check raises a typed error whose message says what to change, so a bad request fails
at ``add_request`` (and a worker fails only that job) instead of inside a step.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from pagedq.errors import InvalidRequestError, RequestTooLongError
from pagedq.params import SamplingParams


def coerce_params(params: SamplingParams | dict | None) -> SamplingParams:
    """SamplingParams from what the caller passed (None: the defaults; a dict: the wire form)."""
    if params is None:
        return SamplingParams()
    if isinstance(params, dict):
        return SamplingParams.from_dict(params)
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be SamplingParams, got {type(params).__name__}")
    params.validate()
    return params


def tokenize(tokenizer, vocab_size: int, model_path: Path, prompt: str | list[int] | None,
             prompt_token_ids: list[int] | None) -> tuple[str | None, list[int]]:
    """(prompt text or None, token ids): text is tokenized, ids are checked against the vocab."""
    if prompt_token_ids is None and isinstance(prompt, (list, tuple)):
        prompt, prompt_token_ids = None, list(prompt)
    if prompt_token_ids is None:
        if not isinstance(prompt, str):
            raise InvalidRequestError("prompt must be a string or a list of token ids")
        if tokenizer is None:
            raise InvalidRequestError(
                f"model {model_path} has no tokenizer: send token ids instead of text")
        prompt_token_ids = tokenizer(prompt).input_ids
    ids = list(prompt_token_ids)
    if not ids:
        raise InvalidRequestError("prompt is empty: send at least one token")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
               for t in ids):
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size})")
    return (prompt if isinstance(prompt, str) else None), ids


def chat_prompt(tokenizer, model_path: Path, messages: list[dict],
                params: SamplingParams | None = None) -> list[int]:
    """Token ids of ``messages`` rendered by the model's chat template, ending where the
    assistant's reply begins; with the tools of ``params`` (a ``tools`` constraint), if any."""
    from pagedq.worker.engine.tool_prompt import render_chat

    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(f"model {model_path} has no chat template")
    so = params.structured_outputs if params is not None else None
    tools = so.tool_spec if so is not None and so.kind == "tools" else None
    try:
        text = render_chat(tokenizer, messages, tools)
    except Exception as exc:  # jinja: a role or message shape this template refuses
        raise InvalidRequestError(f"the chat template of {model_path} refused these messages: "
                                  f"{exc}") from exc
    return tokenizer(text, add_special_tokens=False).input_ids


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """logit_bias may name only tokens of this model's vocabulary."""
    bad = sorted(t for t in params.logit_bias or {} if t >= vocab_size)
    if bad:
        raise InvalidRequestError(f"logit_bias names token ids {bad[:5]} outside this model's "
                                  f"vocabulary [0, {vocab_size})")


def fit_lengths(ids: list[int], params: SamplingParams, max_model_len: int) -> SamplingParams:
    """``params`` with max_tokens filled in (None: up to the limit); a request that cannot fit
    in ``max_model_len`` tokens raises RequestTooLongError."""
    if len(ids) >= max_model_len:
        raise RequestTooLongError(
            f"prompt has {len(ids)} tokens; this engine fits at most {max_model_len} tokens per "
            "sequence (prompt + output): shorten the prompt")
    if params.max_tokens is None:
        return replace(params, max_tokens=max_model_len - len(ids))
    if len(ids) + params.max_tokens > max_model_len:
        raise RequestTooLongError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"{max_model_len}, the most one sequence can hold (max_model_len, bounded by the KV "
            "cache): lower max_tokens or shorten the prompt")
    return params


def eos_token_ids(model_path: Path, hf_config, tokenizer) -> frozenset[int]:
    """Every token id that ends a generation: the model config's, the generation config's
    (chat models often list several there) and the tokenizer's."""
    ids: set[int] = set()

    def add(eos) -> None:
        ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])

    for source in (hf_config, getattr(tokenizer, "generation_config", None)):
        add(getattr(source, "eos_token_id", None))
    try:
        from transformers import GenerationConfig

        add(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except (OSError, ValueError):
        pass
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
