"""Llama 3.1+ calls: ``{"name": ..., "parameters": {...}}`` as the whole reply.

Meta's JSON-based tool calling (Llama 3.1, 3.2, 3.3 instruct templates): the call is a bare
JSON object, ``parameters`` holding the arguments; parallel calls are separated by ``; ``.
"""

from pagedq.tools.formats import ToolFormat

LLAMA = ToolFormat(
    name="llama",
    trigger='{"name": ',
    begin='{"name": "',
    middle='", "parameters": ',
    end="}",
    separator="; ",
    markers=('"parameters": ', "<|python_tag|>"),
    preamble=(
        "Given the following functions, please respond with a JSON for a function call with its "
        "proper arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument '
        "name and its value}. Do not use variables.\n\n{tools}"),
    special_tokens=("<|python_tag|>",),  # Llama 3.1+ (3.0 has no tool calling)
)
