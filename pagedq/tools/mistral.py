"""Mistral calls, in the two syntaxes Mistral's tokenizers have used.

``MISTRAL``: ``[TOOL_CALLS]name[ARGS]{...}``, one marker per call, parallel calls following
each other with nothing between them: current tokenizers (v11 and later: Mistral Small 3.2,
Magistral, Devstral, Ministral), where ``[TOOL_CALLS]`` and ``[ARGS]`` are control tokens.

``MISTRAL_JSON``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``, all of a turn's
calls in one JSON list: the tokenizers before v11 (v3: Mistral 7B v0.3, Mixtral 8x22B;
tekken: Nemo, which writes ``[TOOL_CALLS][`` without the space; v7: Small 3 and 3.1, Large
2411), whose templates render past calls that way and have no ``[ARGS]`` token. Which one a
model writes is read from its template (``[ARGS]`` vs ``[TOOL_CALLS] [``) or, without one,
from its tokenizer's control tokens (an ``[ARGS]`` token means v11+): detect.py.
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
    special_tokens=("[ARGS]",),
    model_types=("mistral", "mistral3", "mixtral", "ministral", "pixtral"),
    id_length=9,
)

MISTRAL_JSON = ToolFormat(
    name="mistral_json",
    trigger="[TOOL_CALLS]",
    begin='{"name": "',
    middle='", "arguments": ',
    end="}",
    separator=", ",
    markers=("[TOOL_CALLS] [", "[TOOL_CALLS]["),
    preamble=(
        "[AVAILABLE_TOOLS] [{tools}][/AVAILABLE_TOOLS]\n\n"
        "To call functions, write [TOOL_CALLS] and a JSON list of the calls, each with the "
        "function's name and its arguments as a JSON object, e.g. "
        "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]."),
    special_tokens=("[TOOL_CALLS]",),
    id_length=9,
    opening=" [",
    closing="]",
)
