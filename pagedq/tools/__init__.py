"""Tool calling: the tools as a constraint, each model family's call format, and the parser.

``ToolSpec`` rides in ``SamplingParams.structured_outputs`` as its ``tools`` kind; the engine
compiles it to a grammar, so every finished call parses, names a declared function and holds
arguments valid against that function's schema. ``ToolCallParser`` turns the output text back
into calls (streamed or whole). ``format_for_model`` picks the format a model writes
(detect.py). Nothing here imports torch or a grammar library.
"""

from __future__ import annotations

from pathlib import Path

from pagedq.errors import InvalidParamsError
from pagedq.tools.detect import ModelSigns, choose_format
from pagedq.tools.formats import ToolFormat
from pagedq.tools.hermes import HERMES
from pagedq.tools.llama_json import LLAMA
from pagedq.tools.mistral import MISTRAL, MISTRAL_JSON
from pagedq.tools.parse import ToolCall, ToolCallParser, call_id, parse_tool_calls
from pagedq.tools.reasoning import ReasoningSplitter, prompt_thinking, split_reasoning
from pagedq.tools.spec import FORMAT_NAMES, ToolSpec

# Most specific first: a Mistral v11 template holds no <tool_call>, Qwen's no [ARGS]; a v11
# tokenizer has [TOOL_CALLS] too, so MISTRAL (an [ARGS] token) goes before MISTRAL_JSON.
FORMATS: dict[str, ToolFormat] = {f.name: f for f in (MISTRAL, MISTRAL_JSON, HERMES, LLAMA)}
if tuple(FORMATS) != FORMAT_NAMES:
    raise ImportError(f"pagedq.tools: spec.FORMAT_NAMES {FORMAT_NAMES} must name the formats "
                      f"{tuple(FORMATS)}")
AUTO = "auto"


class UnknownToolFormatError(InvalidParamsError):
    """A tool-call format name nobody defines (an override, or a request's ``format``)."""


def get_format(name: str) -> ToolFormat:
    """The format called ``name``; a clear error listing the known ones otherwise."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise UnknownToolFormatError(
            f"unknown tool-call format {name!r}: use one of {sorted(FORMATS)} (or "
            f"{AUTO!r}: the model's own)") from None


def detect_format(chat_template: str | None) -> ToolFormat | None:
    """The family a chat template writes calls in, or None when it does not render tools."""
    if not chat_template or "tools" not in chat_template:
        return None
    return next((f for f in FORMATS.values() if f.speaks(chat_template)), None)


def model_thinks(directory: str | Path | None) -> bool:
    """Whether the model in ``directory`` writes ``<think>`` reasoning before its answer."""
    return directory is not None and ModelSigns.read(directory).thinks


def format_for_model(directory: str | Path | None, override: str = AUTO) -> ToolFormat:
    """The format a model writes calls in: ``override`` unless it is "auto", else what the
    model directory's template, control tokens and architecture say (Hermes without signs)."""
    if override != AUTO:
        return get_format(override)
    if directory is None:
        return HERMES
    return choose_format(ModelSigns.read(directory), list(FORMATS.values()))


__all__ = ["AUTO", "FORMATS", "HERMES", "LLAMA", "MISTRAL", "MISTRAL_JSON", "ModelSigns",
           "ReasoningSplitter", "ToolCall",
           "ToolCallParser", "ToolFormat", "ToolSpec", "UnknownToolFormatError", "call_id",
           "choose_format", "detect_format", "format_for_model", "get_format",
           "model_thinks", "parse_tool_calls", "prompt_thinking", "split_reasoning"]
