"""Tool-call formats: which one a model writes, the Mistral format end to end, the override.

Oracles: the model files a real model ships (chat templates and control tokens written the way
Qwen2.5, Llama 3.1 and Mistral's v11 tokenizers write them), parse round trips (a call's text
as the format writes it, parsed back whole and in pieces), jsonschema against each declared
function for every call a random-weight model ends under the grammar, and the chat template
itself for the Mistral id rule (jinja raises on an id that is not 9 alphanumerics).
"""

from __future__ import annotations

import json
import typing

import pytest

from pagedq.tools import (
    FORMATS,
    HERMES,
    LLAMA,
    MISTRAL,
    ModelSigns,
    ToolCallParser,
    ToolSpec,
    UnknownToolFormatError,
    choose_format,
    format_for_model,
    get_format,
    parse_tool_calls,
)
from pagedq.tools.prompt import render_chat
from pagedq.worker.config import GatewayConfig
from tests.engine.structured_cases import load_bundled_tokenizer
from tests.engine.test_tool_calls import ASK, stream_pieces
from tests.gateway.test_tools import TOOLS
from tests.tools.random_calls import assert_calls_validate, random_engine

QWEN_TEMPLATE = (  # the tool part of Qwen2.5's template
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}{{ tool | tojson }}"
    "{% endfor %}</tools>\nFor each function call, return a json object within <tool_call>"
    "</tool_call> XML tags{% endif %}")
LLAMA_TEMPLATE = (  # the tool part of Llama 3.1's
    "{%- if tools is not none %}Given the following functions, respond with a JSON for a "
    'function call. Respond in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}.{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
    "{%- if message.tool_calls %}<|python_tag|>{% endif %}")
MISTRAL_TEMPLATE = (  # Mistral Small 3.2's calls and results, ids checked as its template does
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{%- for c in message.tool_calls %}"
    "{%- if c.id is not defined or c.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}[TOOL_CALLS]{{ c.function.name }}[CALL_ID]{{ c.id }}[ARGS]"
    "{{ c.function.arguments | tojson }}{%- endfor %}</s>"
    "{%- elif message.role == 'tool' %}"
    "{%- if message.tool_call_id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}[TOOL_RESULTS]{{ message.tool_call_id }}[TOOL_CONTENT]{{ message.content }}"
    "[/TOOL_RESULTS]{%- endif %}{%- endfor %}")


# -- which format a model writes ---------------------------------------------------------------
@pytest.mark.parametrize("signs, expected", [
    (ModelSigns(chat_template=QWEN_TEMPLATE, model_type="qwen2"), HERMES),
    (ModelSigns(chat_template=LLAMA_TEMPLATE, model_type="llama"), LLAMA),
    (ModelSigns(chat_template=MISTRAL_TEMPLATE, model_type="mistral"), MISTRAL),
    (ModelSigns(special_tokens={"[INST]", "[TOOL_CALLS]", "[ARGS]"}, model_type="mistral"),
     MISTRAL),  # a v11+ tokenizer; without [ARGS] it is older (test_mistral_json.py)
    (ModelSigns(special_tokens={"<|eot_id|>", "<|python_tag|>"}, model_type="llama"), LLAMA),
    (ModelSigns(special_tokens={"<tool_call>", "</tool_call>"}), HERMES),
    (ModelSigns(model_type="qwen3"), HERMES),
    (ModelSigns(model_type="mixtral"), MISTRAL),
    (ModelSigns(model_type="llama"), HERMES),  # SmolLM2 is a Llama with a ChatML template
    (ModelSigns(), HERMES),
])
def test_the_format_follows_the_models_signs(signs, expected):
    assert choose_format(signs, list(FORMATS.values())) is expected


