"""Older Mistral tool calls (tokenizers before v11): ``[TOOL_CALLS] [{"name", "arguments"}]``.

Oracles: the model files such a model ships (Mistral 7B v0.3's and Nemo's template text, a
tokenizer with ``[TOOL_CALLS]`` and no ``[ARGS]``), the template itself rendered through
jinja (it raises on an id that is not 9 alphanumerics), parse round trips (the whole text vs.
any split into pieces), xgrammar's matcher on texts in and out of the format, and jsonschema
against each declared function for every call a random-weight model ends under the grammar.
"""

from __future__ import annotations

import json

import pytest
import xgrammar

from pagedq.tools import (
    FORMATS,
    MISTRAL,
    MISTRAL_JSON,
    ModelSigns,
    ToolCallParser,
    ToolSpec,
    choose_format,
    format_for_model,
    parse_tool_calls,
)
from pagedq.tools.prompt import render_chat
from pagedq.worker.engine.grammar_cache import GrammarCache
from tests.engine.structured_cases import load_bundled_tokenizer
from tests.engine.test_tool_calls import ASK, stream_pieces, tools_params
from tests.gateway.test_tools import TOOLS
from tests.tools.random_calls import assert_calls_validate, random_engine
from tests.tools.test_formats import MISTRAL_TEMPLATE

V3_TEMPLATE = (  # Mistral 7B v0.3's tools, calls and results, ids checked as it does
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if tools is not none and loop.first %}[AVAILABLE_TOOLS] [{% for t in tools %}"
    "{{ t | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}][/AVAILABLE_TOOLS]"
    "{%- endif %}[INST] {{ message.content }}[/INST]"
    "{%- elif message.tool_calls is defined and message.tool_calls %}[TOOL_CALLS] ["
    "{%- for tool_call in message.tool_calls %}{%- set out = tool_call.function | tojson %}"
    "{{- out[:-1] }}"
    "{%- if not tool_call.id is defined or tool_call.id | length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}{{- ', \"id\": \"' + tool_call.id + '\"}' }}"
    "{%- if not loop.last %}, {% else %}]</s>{% endif %}{%- endfor %}"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS] {\"content\": {{ message.content | tojson }}"
    ", \"call_id\": \"{{ message.tool_call_id }}\"}[/TOOL_RESULTS]"
    "{%- endif %}{%- endfor %}")
NEMO_CALLS = "{%- if message.tool_calls %}[TOOL_CALLS][{{ message.tool_calls | tojson }}]{% endif %}"


# -- which syntax a Mistral model writes ---------------------------------------------------------
@pytest.mark.parametrize("signs, expected", [
    (ModelSigns(chat_template="{% if tools %}" + V3_TEMPLATE, model_type="mistral"), MISTRAL_JSON),
    (ModelSigns(chat_template="{% if tools %}" + NEMO_CALLS, model_type="mistral"), MISTRAL_JSON),
    (ModelSigns(chat_template=MISTRAL_TEMPLATE, model_type="mistral"), MISTRAL),
    (ModelSigns(special_tokens={"[INST]", "[TOOL_CALLS]"}, model_type="mistral"), MISTRAL_JSON),
    (ModelSigns(special_tokens={"[INST]", "[TOOL_CALLS]", "[ARGS]"}), MISTRAL),
    (ModelSigns(model_type="mistral"), MISTRAL),  # no template, no tokens: the current one
])
def test_the_template_or_the_tokenizer_version_decides(signs, expected):
    assert choose_format(signs, list(FORMATS.values())) is expected


def test_a_pre_v11_model_directory_is_read_as_mistral_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {"5": {"content": "[TOOL_CALLS]", "special": True}}}))
    assert format_for_model(tmp_path) is MISTRAL_JSON
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
        "5": {"content": "[TOOL_CALLS]"}, "32": {"content": "[ARGS]"}}}))
    assert format_for_model(tmp_path) is MISTRAL


# -- text round trips ----------------------------------------------------------------------------
CALLS = ('Checking. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": {"s": "}\\"]"}}}, '
         '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]')


@pytest.mark.parametrize("text", [CALLS, CALLS.replace("[TOOL_CALLS] [", "[TOOL_CALLS][")])
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_calls_parse_whole_and_in_pieces(text, step):
    content, calls = parse_tool_calls(text, MISTRAL_JSON, "req", 0)
    assert content == "Checking. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": {"s": '}"]'}}),
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    shown, args = stream_pieces(ToolCallParser(MISTRAL_JSON, "req", 0), text, step)
    assert shown == content
    assert args == [c.arguments for c in calls]


