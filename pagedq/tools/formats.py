"""Tool-call formats: how a model family writes a call, as the grammar and as text.

Every supported family writes a call as ``BEGIN name MIDDLE {arguments} END``, so one
``ToolFormat`` holds the four strings (a family that writes its calls as one list, older
Mistral's ``[TOOL_CALLS] [{...}, {...}]``, also has the list's ``opening`` and ``closing``)
and builds the three things the rest needs from them:
xgrammar's structural tag (the constraint), the call's text (a past call in a conversation),
and the system prompt that lists the tools for a chat template that can not (SmolLM2's). The
families are one module each (hermes.py, llama_json.py, mistral.py); ``speaks`` says whether
a chat template renders calls in the format, so such a template is used as it is, and
detect.py picks a model's format from its template, control tokens and architecture.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedq.tools.reasoning import think_tag
from pagedq.tools.spec import ToolSpec


@dataclass(frozen=True)
class ToolFormat:
    name: str
    trigger: str  # the text that opens a call: free text ends here under tool_choice "auto"
    begin: str  # before the function's name
    middle: str  # between the name and the arguments object
    end: str  # after the arguments object
    separator: str  # between two calls
    markers: tuple[str, ...]  # text in a chat template that says it speaks this format
    preamble: str  # the system prompt's text before the tools, "{tools}" where they go
    special_tokens: tuple[str, ...] = ()  # control tokens only a model of this family has
    model_types: tuple[str, ...] = ()  # config.json model_type values of this family
    id_length: int | None = None  # call ids the family's templates insist on (alphanumeric)
    # a list format: after the trigger, ``opening`` (leading whitespace optional), the calls
    # with ``separator`` between them, then ``closing``; "" for one marker per call
    opening: str = ""
    closing: str = ""

    @property
    def is_list(self) -> bool:
        return bool(self.closing)

    def call_text(self, name: str, arguments: dict[str, Any] | str) -> str:
        args = arguments if isinstance(arguments, str) else json.dumps(arguments)
        return f"{self.begin}{name}{self.middle}{args}{self.end}"

    def calls_text(self, calls: list[tuple[str, dict[str, Any] | str]]) -> str:
        """Several calls as the model writes them in one turn."""
        body = self.separator.join(self.call_text(name, args) for name, args in calls)
        if self.is_list:
            return f"{self.trigger}{self.opening}{body}{self.closing}"
        return body

    def structural_tag(self, spec: ToolSpec, contents: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """xgrammar's structural tag for ``spec``; ``contents[name]`` constrains that
        function's arguments object (an xgrammar format, e.g. ``{"type": "grammar", ...}``).
        With ``spec.reasoning`` an optional free ``<think>`` block comes first (with
        ``spec.reasoning_open`` the output starts inside it, and must close it)."""
        tag = self._calls_tag(spec, contents)
        if spec.reasoning:
            tag = {"type": "structural_tag",
                   "format": think_tag(tag["format"], spec.reasoning_open)}
        return tag

    def _calls_tag(self, spec: ToolSpec, contents: dict[str, dict[str, Any]]) -> dict[str, Any]:
        tags = [{"type": "tag", "begin": f"{self.begin}{name}{self.middle}",
                 "content": contents[name], "end": self.end} for name, _ in spec.functions]
        if self.is_list:
            return {"type": "structural_tag", "format": self._list_tag(spec, tags)}
        if spec.forced is not None:
            fmt: dict[str, Any] = tags[0]
        elif spec.tool_choice == "required":
            fmt = {"type": "tags_with_separator", "tags": tags, "separator": self.separator,
                   "at_least_one": True, "stop_after_first": not spec.parallel_tool_calls}
        else:
            fmt = {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags,
                   "at_least_one": False, "stop_after_first": not spec.parallel_tool_calls}
        return {"type": "structural_tag", "format": fmt}

    def _list_tag(self, spec: ToolSpec, tags: list[dict[str, Any]]) -> dict[str, Any]:
        """One list of calls after the trigger: ``opening`` (with or without its leading
        whitespace: Mistral v3 writes ``[TOOL_CALLS] [``, Nemo's tekken ``[TOOL_CALLS][``), the
        calls, ``closing``. Under "auto" text may come first; the list, once begun, is the
        whole rest of the output (all parallel calls sit in it)."""
        calls: dict[str, Any] = tags[0] if spec.forced is not None else {
            "type": "tags_with_separator", "tags": tags, "separator": self.separator,
            "at_least_one": True, "stop_after_first": not spec.parallel_tool_calls}
        openings = sorted({self.opening, self.opening.lstrip()})
        body = {"type": "sequence", "elements": [
            {"type": "or", "elements": [{"type": "const_string", "value": o} for o in openings]},
            calls]}
        if spec.forced is None and spec.tool_choice != "required":
            return {"type": "triggered_tags", "triggers": [self.trigger], "tags": [
                {"type": "tag", "begin": self.trigger, "content": body, "end": self.closing}],
                "at_least_one": False, "stop_after_first": True}
        return {"type": "sequence", "elements": [
            {"type": "const_string", "value": self.trigger}, body,
            {"type": "const_string", "value": self.closing}]}

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        listed = "\n".join(json.dumps(t["function"] if "function" in t else t) for t in tools)
        return self.preamble.replace("{tools}", listed)

    def speaks(self, template: str) -> bool:
        return any(m in template for m in self.markers)
