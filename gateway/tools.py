"""OpenAI tool calling <-> pagedq's ``tools`` constraint, and the calls back in OpenAI's shape.

``tools``, ``tool_choice`` and ``parallel_tool_calls`` become the ``tools`` kind of
``structured_outputs`` (``pagedq.tools.ToolSpec``): the worker lists the tools through the
model's chat template and constrains the output to the call format, so every call that ends
parses, names a declared function and validates against its schema. The format is the served
model's (``pagedq.tools.format_for_model``: Hermes ``<tool_call>`` for Qwen2.5/Qwen3/SmolLM2,
Llama 3.1+ JSON, Mistral ``[TOOL_CALLS]``), read from the directory its workers report, or
the operator's ``--tool-call-format``; a spec is built with Hermes and set to the model's once
the request is admitted (``use_tool_format``). Past calls and tool results in ``messages``
travel to the worker as plain maps for its template.

The deprecated ``functions`` / ``function_call`` are served as OpenAI still serves them: the
functions become tools, ``function_call`` the tool choice, at most one call, answered as
``message.function_call`` (streamed: ``delta.function_call``) with ``finish_reason:
"function_call"``; past ``function_call`` messages and ``role: "function"`` results are
accepted back.

The answer's text is split by ``pagedq.tools.ToolCallParser``: ``message.tool_calls`` with
ids, ``finish_reason: "tool_calls"``; streamed, ``delta.tool_calls`` whose argument fragments
concatenate to the arguments' JSON.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from pagedq.client import CompletionResult
from pagedq.errors import InvalidParamsError
from pagedq.gateway.api_errors import bad_request, invalid_params
from pagedq.gateway.openai import ChatCompletionRequest, ChatMessage
from pagedq.tools import (
    AUTO,
    HERMES,
    ReasoningSplitter,
    ToolCallParser,
    ToolSpec,
    format_for_model,
    get_format,
    model_thinks,
    parse_tool_calls,
    split_reasoning,
)

DEFAULT_FORMAT = HERMES.name
LEGACY = "function_call"  # View.tools_shape of a request that sent the deprecated functions
FUNCTION_CALL_ID = "call_fn_{}"  # a past legacy call's id: the index of its message


@functools.lru_cache(maxsize=256)
def model_format(model_path: str | None, override: str = AUTO) -> str:
    """The tool-call format of the model in ``model_path`` (its template, control tokens and
    architecture, where the directory is readable here; Hermes where it is not), or the
    operator's ``override``."""
    return format_for_model(model_path, override).name


@functools.lru_cache(maxsize=256)
def reasoning_model(model_path: str | None) -> bool:
    """Whether the model in ``model_path`` thinks in ``<think>`` first (its template says so,
    where the directory is readable here)."""
    return model_thinks(model_path)


def legacy_functions(req: ChatCompletionRequest) -> bool:
    """Turn the deprecated ``functions`` / ``function_call`` into ``tools`` / ``tool_choice``
    (one call at most, as OpenAI answers them); returns whether the request used them."""
    if req.function_call is not None and not req.functions:
        raise bad_request("function_call needs functions (or send tools and tool_choice)",
                          "function_call")
    if not req.functions:
        return False
    if req.tools or req.tool_choice is not None:
        raise bad_request("send either tools/tool_choice or the deprecated functions/"
                          "function_call, not both", "functions")
    req.tools = [{"type": "function", "function": f} for f in req.functions]
    choice = req.function_call
    if isinstance(choice, dict):
        if not isinstance(choice.get("name"), str):
            raise bad_request("function_call must be 'none', 'auto' or {'name': NAME}",
                              "function_call")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None and choice not in ("none", "auto"):
        raise bad_request(f"function_call {choice!r} must be 'none', 'auto' or {{'name': NAME}}",
                          "function_call")
    req.tool_choice = choice
    req.parallel_tool_calls = False
    return True


def tool_constraint(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The request's ``structured_outputs`` for its tools, or None (no tools, or "none")."""
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


def wire_messages(messages: list[ChatMessage], bases: list[dict[str, str]]
                  ) -> list[dict[str, Any]]:
    """The conversation for the worker's template (``wire_message`` each), the deprecated
    shapes made current: an assistant's ``function_call`` is a one-call ``tool_calls`` and a
    ``role: "function"`` result a ``role: "tool"`` one answering the last such call."""
    out: list[dict[str, Any]] = []
    last_call = None
    for j, (m, base) in enumerate(zip(messages, bases, strict=True)):
        extra = m.model_extra or {}
        if m.role == "assistant" and isinstance(extra.get("function_call"), dict) \
                and not extra.get("tool_calls"):
            last_call = FUNCTION_CALL_ID.format(j)
            call = {"id": last_call, "type": "function", "function": extra["function_call"]}
            out.append({**base, "tool_calls": [_past_call(call, 0)]})
        elif m.role == "function":
            result = {**base, "role": "tool", "name": m.name or ""}
            if last_call is not None:
                result["tool_call_id"] = last_call
            out.append(result)
        else:
            out.append(wire_message(m, base))
    return out


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
                reason: str | None, logprobs: Any, *, legacy: bool = False,
                prefix: str = "", reasoning: bool = False, opened: bool = False
                ) -> dict[str, Any]:
    """A non-streamed chat choice whose text may hold calls (``legacy``: the one call as
    ``function_call``); ``prefix``: echoed text before the content; ``reasoning``: a leading
    ``<think>`` block is ``reasoning_content``, never read for calls (``opened``: the prompt
    opened it, the text starts inside it)."""
    thought, text = split_reasoning(out.text, opened) if reasoning else (None, out.text)
    content, calls = parse_tool_calls(text, get_format(fmt_name), request_id, index)
    content = prefix + content
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:  # vLLM's older name and its current one
        message["reasoning_content"] = message["reasoning"] = thought
    if calls and legacy:
        message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
        reason = LEGACY if reason == "stop" else reason
    elif calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
        reason = "tool_calls" if reason == "stop" else reason
    else:
        message["content"] = content
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


class ToolDeltas:
    """One streamed choice's text -> ``delta`` maps with content and/or ``tool_calls``
    (``legacy``: ``function_call``)."""

    def __init__(self, fmt_name: str, request_id: str, index: int, legacy: bool = False,
                 reasoning: bool = False, opened: bool = False):
        self.parser = ToolCallParser(get_format(fmt_name), request_id, index)
        self.legacy = legacy
        self.thinking = ReasoningSplitter.after(opened) if reasoning else None

    def delta(self, text: str, ending: bool) -> dict[str, Any]:
        thought = ""
        if self.thinking is not None:
            thought, text = self.thinking.feed(text)
            if ending:
                more, tail = self.thinking.finish()
                thought, text = thought + more, text + tail
        content, calls = self.parser.feed(text)
        if ending and self.parser.state == "text":
            content += self.parser.finish()
        out: dict[str, Any] = {}
        if thought:
            out["reasoning_content"] = out["reasoning"] = thought
        if content:
            out["content"] = content
        if calls and self.legacy:
            out["function_call"] = _function_call_delta(calls)
        elif calls:
            out["tool_calls"] = calls
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        if reason != "stop" or not self.parser.calls:
            return reason
        return LEGACY if self.legacy else "tool_calls"


def _function_call_delta(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """``delta.tool_calls`` items of the one call -> ``delta.function_call`` (name first)."""
    out: dict[str, Any] = {}
    for item in calls:
        fn = item.get("function", {})
        if "name" in fn:
            out["name"] = fn["name"]
        out["arguments"] = out.get("arguments", "") + fn.get("arguments", "")
    return out
