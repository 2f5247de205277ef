"""OpenAI tool calling <-> pagedq's ``tools`` constraint, and the calls back in OpenAI's shape.

``tools``, ``tool_choice`` and ``parallel_tool_calls`` become the ``tools`` kind of
``structured_outputs`` (``pagedq.tools.ToolSpec``): the worker lists the tools through the
model's chat template and constrains the output to the call format, so every call that ends
parses, names a declared function and validates against its schema. The format is Hermes'
``<tool_call>{json}</tool_call>`` (SmolLM2's, Qwen2.5's and Qwen3's). Past calls and tool
results in ``messages`` travel to the worker as plain maps for its template.

The answer's text is split by ``pagedq.tools.ToolCallParser``: ``message.tool_calls`` with
ids, ``finish_reason: "tool_calls"``; streamed, ``delta.tool_calls`` whose argument fragments
concatenate to the arguments' JSON.
"""

from __future__ import annotations

import json
from typing import Any

from pagedq.client import CompletionResult
from pagedq.errors import InvalidParamsError
from pagedq.gateway.api_errors import bad_request, invalid_params
from pagedq.gateway.openai import ChatCompletionRequest, ChatMessage
from pagedq.tools import HERMES, ToolCallParser, ToolSpec, get_format, parse_tool_calls

DEFAULT_FORMAT = HERMES.name


def tool_constraint(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The request's ``structured_outputs`` for its tools, or None (no tools, or "none")."""
    if req.functions or req.model_extra and req.model_extra.get("function_call") is not None:
        raise bad_request("functions/function_call (deprecated) are not supported: send tools "
                          "and tool_choice", "functions")
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if not req.tools:
        if choice not in ("auto", "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    if isinstance(choice, str) and choice not in ("auto", "required"):
        raise bad_request(f"tool_choice {choice!r} must be 'none', 'auto', 'required' or "
                          "{'type': 'function', 'function': {'name': NAME}}", "tool_choice")
    parallel = req.parallel_tool_calls if req.parallel_tool_calls is not None else True
    spec = {"tools": req.tools, "tool_choice": choice, "parallel_tool_calls": parallel,
            "format": DEFAULT_FORMAT}
    try:
        ToolSpec.coerce(spec)
    except InvalidParamsError as exc:
        raise invalid_params(exc) from exc
    return {"tools": spec}


def wire_message(m: ChatMessage, base: dict[str, str]) -> dict[str, Any]:
    """A message for the worker's template: ``base`` (role, text content) plus an assistant's
    past ``tool_calls`` or a tool result's ``tool_call_id``."""
    extra = m.model_extra or {}
    out: dict[str, Any] = dict(base)
    if m.role == "assistant" and extra.get("tool_calls"):
        out["tool_calls"] = [_past_call(c, i) for i, c in enumerate(extra["tool_calls"])]
    elif m.role == "tool":
        if extra.get("tool_call_id") is not None:
            out["tool_call_id"] = str(extra["tool_call_id"])
        if m.name:
            out["name"] = m.name
    return out


def _past_call(call: Any, i: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"tool_calls[{i}] must be {{'id', 'type': 'function', 'function': "
                          "{'name', 'arguments'}}", "messages")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args)
    return {"id": str(call.get("id") or f"call_{i}"), "type": "function",
            "function": {"name": fn["name"], "arguments": args}}


def chat_choice(fmt_name: str, request_id: str, index: int, out: CompletionResult,
                reason: str | None, logprobs: Any) -> dict[str, Any]:
    """A non-streamed chat choice whose text may hold calls."""
    content, calls = parse_tool_calls(out.text, get_format(fmt_name), request_id, index)
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
        if reason == "stop":
            reason = "tool_calls"
    else:
        message["content"] = content
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


class ToolDeltas:
    """One streamed choice's text -> ``delta`` maps with content and/or ``tool_calls``."""

    def __init__(self, fmt_name: str, request_id: str, index: int):
        self.parser = ToolCallParser(get_format(fmt_name), request_id, index)

    def delta(self, text: str, ending: bool) -> dict[str, Any]:
        content, calls = self.parser.feed(text)
        if ending and self.parser.state == "text":
            content += self.parser.finish()
        out: dict[str, Any] = {}
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.parser.calls else reason