def test_call_text_round_trips_and_a_cut_list_keeps_its_finished_calls():
    text = MISTRAL_JSON.calls_text([("add", {"a": 2, "b": 2}), ("get_weather", {})])
    assert text == ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 2}}, '
                    '{"name": "get_weather", "arguments": {}}]')
    assert [c.name for c in parse_tool_calls(text, MISTRAL_JSON)[1]] == ["add", "get_weather"]
    _, calls = parse_tool_calls(text[:60], MISTRAL_JSON)  # cut inside the second call
    assert [c.name for c in calls] == ["add"]


# -- templates -----------------------------------------------------------------------------------
class _V3Tokenizer:
    """The bundled tokenizer with Mistral 7B v0.3's template, rendered through jinja."""

    def __init__(self):
        self.tok = load_bundled_tokenizer()
        self.chat_template = "{% if tools %}{% endif %}" + V3_TEMPLATE

    def apply_chat_template(self, messages, **kw):
        return self.tok.apply_chat_template(messages, chat_template=self.chat_template, **kw)


def test_the_v3_template_renders_tools_calls_and_results_itself():
    messages = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0123456789abcdef",
         "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "4"}]
    text = render_chat(_V3Tokenizer(), messages, ToolSpec(tools=TOOLS, format="mistral_json"))
    assert "[AVAILABLE_TOOLS] [" in text and '"get_weather"' in text
    call = text.split("[TOOL_CALLS] [")[1].split("]</s>")[0]
    call_id = json.loads(call)["id"]
    assert len(call_id) == 9 and call_id.isalnum()
    assert f'"call_id": "{call_id}"' in text


def test_a_template_without_tools_is_told_the_list_syntax():
    messages = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}]
    text = render_chat(load_bundled_tokenizer(), messages,
                       ToolSpec(tools=TOOLS, format="mistral_json"))
    assert "[AVAILABLE_TOOLS] [" in text
    assert '[TOOL_CALLS] [{"name": "add", "arguments": {}}]' in text


# -- the grammar -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache():
    tokenizer = load_bundled_tokenizer()
    cache = GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    yield cache
    cache.close()


def matcher(cache, choice: str, **spec):
    so = tools_params(choice, fmt="mistral_json", spec=spec).structured_outputs
    return xgrammar.GrammarMatcher(cache.wait(cache.submit(so)))


ADD = '{"name": "add", "arguments": {"a": 2, "b": 2}}'
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'


def test_required_is_one_list_of_valid_calls(cache):
    m = matcher(cache, "required")
    assert m.accept_string(f"[TOOL_CALLS] [{ADD}, {WEATHER}]")
    assert matcher(cache, "required").accept_string(f"[TOOL_CALLS][{ADD}]")  # Nemo's spacing
    assert not matcher(cache, "required").accept_string("Sure")
    assert not matcher(cache, "required").accept_string("[TOOL_CALLS] []")
    assert not matcher(cache, "required").accept_string(
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": "two"')
    assert not matcher(cache, "required").accept_string('[TOOL_CALLS] [{"name": "divide"')
    one = matcher(cache, "required", parallel_tool_calls=False)
    assert one.accept_string(f"[TOOL_CALLS] [{ADD}") and not one.accept_string(", ")


def test_named_and_auto(cache):
    assert matcher(cache, "add").accept_string(f"[TOOL_CALLS] [{ADD}]")
    assert not matcher(cache, "add").accept_string(f"[TOOL_CALLS] [{WEATHER}")
    m = matcher(cache, "auto")
    assert m.accept_string("Let me look that up. ")
    assert m.accept_string(f"[TOOL_CALLS] [{ADD}, {WEATHER}]")
    m2 = matcher(cache, "auto")
    assert m2.accept_string("Well: [TOOL_CALLS] ")
    assert not m2.accept_string("free text")  # the list has begun: only calls


# -- the engine: a random model's calls validate ----------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return random_engine(tmp_path_factory.mktemp("random-mistral-json"))


def test_random_model_calls_validate_over_seeds(engine):
    assert_calls_validate(engine, "mistral_json", MISTRAL_JSON, closes="]")
