"""Mistral calls: ``[TOOL_CALLS]name[ARGS]{...}``, one marker per call.

The syntax of Mistral's current tokenizers (v11 and later: Mistral Small 3.2, Magistral,
Devstral, Ministral), where ``[TOOL_CALLS]`` and ``[ARGS]`` are control tokens. Parallel calls
follow each other with nothing between them. Older Mistral templates (7B v0.3, Nemo) wrote a
JSON list after ``[TOOL_CALLS]`` instead; for those the tools and this syntax are folded into
the system prompt (prompt.py), as for any template that does not speak the format.
"""

from pagedq.tools.formats import ToolFormat

MISTRAL = ToolFormat(
    name="mistral",
    trigger="[TOOL_CALLS]",
    begin="[TOOL_CALLS]",
    middle="[ARGS]",
    end="",
    separator="",
    markers=("[ARGS]",),
    preamble=(
        "[AVAILABLE_TOOLS]{tools}[/AVAILABLE_TOOLS]\n\n"
        "To call a function, write [TOOL_CALLS], the function's name, [ARGS] and its arguments "
        "as a JSON object, e.g. [TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}."),
    special_tokens=("[TOOL_CALLS]",),
    model_types=("mistral", "mistral3", "mixtral", "ministral", "pixtral"),
    id_length=9,
)
