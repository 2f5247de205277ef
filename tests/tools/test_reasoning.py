"""Qwen3's ``<think>`` before tool calls: free reasoning, then constrained calls.

Oracles: a Qwen3-style chat template (its tools, calls and ``<think>`` handling, rendered by
jinja), xgrammar's matcher on texts in and out of the grammar, the whole-text split against
any split into stream pieces, jsonschema against each declared function for every call a
random-weight model ends under the grammar (with the template in its directory).
"""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
import xgrammar

from pagedq.client import CompletionResult
from pagedq.gateway.tools import ToolDeltas, chat_choice
from pagedq.gateway.translate import use_tool_format
from pagedq.tools import (
    FORMATS,
    HERMES,
    ModelSigns,
    ReasoningSplitter,
    ToolSpec,
    choose_format,
    model_thinks,
    parse_tool_calls,
    split_reasoning,
)
from pagedq.worker.engine.grammar_cache import GrammarCache
from tests.engine.structured_cases import build_random_model, load_bundled_tokenizer
from tests.engine.test_tool_calls import ASK, tools_params
from tests.gateway.test_tools import SCHEMAS, TOOLS
from tests.gateway.test_tools_requests import spec_of
from tests.tools.test_formats import QWEN_TEMPLATE

QWEN3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n\nYou may call one or more functions.\n\n"
    "<tools>{%- for tool in tools %}\n{{- tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}<|im_start|>user\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}{%- set content = message.content or '' %}"
    "{%- set reasoning_content = '' %}{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "<|im_start|>assistant\n{%- if reasoning_content %}<think>\n{{ reasoning_content }}\n"
    "</think>\n\n{%- endif %}{{ content }}{%- if message.tool_calls %}"
    "{%- for c in message.tool_calls %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}{%- endif %}"
    "<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- endif %}{%- endif %}")

ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
THOUGHT = "<think>\nThe user wants a sum. I could write <tool_call> here, it is only a thought.\n</think>\n\n"


# -- which models think ----------------------------------------------------------------------------
def test_a_qwen3_template_thinks_and_writes_hermes(tmp_path):
    signs = ModelSigns(chat_template=QWEN3_TEMPLATE, model_type="qwen3")
    assert signs.thinks and choose_format(signs, list(FORMATS.values())) is HERMES
    assert not ModelSigns(chat_template=QWEN_TEMPLATE, model_type="qwen2").thinks
    (tmp_path / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    assert model_thinks(tmp_path) and not model_thinks(None)


def test_the_gateway_asks_for_reasoning_on_a_thinking_model():
    spec = spec_of(tools=TOOLS, tool_choice="required")
    use_tool_format(spec, "hermes", reasoning=True)
    assert spec.view.reasoning and spec.params.structured_outputs.tool_spec.reasoning
    plain = spec_of(tools=TOOLS)
    use_tool_format(plain, "hermes")
    assert not plain.view.reasoning
    assert "reasoning" not in plain.params.structured_outputs.tool_spec.to_dict()  # wire
    with pytest.raises(Exception, match="reasoning must be a bool"):
        ToolSpec(tools=TOOLS, reasoning="yes")


# -- the split -------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, thought, rest", [
    (THOUGHT + ADD, THOUGHT[7:-10], ADD),
    ("Sure: " + ADD, None, "Sure: " + ADD),
    ("<think>\ncut short", "\ncut short", ""),
    ("\n<think>x</think>\n\nHello", "x", "Hello"),
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_reasoning_splits_whole_and_in_pieces(text, thought, rest, step):
    assert split_reasoning(text) == (thought, rest)
    splitter, got_thought, got_rest = ReasoningSplitter(), "", ""
    for i in range(0, len(text), step):
        a, b = splitter.feed(text[i:i + step])
        got_thought, got_rest = got_thought + a, got_rest + b
    a, b = splitter.finish()
    assert (got_thought + a, got_rest + b) == (thought or "", rest)


def test_the_answer_reports_reasoning_content_and_never_a_call_inside_it():
    out = CompletionResult(0, text=THOUGHT + ADD, finish_reason="stop")
    choice = chat_choice("hermes", "req", 0, out, "stop", None, reasoning=True)
    msg = choice["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == THOUGHT[7:-10]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["add"]
    assert msg["content"] is None and choice["finish_reason"] == "tool_calls"
    deltas, text = ToolDeltas("hermes", "req", 0, reasoning=True), THOUGHT + ADD
    reasoning, names, args = "", [], ""
    for i in range(0, len(text), 4):
        d = deltas.delta(text[i:i + 4], i + 4 >= len(text))
        reasoning += d.get("reasoning_content", "")
        assert "content" not in d
        for call in d.get("tool_calls", []):
            names += [call["function"]["name"]] if "name" in call["function"] else []
            args += call["function"]["arguments"]
    assert reasoning == msg["reasoning_content"] and names == ["add"]
    assert json.loads(args) == {"a": 2, "b": 2}


# -- the grammar -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache():
    tokenizer = load_bundled_tokenizer()
    cache = GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    yield cache
    cache.close()


def matcher(cache, choice: str):
    so = tools_params(choice, spec={"reasoning": True}).structured_outputs
    return xgrammar.GrammarMatcher(cache.wait(cache.submit(so)))


@pytest.mark.parametrize("choice", ["required", "add", "auto"])
def test_thinking_is_free_then_the_choice_holds(cache, choice):
    assert matcher(cache, choice).accept_string(THOUGHT + ADD)
    assert matcher(cache, choice).accept_string(ADD)  # thinking is optional
    bad = THOUGHT + '<tool_call>\n{"name": "add", "arguments": {"a": "two"'
    assert not matcher(cache, choice).accept_string(bad)
    if choice != "auto":
        assert not matcher(cache, choice).accept_string(THOUGHT + "Four.")
    else:
        assert matcher(cache, choice).accept_string(THOUGHT + "Four.")


# -- the engine: a random model with a Qwen3-style template ------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from pagedq.worker import Engine

    path = build_random_model(tmp_path_factory.mktemp("random-qwen3"))
    for name in ("chat_template.jinja", "chat_template.json"):
        (path / name).unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN3_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert model_thinks(path)
    yield Engine(str(path), num_kv_blocks=1024, block_size=4)
    shutil.rmtree(path, ignore_errors=True)


def test_random_model_thinks_or_calls_and_every_ended_call_validates(engine):
    plist = [tools_params(c, seed=s, max_tokens=120, spec={"reasoning": True})
             for c in ("required", "add") for s in range(6)]
    outs = engine.chat([ASK] * len(plist), plist)
    thought = ended = 0
    for out in outs:
        o = out.outputs[0]
        reasoning, rest = split_reasoning(o.text)
        thought += reasoning is not None
        if o.finish_reason != "stop":
            continue
        ended += 1
        content, calls = parse_tool_calls(rest, HERMES)
        assert calls and not content.strip()
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert ended >= 3 and thought >= 1  # both branches of the grammar were taken
