"""Where the prompt leaves the reasoning: templates that open ``<think>`` themselves, and
``chat_template_kwargs`` (Qwen3's ``enable_thinking``) at the render.

Oracles: a Qwen3-style template rendered by jinja (its generation prompt's tail, read as text),
xgrammar's matcher on texts in and out of the grammar, the whole-text split against any split
into stream pieces, jsonschema for every call a random-weight Qwen3 (tests/tiny_models.py,
with the bundled tokenizer) ends under the grammar.
"""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
import xgrammar

from pagedq.client import CompletionResult
from pagedq.errors import InvalidRequestError
from pagedq.gateway.tools import ToolDeltas, chat_choice
from pagedq.gateway.translate import use_tool_format
from pagedq.tools import HERMES, ToolSpec, parse_tool_calls, prompt_thinking, split_reasoning
from pagedq.tools.prompt import check_template_kwargs, render_chat
from pagedq.tools.reasoning import CLOSED, FREE, OPEN, ReasoningSplitter
from pagedq.worker.engine.grammar_cache import GrammarCache
from tests.engine.structured_cases import load_bundled_tokenizer
from tests.engine.test_tool_calls import ASK, tools_params
from tests.gateway.test_tools import SCHEMAS, TOOLS
from tests.gateway.test_tools_requests import spec_of
from tests.tools.test_reasoning import ADD, QWEN3_TEMPLATE

# Qwen3 thinking-2507 / QwQ style: the generation prompt opens the block; Qwen3's
# enable_thinking=false closes an empty one instead (both switches in one template)
OPENING_TEMPLATE = QWEN3_TEMPLATE.replace(
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- endif %}",
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{% endif %}")
THINKING = "The user wants a sum; <tool_call> here is only a thought.\n"


@pytest.fixture(scope="module")
def tokenizer():
    return load_bundled_tokenizer()


def templated(tokenizer, template: str):
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.chat_template = template
    return tok


# -- the render --------------------------------------------------------------------------------
def test_the_prompt_tail_says_where_reasoning_starts(tokenizer):
    opening, hybrid = templated(tokenizer, OPENING_TEMPLATE), templated(tokenizer, QWEN3_TEMPLATE)
    spec = ToolSpec(tools=TOOLS)
    text = render_chat(opening, ASK, spec)
    assert text.endswith("assistant<think>\n") and prompt_thinking(text) == OPEN
    off = render_chat(opening, ASK, spec, {"enable_thinking": False})
    assert off.endswith("assistant<think>\n\n</think>") and prompt_thinking(off) == CLOSED
    assert prompt_thinking(render_chat(hybrid, ASK, spec)) == FREE
    assert prompt_thinking(render_chat(hybrid, ASK, None, {"enable_thinking": False})) == CLOSED
    assert render_chat(hybrid, ASK, None, {"enable_thinking": True}) == render_chat(
        hybrid, ASK, None)


@pytest.mark.parametrize("bad, says", [
    ("yes", "must be a map"), ([1], "must be a map"), ({"1x": 1}, "identifiers"),
    ({"tools": []}, "may not set 'tools'"), ({"add_generation_prompt": False}, "may not set"),
    ({f"k{i}": 1 for i in range(33)}, "over the limit of 32"),
    ({"big": "x" * 9000}, "over the limit of 8192"), ({"f": float("nan")}, "must be JSON"),
    ({"o": object()}, "must be JSON")])
def test_bad_template_kwargs_are_refused_with_what_to_change(tokenizer, bad, says):
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs.*" + says.split()[0]):
        check_template_kwargs(bad)
    with pytest.raises(InvalidRequestError, match=says.split()[-1]):
        render_chat(templated(tokenizer, QWEN3_TEMPLATE), ASK, None, bad)


# -- the split and the answer -------------------------------------------------------------------
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_an_opened_block_splits_whole_and_in_pieces(step):
    text = THINKING + "</think>\n\n" + ADD
    assert split_reasoning(text, opened=True) == (THINKING, ADD)
    assert split_reasoning(text) == (None, text)  # unopened: the same text is all answer
    splitter, thought, rest = ReasoningSplitter.after(True), "", ""
    for i in range(0, len(text), step):
        a, b = splitter.feed(text[i:i + step])
        thought, rest = thought + a, rest + b
    a, b = splitter.finish()
    assert (thought + a, rest + b) == (THINKING, ADD)
    assert split_reasoning("cut short", opened=True) == ("cut short", "")


