"""Tool calls in the engine: the ``tools`` constraint through the SDK route, valid every time.

The oracle for every finished call is jsonschema against the declared function's parameters;
the parser is checked against a plain reference (the whole text at once vs. any split into
pieces). The random-weight model with the bundled tokenizer picks garbage at temperature 1.0,
so only the grammar can make its calls valid; the bundled SmolLM2 answers real questions.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar

from pagedq.errors import InvalidParamsError
from pagedq.params import SamplingParams
from pagedq.tools import HERMES, LLAMA, ToolCallParser, ToolSpec, parse_tool_calls
from pagedq.worker import Engine
from pagedq.worker.engine.grammar_cache import GrammarCache
from pagedq.worker.engine.number_bounds import bound_numbers
from tests.engine.structured_cases import build_random_model, load_bundled_tokenizer
from tests.gateway.test_tools import ORDER, SCHEMAS, TOOLS

ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 2?"}]


def tools_params(choice="required", seed=0, fmt="hermes", tools=TOOLS, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 200)
    return SamplingParams(temperature=1.0, seed=seed, structured_outputs={"tools": {
        "tools": tools, "tool_choice": choice, "format": fmt, **kw.pop("spec", {})}}, **kw)


def valid_calls(text: str, fmt=HERMES) -> list[str]:
    """The names of ``text``'s calls, each checked against its schema (raises if invalid)."""
    content, calls = parse_tool_calls(text, fmt)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return [c.name for c in calls]


# -- the parser ------------------------------------------------------------------------------
CALLS = ('Sure. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"s": "}\\"<"}}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')


def stream_pieces(parser: ToolCallParser, text: str, step: int) -> tuple[str, list[str]]:
    """``text`` fed to ``parser`` ``step`` characters at a time, as a stream arrives: the
    content it let through and each call's argument fragments joined, in call order."""
    content, args = "", {}
    for i in range(0, len(text), step):
        piece, deltas = parser.feed(text[i:i + step])
        content += piece
        for d in deltas:
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    return content + parser.finish(), [args[i] for i in sorted(args)]


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streamed_pieces_give_the_whole_texts_calls(step):
    content, args = stream_pieces(ToolCallParser(HERMES, "r"), CALLS, step)
    whole_content, calls = parse_tool_calls(CALLS, HERMES, "r")
    assert content == whole_content == "Sure. "
    assert [c.arguments for c in calls] == args
    assert [c.name for c in calls] == ["add", "get_weather"]
    assert json.loads(calls[0].arguments) == {"a": 1, "b": {"s": '}"<'}}


def test_a_call_cut_short_stays_text_and_llama_calls_parse():
    assert parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1', HERMES)[1] == []
    content, calls = parse_tool_calls('{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                                      '{"name": "add", "parameters": {"a": 3, "b": 4}}', LLAMA)
    assert content == "" and [json.loads(c.arguments)["a"] for c in calls] == [1, 3]


@pytest.mark.parametrize("spec, problem", [
    ({"tools": []}, "1 to 128"),
    ({"tools": TOOLS, "tool_choice": "nope"}, "tool_choice"),
    ({"tools": TOOLS + TOOLS}, "unique"),
    ({"tools": TOOLS, "format": "qwen"}, "format"),
])
def test_bad_tool_specs_say_what_is_wrong(spec, problem):
    with pytest.raises(InvalidParamsError, match=problem):
        SamplingParams(structured_outputs={"tools": spec})


# -- the grammar -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cache():
    tokenizer = load_bundled_tokenizer()
    cache = GrammarCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    yield cache
    cache.close()


def matcher(cache, choice: str):
    so = tools_params(choice).structured_outputs
    return xgrammar.GrammarMatcher(cache.wait(cache.submit(so)))


def test_auto_is_free_text_until_the_marker_then_only_the_format(cache):
    m = matcher(cache, "auto")
    assert m.accept_string("Let me look that up: ")
    assert m.accept_string("<tool_call>\n")
    m2 = matcher(cache, "auto")
    assert m2.accept_string("Let me look that up: <tool_call>\n")
    assert not m2.accept_string("free text")  # the call has begun: only its format
    assert m.accept_string('{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>')
    assert m.accept_string(" Done.")  # after the call, text again


def test_required_starts_with_a_call_and_arguments_follow_the_schema(cache):
    m = matcher(cache, "required")
    assert not m.accept_string("Sure")
    assert not matcher(cache, "required").accept_string(
        '<tool_call>\n{"name": "add", "arguments": {"a": "two"')
    assert not matcher(cache, "required").accept_string(
        '<tool_call>\n{"name": "divide", "arguments": {')
    assert matcher(cache, "required").accept_string(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        '\n</tool_call>')


def test_argument_numbers_are_bounded():
    text = str(xgrammar.Grammar.from_json_schema(json.dumps(SCHEMAS["add"]),
                                                 any_whitespace=False))
    assert "{1, -1}" in text and "{1, -1}" not in bound_numbers(text)


# -- the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_random_model(tmp_path_factory.mktemp("random-tool-calls"))
    return Engine(str(path), num_kv_blocks=1024, block_size=4)


@pytest.mark.parametrize("choice", ["required", "add", "auto"])
def test_random_model_calls_validate_over_seeds(engine, choice):
    plist = [tools_params(choice, seed=s) for s in range(6)]
    finished = 0
    for out in engine.chat([ASK] * len(plist), plist):
        o = out.outputs[0]
        if o.finish_reason != "stop":
            continue
        finished += 1
        names = valid_calls(o.text)
        if choice == "add":
            assert names == ["add"]
        elif choice == "required":
            assert names
    assert finished >= 3 or choice == "auto"  # free text from garbage rarely ends


def test_random_model_nested_arguments_and_the_llama_format(engine):
    plist = [tools_params("required", seed=s, tools=[ORDER], spec={"parallel_tool_calls": False})
             for s in range(3)]
    plist += [tools_params("add", seed=s, fmt="llama") for s in range(3)]
    outs = engine.chat([ASK] * len(plist), plist)
    for out, p in zip(outs, plist, strict=True):
        o = out.outputs[0]
        if o.finish_reason == "stop":
            fmt = LLAMA if p.structured_outputs.tool_spec.format == "llama" else HERMES
            assert len(valid_calls(o.text, fmt)) == 1


@pytest.fixture(scope="module")
def smol():
    return Engine(num_kv_blocks=768, max_num_batched_tokens=256)


QUESTIONS = ["What is the weather in Paris in celsius?", "What is 12.5 plus 7?",
             "Weather in Tokyo for 3 days, fahrenheit please."]


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_bundled_model_calls_validate(smol, choice):
    """At temperature 1.0 a 135M model under "auto" may ramble past max_tokens; whatever it
    wrote, each call it finished validates."""
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS for _ in range(2)]
    plist = [tools_params(choice, seed=i) for i in range(len(convs))]
    for out in smol.chat(convs, plist):
        o = out.outputs[0]
        names = valid_calls(o.text)  # every call that ended, even in text cut by max_tokens
        if choice == "required":
            assert o.finish_reason == "stop" and names, o.text


def test_tool_spec_is_the_sdk_route():
    spec = ToolSpec(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    params = SamplingParams(structured_outputs={"tools": spec})
    again = SamplingParams.from_dict(params.to_dict())
    assert again.structured_outputs.tool_spec.forced == "add"
    assert again.structured_outputs.kind == "tools"
