"""Hermes-style calls: ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``.

The default format: Qwen2.5 and Qwen3 templates, NousResearch Hermes, and the many fine-tunes
of ChatML models (SmolLM2's) use it. Tool results go back as ``role: "tool"`` messages, which
a template without tool support shows wrapped in ``<tool_response>``.
"""

from pagedq.tools.formats import ToolFormat

HERMES = ToolFormat(
    name="hermes",
    trigger="<tool_call>",
    begin='<tool_call>\n{"name": "',
    middle='", "arguments": ',
    end="}\n</tool_call>",
    separator="\n",
    markers=("<tool_call>",),
    preamble=(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        "<tools>\n{tools}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'),
    special_tokens=("<tool_call>",),
    model_types=("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"),
)


def tool_result(content: str) -> str:
    """A tool's result as a template without tool support shows it."""
    return f"<tool_response>\n{content}\n</tool_response>"
