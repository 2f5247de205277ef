"""A conversation with tools -> the prompt text, through the model's own chat template.

A template that renders tools itself, in the format the request's calls are constrained to
(Qwen2.5/Qwen3 for "hermes", Llama 3.1+ for "llama"), gets the tools and the past calls as
``apply_chat_template(..., tools=...)`` expects them (arguments as objects, call ids in the
shape the family's template insists on: Mistral's 9 alphanumerics). Any other
template (SmolLM2's ChatML has no tools) gets them folded into plain messages: the format's
system prompt listing the tools, each past call as its text, each tool result wrapped the way
the format shows results. Either way the model is told exactly the syntax the grammar allows.

``template_kwargs`` are vLLM's and SGLang's ``chat_template_kwargs`` (``{"enable_thinking":
false}`` for Qwen3): extra variables for the template, checked by ``check_template_kwargs``
(a bounded map of names; the names the render sets itself are refused).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pagedq.errors import InvalidRequestError
from pagedq.tools import HERMES, ToolFormat, ToolSpec, detect_format, get_format
from pagedq.tools.hermes import tool_result

MAX_TEMPLATE_KWARGS = 32  # names in chat_template_kwargs
MAX_TEMPLATE_KWARGS_BYTES = 8192  # their JSON
# what the render passes itself: a request may not replace it
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "tokenize",
    "return_dict", "return_tensors", "continue_final_message", "chat_template", "tokenizer",
    "padding", "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_template_kwargs(value: Any) -> dict[str, Any] | None:
    """``chat_template_kwargs`` as given, checked: None, or a map of at most
    ``MAX_TEMPLATE_KWARGS`` identifier names to JSON values of at most
    ``MAX_TEMPLATE_KWARGS_BYTES``; raises InvalidRequestError saying what to change."""
    if value is None:
        return None
    what = "chat_template_kwargs"
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{what} must be a map of names to values (e.g. "
                                  f'{{"enable_thinking": false}}), got {type(value).__name__}')
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise InvalidRequestError(f"{what} has {len(value)} names, over the limit of "
                                  f"{MAX_TEMPLATE_KWARGS}")
    for key in value:
        if not isinstance(key, str) or not key.isidentifier():
            raise InvalidRequestError(f"{what} names must be identifiers (template variables), "
                                      f"got {key!r}")
        if key in RESERVED_TEMPLATE_KWARGS:
            raise InvalidRequestError(f"{what} may not set {key!r}: the server passes it "
                                      "itself (send it as the request's own field)")
    try:
        size = len(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidRequestError(f"{what} values must be JSON (strings, numbers, booleans, "
                                  f"null, lists, maps): {exc}") from None
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise InvalidRequestError(f"{what} is {size} bytes of JSON, over the limit of "
                                  f"{MAX_TEMPLATE_KWARGS_BYTES}")
    return value


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: ToolSpec | None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of ``messages`` (with ``tools``, if any), ready for the reply;
    ``template_kwargs``: the request's ``chat_template_kwargs`` (checked here)."""
    extra = check_template_kwargs(template_kwargs) or {}
    template = tokenizer.chat_template
    native = detect_format(template if isinstance(template, str) else json.dumps(template))
    fmt = get_format(tools.format) if tools is not None else (native or HERMES)
    if native is not None and native.name == fmt.name:
        return tokenizer.apply_chat_template(
            [_native(m, fmt) for m in messages], tools=tools.tools if tools is not None else None,
            add_generation_prompt=True, tokenize=False, **extra)
    folded = [_folded(m, fmt) for m in messages]
    if tools is not None:
        prompt = fmt.system_prompt(tools.tools)
        if folded and folded[0]["role"] == "system":
            folded[0] = {"role": "system", "content": f"{folded[0]['content']}\n\n{prompt}"}
        else:
            folded.insert(0, {"role": "system", "content": prompt})
    return tokenizer.apply_chat_template(folded, add_generation_prompt=True, tokenize=False,
                                         **extra)


def _native(message: dict[str, Any], fmt: ToolFormat) -> dict[str, Any]:
    """Past calls' arguments as objects, which tool-aware templates serialize themselves; ids
    reshaped where the family's template checks them (a call and its result keep matching)."""
    if message.get("tool_call_id") is not None and fmt.id_length:
        return {**message, "tool_call_id": _family_id(message["tool_call_id"], fmt.id_length)}
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"])}}
             for c in message["tool_calls"]]
    if fmt.id_length:
        calls = [{**c, "id": _family_id(c.get("id", ""), fmt.id_length)} for c in calls]
    return {**message, "tool_calls": calls}


def _family_id(call_id: str, length: int) -> str:
    """An alphanumeric id of ``length`` characters standing for ``call_id`` (the same every
    time, so a call and the result that names it still pair up)."""
    digest = hashlib.sha256(str(call_id).encode()).hexdigest()
    return digest[:length]


def _folded(message: dict[str, Any], fmt: ToolFormat) -> dict[str, str]:
    role, content = message["role"], message.get("content") or ""
    if message.get("tool_calls"):
        calls = fmt.calls_text([(c["function"]["name"], _arguments(c["function"]))
                                for c in message["tool_calls"]])
        content = f"{content}\n{calls}" if content else calls
    elif role == "tool" and fmt is HERMES:
        content = tool_result(content)
    return {"role": role, "content": content}


def _arguments(function: dict[str, Any]) -> Any:
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args if args is not None else {}
