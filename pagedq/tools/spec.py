"""``ToolSpec``: a request's tools, its tool choice and the call format, validated.

It travels as the ``tools`` kind of ``structured_outputs`` (the wire form is ``to_dict``), so
the SDK, the gateway and the engine share one vocabulary and one set of checks. The engine
compiles it into a grammar (``pagedq.worker.engine.grammar_cache``); nothing here imports a
grammar library.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pagedq.errors import InvalidParamsError

# The call formats a spec may name: one module each (mistral.py, hermes.py, llama_json.py),
# gathered in pagedq.tools.FORMATS (most specific first), which checks at import that it holds
# exactly these. Written here so the spec, which the formats read, need not import them back.
FORMAT_NAMES = ("mistral", "mistral_json", "hermes", "llama")

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function names (plus dots)
CHOICES = ("auto", "required")
MAX_TOOLS = 128
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _bad(why: str) -> InvalidParamsError:
    return InvalidParamsError(f"SamplingParams.structured_outputs.tools: {why}")


@dataclass
class ToolSpec:
    """Tools the model may call, OpenAI's shape: ``{"type": "function", "function": {"name",
    "description", "parameters"}}``. ``tool_choice``: "auto" (text or calls), "required" (one
    call or more) or a function's name (exactly one call of it; OpenAI's
    ``{"type": "function", "function": {"name": ...}}`` is accepted too). ``format``: the
    model family's call syntax ("hermes", "llama", "mistral" or "mistral_json", see
    ``pagedq.tools.formats``). ``reasoning``: the model may write one ``<think>...</think>``
    block first, free text, before what the tool choice allows (Qwen3; reasoning.py).
    ``reasoning_open``: the prompt opened that block itself (its tail is ``<think>``,
    ``reasoning.prompt_thinking``), so the output starts inside it and must close it."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    format: str = "hermes"
    reasoning: bool = False
    reasoning_open: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.tool_choice, dict):
            self.tool_choice = named_choice(self.tool_choice)
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.tools, list) or not 1 <= len(self.tools) <= MAX_TOOLS:
            raise _bad(f"tools must be a list of 1 to {MAX_TOOLS} function tools")
        names = [function_name(t, i) for i, t in enumerate(self.tools)]
        for i, t in enumerate(self.tools):
            parameters(t, i)
        if len(set(names)) != len(names):
            raise _bad(f"function names must be unique, got {names}")
        if not isinstance(self.tool_choice, str) or not (
                self.tool_choice in CHOICES or self.tool_choice in names):
            raise _bad(f"tool_choice={self.tool_choice!r} must be 'auto', 'required' or the name "
                       f"of a declared function ({names})")
        if not isinstance(self.parallel_tool_calls, bool):
            raise _bad("parallel_tool_calls must be a bool")
        if not isinstance(self.reasoning, bool):
            raise _bad("reasoning must be a bool")
        if not isinstance(self.reasoning_open, bool):
            raise _bad("reasoning_open must be a bool")
        if self.reasoning_open and not self.reasoning:
            raise _bad("reasoning_open needs reasoning: true")
        if self.format not in FORMAT_NAMES:
            raise _bad(f"format={self.format!r} must be one of {sorted(FORMAT_NAMES)}")

    @property
    def functions(self) -> list[tuple[str, dict[str, Any]]]:
        """(name, parameters schema) of each tool the choice allows, in order."""
        pairs = [(function_name(t, i), parameters(t, i)) for i, t in enumerate(self.tools)]
        if self.forced is not None:
            return [p for p in pairs if p[0] == self.forced]
        return pairs

    @property
    def forced(self) -> str | None:
        """The named function when tool_choice names one."""
        return None if self.tool_choice in CHOICES else str(self.tool_choice)

    def to_dict(self) -> dict[str, Any]:
        out = {"tools": self.tools, "tool_choice": self.tool_choice,
               "parallel_tool_calls": self.parallel_tool_calls, "format": self.format}
        if self.reasoning:  # the default stays off the wire: older workers know no such key
            out["reasoning"] = True
        if self.reasoning_open:
            out["reasoning_open"] = True
        return out

    @classmethod
    def coerce(cls, value: Any) -> ToolSpec:
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise _bad(f"must be a map with tools, tool_choice, parallel_tool_calls, format; got "
                       f"{type(value).__name__}")
        known = {"tools", "tool_choice", "parallel_tool_calls", "format", "reasoning",
                 "reasoning_open"}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise _bad(f"unknown keys {unknown}; valid keys are {sorted(known)}")
        return cls(**value)


def named_choice(choice: dict[str, Any]) -> str:
    """OpenAI's ``{"type": "function", "function": {"name": NAME}}`` -> NAME."""
    fn = choice.get("function")
    if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(
            fn.get("name"), str):
        raise _bad(f"tool_choice {choice!r} must be {{'type': 'function', 'function': "
                   "{'name': NAME}}")
    return fn["name"]


def function_name(tool: Any, i: int) -> str:
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(
            fn, dict):
        raise _bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                   "'parameters': {...}}}")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise _bad(f"tools[{i}].function.name={name!r} must be 1-64 letters, digits, '_', '-' "
                   "or '.'")
    return name


def parameters(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """The function's parameters schema (an object; none given: no arguments)."""
    params = tool["function"].get("parameters")
    if params is None:
        return EMPTY_PARAMETERS
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise _bad(f"tools[{i}].function.parameters must be a JSON Schema of type object")
    return params
