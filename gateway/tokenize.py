"""Routes: ``POST /tokenize`` and ``POST /detokenize``, in vLLM's request and response shapes.

Pipelines budget prompts with them: how many tokens a text or a conversation is for a model,
before they send it. The gateway runs no model, so it reads the served model's tokenizer from
the directory the workers report (one machine, or a shared model volume), as logprobs' token
texts do (tokens.py); a conversation is rendered by the same code the worker runs
(``pagedq/tools/prompt.py``, with its tools), so the count is the worker's count.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from pagedq.gateway.api_errors import APIError, bad_request
from pagedq.gateway.completions import served_path
from pagedq.gateway.openai import ChatMessage, _Body
from pagedq.gateway.tools import wire_message
from pagedq.gateway.translate import _message
from pagedq.tools import ToolSpec
from pagedq.tools.prompt import check_template_kwargs, render_chat

router = APIRouter()


class TokenizeRequest(_Body):
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: Any = None  # as chat completions' (translate.py checks it)


class DetokenizeRequest(_Body):
    model: str
    tokens: list[int] = Field(min_length=0)


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request) -> Response:
    tok, limit = await _tokenizer(request, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt and messages", "prompt")
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = tok(req.prompt, add_special_tokens=special).input_ids
    else:
        ids = _chat_ids(tok, req)
    body: dict[str, Any] = {"count": len(ids), "max_model_len": limit, "tokens": ids,
                            "token_strs": tok.convert_ids_to_tokens(ids)
                            if req.return_token_strs else None}
    return JSONResponse(body)


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request) -> Response:
    tok, _ = await _tokenizer(request, req.model)
    if any(not 0 <= t < len(tok) for t in req.tokens):
        raise bad_request(f"tokens must be token ids in [0, {len(tok)})", "tokens")
    return JSONResponse({"prompt": tok.decode(req.tokens)})


def _chat_ids(tok: Any, req: TokenizeRequest) -> list[int]:
    if not getattr(tok, "chat_template", None):
        raise bad_request(f"model {req.model} has no chat template: send a prompt", "messages")
    messages = [wire_message(m, _message(m.role, m.content)) for m in req.messages or []]
    tools = None
    if req.tools:
        try:
            tools = ToolSpec(tools=req.tools)
        except Exception as exc:
            raise bad_request(str(exc), "tools") from exc

    try:
        kwargs = check_template_kwargs(req.chat_template_kwargs)
    except ValueError as exc:
        raise bad_request(str(exc), "chat_template_kwargs") from exc
    try:
        text = render_chat(tok, messages, tools, kwargs) if req.add_generation_prompt else \
            tok.apply_chat_template(messages, tokenize=False, **(kwargs or {}))
    except Exception as exc:  # the template refused these messages
        raise bad_request(f"the chat template refused these messages: {exc}", "messages") from exc
    return tok(text, add_special_tokens=bool(req.add_special_tokens)).input_ids


_TOKENIZERS: dict[str, tuple[Any, int | None]] = {}


async def _tokenizer(request: Request, model: str) -> tuple[Any, int | None]:
    """(the served model's tokenizer, its max_model_len), loaded once per model directory."""
    gw = request.app.state.gateway
    _, path = await served_path(gw, model)
    if path not in _TOKENIZERS:
        _TOKENIZERS[path] = await asyncio.get_running_loop().run_in_executor(None, _load, path)
    return _TOKENIZERS[path]


def _load(path: str) -> tuple[Any, int | None]:
    directory = Path(path)
    if not (directory / "tokenizer.json").is_file() and not (
            directory / "tokenizer_config.json").is_file():
        raise APIError(501, f"the tokenizer of {path} is not readable by this gateway (it reads "
                       "the workers' model directory): tokenize on a machine that has it",
                       "server_error", "tokenizer_unavailable")
    # transformers costs ~3 s to import: the gateway pays it on the first /tokenize, not at start
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    limit = None
    config = directory / "config.json"
    if config.is_file():
        limit = json.loads(config.read_text()).get("max_position_embeddings")
    return tok, limit
