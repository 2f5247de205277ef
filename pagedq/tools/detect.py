"""Which tool-call format a model writes: from its chat template, its control tokens and its
architecture, read from the model's directory without loading a tokenizer.

In order: a chat template that renders calls in a format (Mistral v11+ ``[ARGS]``, Qwen's
``<tool_call>``, Llama 3.1+'s JSON); a control token only one family has (``[TOOL_CALLS]``,
``<tool_call>``, ``<|python_tag|>``); the architecture (``model_type`` qwen2/qwen3 -> Hermes,
mistral/mixtral -> Mistral); else Hermes, the documented default (SmolLM2 and the many ChatML
fine-tunes). An operator's override names a format outright.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedq.tools.formats import ToolFormat
from pagedq.tools.hermes import HERMES
from pagedq.tools.reasoning import template_thinks


@dataclass
class ModelSigns:
    """What a model directory says about its tool-call format."""

    chat_template: str = ""
    special_tokens: set[str] = field(default_factory=set)
    model_type: str = ""

    @classmethod
    def read(cls, directory: str | Path) -> ModelSigns:
        """The signs in ``directory``'s tokenizer and config files (missing ones: no sign)."""
        d = Path(directory)
        config = _json(d / "tokenizer_config.json")
        template = config.get("chat_template") or ""
        if isinstance(template, list):  # named templates: [{"name", "template"}, ...]
            template = "\n".join(str(t.get("template", "")) for t in template)
        if (d / "chat_template.jinja").is_file():
            template += (d / "chat_template.jinja").read_text(errors="replace")
        template += str(_json(d / "chat_template.json").get("chat_template") or "")
        tokens = {str(t.get("content", "")) for t in
                  (config.get("added_tokens_decoder") or {}).values() if isinstance(t, dict)}
        tokens |= {str(t.get("content", "")) for t in
                   _json(d / "tokenizer.json").get("added_tokens") or [] if isinstance(t, dict)}
        model_type = str(_json(d / "config.json").get("model_type") or "")
        return cls(template, tokens, model_type)

    @property
    def thinks(self) -> bool:
        """Whether the model writes ``<think>`` reasoning (its template renders it)."""
        return template_thinks(self.chat_template)


def choose_format(signs: ModelSigns, formats: list[ToolFormat]) -> ToolFormat:
    """The format ``signs`` point to, the most specific sign first; Hermes without one."""
    if "tools" in signs.chat_template:
        for fmt in formats:
            if fmt.speaks(signs.chat_template):
                return fmt
    for fmt in formats:
        if any(t in signs.special_tokens for t in fmt.special_tokens):
            return fmt
    for fmt in formats:
        if signs.model_type in fmt.model_types:
            return fmt
    return HERMES


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(errors="replace"))
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