def test_signs_are_read_from_a_model_directory(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{{ messages }}",
        "added_tokens_decoder": {"5": {"content": "[TOOL_CALLS]", "special": True},
                                 "6": {"content": "[ARGS]", "special": True}}}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    signs = ModelSigns.read(tmp_path)
    assert signs.special_tokens == {"[TOOL_CALLS]", "[ARGS]"} and signs.model_type == "mistral"
    assert format_for_model(tmp_path) is MISTRAL
    (tmp_path / "chat_template.jinja").write_text(QWEN_TEMPLATE)  # newer HF keeps it apart
    assert format_for_model(tmp_path) is HERMES
    assert format_for_model(tmp_path, "llama") is LLAMA  # the override wins
    assert format_for_model(tmp_path / "absent") is HERMES  # an unreadable directory


def test_the_bundled_model_writes_hermes():
    tok = load_bundled_tokenizer()
    assert format_for_model(tok.name_or_path) is HERMES


def test_an_unknown_format_name_is_a_clear_error():
    with pytest.raises(UnknownToolFormatError,
                       match=r"'qwen'.*\['hermes', 'llama', 'mistral', 'mistral_json'\]"):
        get_format("qwen")
    with pytest.raises(UnknownToolFormatError):
        format_for_model(None, "qwen")
    flag = typing.get_type_hints(GatewayConfig)["tool_call_format"]
    assert set(typing.get_args(flag)) == {"auto", *FORMATS}  # the flag offers every format


# -- Mistral: text round trips -------------------------------------------------------------------
MISTRAL_CALLS = ('I will check. [TOOL_CALLS]add[ARGS]{"a": 1, "b": {"s": "}\\"[ARGS]"}}'
                 '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}')


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_mistral_calls_parse_whole_and_in_pieces(step):
    content, calls = parse_tool_calls(MISTRAL_CALLS, MISTRAL, "req", 0)
    assert content == "I will check. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": {"s": '}"[ARGS]'}}),
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    text, args = stream_pieces(ToolCallParser(MISTRAL, "req", 0), MISTRAL_CALLS, step)
    assert text == content
    assert args == [c.arguments for c in calls]


def test_mistral_call_text_round_trips():
    text = MISTRAL.call_text("place_order", {"express": True, "items": [{"sku": "ABC"}]})
    assert text == '[TOOL_CALLS]place_order[ARGS]{"express": true, "items": [{"sku": "ABC"}]}'
    _, (call,) = parse_tool_calls(text, MISTRAL)
    assert call.name == "place_order" and json.loads(call.arguments)["items"] == [{"sku": "ABC"}]


class _MistralTokenizer:
    """The bundled tokenizer with Mistral's template: renders through jinja as HF does."""

    def __init__(self):
        self.tok = load_bundled_tokenizer()
        self.chat_template = MISTRAL_TEMPLATE

    def apply_chat_template(self, messages, **kw):
        return self.tok.apply_chat_template(messages, chat_template=MISTRAL_TEMPLATE, **kw)


def test_a_mistral_template_gets_its_nine_character_ids_and_results_pair_up():
    messages = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0123456789abcdef",
         "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "4"}]
    text = render_chat(_MistralTokenizer(), messages, ToolSpec(tools=TOOLS, format="mistral"))
    assert "[AVAILABLE_TOOLS]" in text and '"get_weather"' in text
    call_id = text.split("[CALL_ID]")[1].split("[ARGS]")[0]
    assert len(call_id) == 9 and call_id.isalnum()
    assert f"[TOOL_RESULTS]{call_id}[TOOL_CONTENT]4" in text
    assert '[ARGS]{"a": 2, "b": 2}' in text


def test_a_template_without_tools_is_told_the_mistral_syntax():
    text = render_chat(load_bundled_tokenizer(), ASK, ToolSpec(tools=TOOLS, format="mistral"))
    assert "[AVAILABLE_TOOLS]" in text and "[TOOL_CALLS]get_weather[ARGS]" in text


# -- Mistral: the grammar holds a random model's calls ----------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return random_engine(tmp_path_factory.mktemp("random-mistral"))


def test_random_model_mistral_calls_validate_over_seeds(engine):
    assert_calls_validate(engine, "mistral", MISTRAL)
