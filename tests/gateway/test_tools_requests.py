"""Tool requests -> jobs, without a server: the deprecated functions, the model's format, echo.

The oracle is OpenAI's documented mapping (functions -> tools, function_call -> tool_choice, one
call at most) and the ToolSpec the engine receives, checked field by field.
"""

from __future__ import annotations

import pytest

from pagedq.client import CompletionResult
from pagedq.gateway.api_errors import APIError
from pagedq.gateway.openai import ChatCompletionRequest
from pagedq.gateway.tools import ToolDeltas, chat_choice, model_format
from pagedq.gateway.translate import chat_spec, use_tool_format
from pagedq.tools import MISTRAL
from tests.gateway.test_tools import ASK, TOOLS

FUNCTIONS = [t["function"] for t in TOOLS]


def spec_of(**body):
    return chat_spec(ChatCompletionRequest.model_validate(
        {"model": "m", "messages": ASK, **body}))


@pytest.mark.parametrize("function_call, choice", [
    (None, "auto"), ("auto", "auto"), ({"name": "add"}, "add")])
def test_functions_become_tools_with_one_call(function_call, choice):
    spec = spec_of(functions=FUNCTIONS, function_call=function_call)
    tools = spec.params.structured_outputs.tool_spec
    assert tools.tools == TOOLS and tools.tool_choice == choice
    assert tools.parallel_tool_calls is False and spec.view.legacy_functions


def test_function_call_none_is_plain_text():
    spec = spec_of(functions=FUNCTIONS, function_call="none")
    assert spec.params.structured_outputs is None and spec.view.tools is None


def test_past_function_calls_and_results_become_tool_messages():
    messages = ASK + [
        {"role": "assistant", "content": None,
         "function_call": {"name": "add", "arguments": '{"a": 2, "b": 2}'}},
        {"role": "function", "name": "add", "content": "4"}]
    (conversation,) = spec_of(messages=messages, functions=FUNCTIONS).prompts
    call, result = conversation[1], conversation[2]
    assert call["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 2}'}
    assert result == {"role": "tool", "content": "4", "name": "add",
                      "tool_call_id": call["tool_calls"][0]["id"]}


def test_legacy_answers_are_function_calls():
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    out = CompletionResult(index=0, text=text, token_ids=[], finish_reason="stop")
    choice = chat_choice("hermes", "r", 0, out, "stop", None, legacy=True)
    assert choice["finish_reason"] == "function_call"
    assert choice["message"]["function_call"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert "tool_calls" not in choice["message"]
    deltas = ToolDeltas("hermes", "r", 0, legacy=True)
    pieces = [deltas.delta(text[i:i + 5], i + 5 >= len(text)) for i in range(0, len(text), 5)]
    fc = [p["function_call"] for p in pieces if "function_call" in p]
    assert fc[0]["name"] == "add" and "".join(f["arguments"] for f in fc) == '{"a": 1, "b": 2}'
    assert deltas.finish_reason("stop") == "function_call"


def test_the_served_models_format_reaches_the_engine_and_the_view(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        '{"added_tokens_decoder": {"7": {"content": "[TOOL_CALLS]"}, "8": {"content": "[ARGS]"}}}')
    spec = spec_of(tools=TOOLS, tool_choice="required")
    assert spec.view.tools == "hermes"  # built before the model is known
    use_tool_format(spec, model_format(str(tmp_path)))
    assert spec.view.tools == "mistral"
    assert spec.params.structured_outputs.tool_spec.format == MISTRAL.name
    assert model_format(str(tmp_path), "llama") == "llama"
    plain = spec_of()
    use_tool_format(plain, "mistral")  # no tools: nothing to set
    assert plain.view.tools is None and plain.params.structured_outputs is None


def test_chat_echo_keeps_the_last_assistant_text():
    messages = ASK + [{"role": "assistant", "content": "The answer is"}]
    assert spec_of(messages=messages, echo=True).view.echo == "The answer is"
    assert spec_of(messages=ASK, echo=True).view.echo is None
    assert spec_of(messages=messages).view.echo is None


@pytest.mark.parametrize("body, param", [
    ({"functions": FUNCTIONS, "tools": TOOLS}, "functions"),
    ({"function_call": {"name": "add"}}, "function_call"),
    ({"functions": FUNCTIONS, "function_call": {"nam": "add"}}, "function_call"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),  # [0, 20] is accepted
])
def test_bad_requests_name_the_field(body, param):
    with pytest.raises(APIError) as err:
        spec_of(**body)
    assert err.value.status == 400 and err.value.param == param
