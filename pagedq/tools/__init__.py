"""Tool calling: the tools as a constraint, each model family's call format, and the parser.

``ToolSpec`` rides in ``SamplingParams.structured_outputs`` as its ``tools`` kind; the engine
compiles it to a grammar, so every finished call parses, names a declared function and holds
arguments valid against that function's schema. ``ToolCallParser`` turns the output text back
into calls (streamed or whole). Nothing here imports torch or a grammar library.
"""

from pagedq.tools.formats import ToolFormat
from pagedq.tools.hermes import HERMES
from pagedq.tools.llama_json import LLAMA
from pagedq.tools.parse import ToolCall, ToolCallParser, call_id, parse_tool_calls
from pagedq.tools.spec import FORMAT_NAMES, ToolSpec

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, LLAMA)}
if tuple(FORMATS) != FORMAT_NAMES:
    raise ImportError(f"pagedq.tools: spec.FORMAT_NAMES {FORMAT_NAMES} must name the formats "
                      f"{tuple(FORMATS)}")


def get_format(name: str) -> ToolFormat:
    return FORMATS[name]


def detect_format(chat_template: str | None) -> ToolFormat | None:
    """The family a chat template writes calls in, or None when it does not render tools."""
    if not chat_template or "tools" not in chat_template:
        return None
    return next((f for f in FORMATS.values() if f.speaks(chat_template)), None)


__all__ = ["FORMATS", "HERMES", "LLAMA", "ToolCall", "ToolCallParser", "ToolFormat", "ToolSpec",
           "call_id", "detect_format", "get_format", "parse_tool_calls"]
