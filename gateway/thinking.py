"""Where a chat request's prompt leaves the model's reasoning, read as the worker renders it.

A thinking model's answer is split into ``reasoning_content`` and the rest (tools.py), and that
split must start where the prompt leaves off: inside ``<think>`` for a template that opens the
block itself (Qwen3 thinking-2507, QwQ), nowhere for a closed empty block (Qwen3 with
``chat_template_kwargs: {"enable_thinking": false}``), else wherever the model opens one
(``pagedq.tools.reasoning.prompt_thinking``). The gateway renders the conversation with the
code the worker runs (``pagedq/tools/prompt.py``) and the served model's tokenizer, read from
the directory its workers report; the worker fits its grammar to its own prompt's tail the same
way (``worker/engine/intake.py settle_reasoning``). Only tool requests on a thinking model pay
for the render.
"""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path
from typing import Any

from pagedq.gateway.tools import model_format, reasoning_model
from pagedq.gateway.translate import JobSpec, use_tool_format
from pagedq.logging import get_logger
from pagedq.tools import prompt_thinking
from pagedq.tools.prompt import render_chat
from pagedq.tools.reasoning import FREE

log = get_logger("pagedq.gateway.thinking")


@functools.lru_cache(maxsize=16)
def chat_tokenizer(model_path: str) -> Any | None:
    """The model directory's tokenizer (for its chat template), or None where unreadable."""
    directory = Path(model_path)
    if not (directory / "tokenizer_config.json").is_file():
        return None
    # transformers costs ~3 s to import: paid by the first tool request on a thinking model
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as exc:
        log.info("the model's tokenizer is not loadable here; reasoning starts free",
                 model=model_path, error=str(exc))
        return None


def rendered_thinking(model_path: str | None, messages: list[dict[str, Any]], tools: Any,
                      template_kwargs: dict[str, Any] | None) -> str:
    """``prompt_thinking`` of the conversation as the worker will render it; ``FREE`` where
    the tokenizer is not readable here or the template refuses (the worker then says why)."""
    tok = chat_tokenizer(model_path) if model_path else None
    if tok is None or not getattr(tok, "chat_template", None):
        return FREE
    try:
        return prompt_thinking(render_chat(tok, messages, tools, template_kwargs))
    except Exception:  # the worker renders it again and reports the template's refusal
        return FREE


async def thinking_of(model_path: str | None, messages: list[dict[str, Any]], tools: Any,
                      template_kwargs: dict[str, Any] | None) -> str:
    """``rendered_thinking`` off the event loop (a tokenizer load, a jinja render)."""
    return await asyncio.get_running_loop().run_in_executor(
        None, rendered_thinking, model_path, messages, tools, template_kwargs)


async def fit_tool_format(spec: JobSpec, model_path: str | None, override: str) -> None:
    """``use_tool_format`` for the served model: its call format, and on a thinking model
    where the rendered prompt leaves the reasoning (no render without tools)."""
    if spec.view.tools is None:
        return
    fmt, thinks = model_format(model_path, override), reasoning_model(model_path)
    use_tool_format(spec, fmt, thinks)
    so = spec.params.structured_outputs
    if thinks and so is not None:  # rendered with the tools as the worker will list them
        thinking = await thinking_of(model_path, spec.prompts[0], so.tool_spec,
                                     spec.chat_template_kwargs)
        use_tool_format(spec, fmt, thinks, thinking)
