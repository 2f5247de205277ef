"""Request intake: what a caller sends, checked and tokenized before the scheduler sees it.

Every check raises a typed error whose message says what to change, so a bad request fails
at ``add_request`` (and a worker fails only that job) instead of inside a step.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from pagedq.errors import InvalidRequestError, RequestTooLongError
from pagedq.params import SamplingParams
from pagedq.tools import prompt_thinking
from pagedq.tools.prompt import check_template_kwargs, render_chat
from pagedq.tools.reasoning import CLOSED, OPEN


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
                params: SamplingParams | None = None,
                template_kwargs: dict | None = None) -> list[int]:
    """Token ids of ``messages`` rendered by the model's chat template, ending where the
    assistant's reply begins; with the tools of ``params`` (a ``tools`` constraint), if any,
    and the request's ``chat_template_kwargs`` (``template_kwargs``)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(f"model {model_path} has no chat template")
    check_template_kwargs(template_kwargs)
    so = params.structured_outputs if params is not None else None
    tools = so.tool_spec if so is not None and so.kind == "tools" else None

    def render(msgs: list[dict]) -> str:
        try:
            return render_chat(tokenizer, msgs, tools, template_kwargs)
        except Exception as exc:  # jinja: a role or message shape this template refuses
            raise InvalidRequestError(f"the chat template of {model_path} refused these "
                                      f"messages: {exc}") from exc

    text = render(messages)
    controls = control_texts(tokenizer)
    if not any(c in str(m.get("content") or "") for m in messages for c in controls):
        return tokenizer(text, add_special_tokens=False).input_ids
    return _contents_as_text(tokenizer, messages, controls, render)


def control_texts(tokenizer) -> list[str]:
    """The texts a tokenizer turns into one added token wherever they appear (``<|im_start|>``,
    ``<|eot_id|>``, ...): what the chat template uses to mark turns."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return [t.content for t in added.values() if getattr(t, "content", "")]


def _contents_as_text(tokenizer, messages: list[dict], controls: list[str],
                      render: Callable[[list[dict]], str]) -> list[int]:
    """The template rendered around placeholders, its own text tokenized as usual and each
    message's content as plain text (control-token text in it splits into ordinary tokens), so
    text pasted into a message can never open a turn of its own."""
    marks = [f"\ue000pagedq{i}\ue001" for i in range(len(messages))]
    stand_ins = [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)]
    text = render(stand_ins)
    pieces = re.split("(" + "|".join(map(re.escape, marks)) + ")", text)
    if sorted(p for p in pieces if p in marks) != sorted(marks):
        found = next(c for c in controls for m in messages if c in str(m.get("content") or ""))
        raise InvalidRequestError(
            f"a message holds {found!r}, this model's control text, and its chat template "
            "does not show each message once as given: remove it from the message")
    ids: list[int] = []
    for piece in pieces:
        if piece in marks:
            content = str(messages[marks.index(piece)].get("content") or "")
            ids += tokenizer(content, add_special_tokens=False, split_special_tokens=True).input_ids
        elif piece:
            ids += tokenizer(piece, add_special_tokens=False).input_ids
    return ids


def settle_reasoning(params: SamplingParams, tokenizer, ids: list[int]) -> SamplingParams:
    """``params`` whose tools constraint expects reasoning (``ToolSpec.reasoning``) fitted to
    where the prompt leaves it (pagedq.tools.reasoning): a prompt ending inside ``<think>``
    starts the grammar inside the block, one ending with a closed block (thinking off) drops
    it. Read from the prompt's last tokens, so it holds however the prompt was rendered."""
    so = params.structured_outputs
    spec = so.tool_spec if so is not None and so.kind == "tools" else None
    if spec is None or not spec.reasoning or tokenizer is None:
        return params
    state = prompt_thinking(tokenizer.decode(ids[-8:]))
    fitted = replace(spec, reasoning=state != CLOSED, reasoning_open=state == OPEN)
    if fitted == spec:
        return params
    return replace(params, structured_outputs=replace(so, tools=fitted.to_dict()))


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
        # transformers costs ~3 s to import (see models/loader.py); only this fallback reads it
        from transformers import GenerationConfig

        add(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except (OSError, ValueError):
        pass
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