def test_calls_after_the_close_are_calls_and_the_thought_is_reasoning_content():
    text = THINKING + "</think>\n\n" + ADD
    out = CompletionResult(0, text=text, finish_reason="stop")
    msg = chat_choice("hermes", "r", 0, out, "stop", None, reasoning=True, opened=True)["message"]
    assert msg["reasoning_content"] == THINKING and msg["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg["tool_calls"]] == [("add", {"a": 2, "b": 2})]
    deltas, reasoning, args = ToolDeltas("hermes", "r", 0, reasoning=True, opened=True), "", ""
    for i in range(0, len(text), 5):
        d = deltas.delta(text[i:i + 5], i + 5 >= len(text))
        assert "content" not in d
        reasoning += d.get("reasoning_content", "")
        args += "".join(c["function"]["arguments"] for c in d.get("tool_calls", []))
    assert reasoning == THINKING and json.loads(args) == {"a": 2, "b": 2}


@pytest.mark.parametrize("thinking, reasoning, opened", [
    (FREE, True, False), (OPEN, True, True), (CLOSED, False, False)])
def test_the_gateway_fits_the_spec_and_view_to_the_prompt(thinking, reasoning, opened):
    spec = spec_of(tools=TOOLS, tool_choice="required")
    use_tool_format(spec, "hermes", True)
    use_tool_format(spec, "hermes", True, thinking)  # again, once the prompt is rendered
    tool_spec = spec.params.structured_outputs.tool_spec
    assert (spec.view.reasoning, spec.view.reasoning_open) == (reasoning, opened)
    assert (tool_spec.reasoning, tool_spec.reasoning_open) == (reasoning, opened)
    with pytest.raises(Exception, match="reasoning_open needs reasoning"):
        ToolSpec(tools=TOOLS, reasoning_open=True)


# -- the grammar -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache(tokenizer):
    cache = GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    yield cache
    cache.close()


def ends(cache, tokenizer, choice: str, text: str) -> bool:
    """Whether the opened grammar accepts ``text`` as a whole output (then EOS)."""
    so = tools_params(choice, spec={"reasoning": True, "reasoning_open": True}).structured_outputs
    m = xgrammar.GrammarMatcher(cache.wait(cache.submit(so)))
    return m.accept_string(text) and m.accept_token(tokenizer.eos_token_id)


@pytest.mark.parametrize("choice", ["required", "add", "auto"])
def test_an_opened_grammar_thinks_first_then_the_choice_holds(cache, tokenizer, choice):
    assert ends(cache, tokenizer, choice, THINKING + "</think>\n\n" + ADD)
    assert ends(cache, tokenizer, choice, "</think>\n\n" + ADD)  # an empty thought
    assert not ends(cache, tokenizer, choice, ADD)  # still thinking: the block must close
    bad = THINKING + '</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": "two"'
    so = tools_params(choice, spec={"reasoning": True, "reasoning_open": True}).structured_outputs
    assert not xgrammar.GrammarMatcher(cache.wait(cache.submit(so))).accept_string(bad)
    assert ends(cache, tokenizer, choice, THINKING + "</think>\n\nFour.") == (choice == "auto")


# -- the engine: a random Qwen3 with the opening template --------------------------------------
def opening_qwen3(folder, tokenizer):
    """A random Qwen3 in ``folder`` with the bundled tokenizer and OPENING_TEMPLATE."""
    from pagedq.worker.models.loader import resolve_model
    from tests.tiny_models import build_tiny_model

    path = build_tiny_model("qwen3", folder, vocab_size=len(tokenizer),
                            eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=tokenizer.bos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    shutil.copy(resolve_model(None) / "tokenizer.json", path / "tokenizer.json")
    config = json.loads((resolve_model(None) / "tokenizer_config.json").read_text())
    config["chat_template"] = OPENING_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tokenizer):
    from pagedq.worker import Engine

    path = opening_qwen3(tmp_path_factory.mktemp("random-qwen3-open"), tokenizer)
    yield Engine(str(path), num_kv_blocks=1024, block_size=4)
    shutil.rmtree(path, ignore_errors=True)


def test_the_engine_reads_the_prompt_tail_into_the_grammar(engine):
    opened = engine.add_request("open", engine.apply_chat_template(ASK, tools_params()),
                                tools_params(spec={"reasoning": True}))
    closed = engine.add_request("closed", engine.apply_chat_template(
        ASK, tools_params(), {"enable_thinking": False}), tools_params(spec={"reasoning": True}))
    assert opened.params.structured_outputs.tool_spec.reasoning_open
    assert not closed.params.structured_outputs.tool_spec.reasoning
    for rid in ("open", "closed"):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def test_an_opened_prompt_keeps_the_output_in_the_reasoning(engine):
    outs = engine.chat([ASK] * 4, [tools_params("required", seed=s, max_tokens=24,
                                                spec={"reasoning": True}) for s in range(4)])
    for out in outs:
        text = out.outputs[0].text
        reasoning, rest = split_reasoning(text, opened=True)
        assert "</think>" in text or (reasoning, rest) == (text, "")


def test_thinking_off_every_ended_call_validates(engine):
    plist = [tools_params(c, seed=s, max_tokens=120, spec={"reasoning": True})
             for c in ("required", "add") for s in range(4)]
    outs = engine.chat([ASK] * len(plist), plist, chat_template_kwargs={"enable_thinking": False})
    ended = 0
    for out in outs:
        o = out.outputs[0]
        if o.finish_reason != "stop":
            continue
        ended += 1
        assert split_reasoning(o.text)[0] is None  # the grammar opened no block
        content, calls = parse_tool_calls(o.text, HERMES)
        assert calls and not content.strip()
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert ended >= 3
