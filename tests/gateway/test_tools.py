"""Tool calling through the gateway, with the official openai client: valid every time.

The worker serves a random-weight Llama that speaks the bundled tokenizer: it picks garbage,
so only the grammar can make its calls parse. Every call that ends is checked against its
function's schema by jsonschema (the oracle), for each tool_choice mode, streamed and not,
parallel or not, over several seeds at temperature 1.0; then the bundled SmolLM2 on real
questions, and a second turn that sends a tool result back.
"""

from __future__ import annotations

import io
import json

import jsonschema
import openai
import pytest

from pagedq.gateway.fleet import model_id
from pagedq.tools import HERMES
from pagedq.tools.prompt import render_chat
from tests.engine.structured_cases import build_random_model, load_bundled_tokenizer
from tests.gateway.harness import serve, serve_worker
from tests.gateway.test_batches import jsonl, read_lines, wait_batch

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                   "b": {"type": "number"}},
                   "required": ["a", "b"]}}}
ORDER = {"type": "function", "function": {  # nested objects, enums, arrays
    "name": "place_order",
    "parameters": {"type": "object", "properties": {
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 10},
            "tier": {"enum": ["gold", "silver"]}}, "required": ["name", "tier"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                             "qty": {"type": "integer", "minimum": 1,
                                                     "maximum": 9}},
            "required": ["sku", "qty"]}},
        "express": {"type": "boolean"}},
        "required": ["customer", "items", "express"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD, ORDER)}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 2?"}]
QUEUE = "gw-tools"


def check_calls(calls, allowed=tuple(SCHEMAS)) -> list[dict]:
    """Every call names an allowed function and its arguments validate; returns them parsed."""
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed, call.function.name
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append(args)
    return out


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("random-tools"))


@pytest.fixture(scope="module")
def gw(redis_url, random_model):
    with serve_worker(redis_url, str(random_model), "tools-w", QUEUE) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def client(gw) -> openai.OpenAI:
    return gw.openai()


@pytest.fixture(scope="module")
def model(random_model) -> str:
    return model_id(str(random_model))


def create(client, model, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 160)
    kw.setdefault("temperature", 1.0)
    return client.chat.completions.create(model=model, tools=kw.pop("tools", TOOLS), **kw)


def streamed(client, model, **kw) -> tuple[str, dict[int, dict], str]:
    """(content, calls by index: id, name, arguments text, finish_reason) of a stream."""
    content, calls, reason = "", {}, None
    for chunk in create(client, model, stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] = d.function.name or call["name"]
                    call["arguments"] += d.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, calls, reason


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("choice", ["required", "named"])
def test_required_and_named_calls_validate_every_time(client, model, choice, seed):
    tool_choice = ("required" if choice == "required"
                   else {"type": "function", "function": {"name": "add"}})
    res = create(client, model, tool_choice=tool_choice, seed=seed)
    c = res.choices[0]
    if c.finish_reason == "length":
        return  # cut by max_tokens: nothing to check
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    check_calls(c.message.tool_calls, ("add",) if choice == "named" else ("get_weather", "add"))
    if choice == "named":
        assert len(c.message.tool_calls) == 1


@pytest.mark.parametrize("seed", range(3))
def test_streamed_argument_fragments_concatenate_to_the_same_calls(client, model, seed):
    plain = create(client, model, tool_choice="required", seed=seed).choices[0]
    content, calls, reason = streamed(client, model, tool_choice="required", seed=seed)
    assert reason == plain.finish_reason
    if reason == "length":
        return
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (t.function.name, t.function.arguments) for t in plain.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("seed", range(4))
def test_auto_answers_text_or_valid_calls(client, model, seed):
    for res in (create(client, model, tool_choice="auto", seed=seed),
                create(client, model, seed=seed)):  # auto is the default with tools
        c = res.choices[0]
        if c.message.tool_calls and c.finish_reason == "tool_calls":
            check_calls(c.message.tool_calls)
        else:
            assert c.message.tool_calls is None and isinstance(c.message.content, str)
    _, calls, reason = streamed(client, model, tool_choice="auto", seed=seed)
    if reason == "tool_calls":
        for call in calls.values():
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_none_never_calls(client, model):
    c = create(client, model, tool_choice="none", seed=1, max_tokens=24).choices[0]
    assert c.message.tool_calls is None and c.finish_reason in ("stop", "length")


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls(client, model, parallel):
    counts = []
    for seed in range(4):
        c = create(client, model, tool_choice="required", seed=seed, max_tokens=240,
                   parallel_tool_calls=parallel).choices[0]
        if c.finish_reason == "tool_calls":
            check_calls(c.message.tool_calls)
            counts.append(len(c.message.tool_calls))
            assert len({t.id for t in c.message.tool_calls}) == len(c.message.tool_calls)
    assert counts
    if not parallel:
        assert set(counts) == {1}


@pytest.mark.parametrize("seed", range(3))
def test_nested_objects_enums_and_arrays(client, model, seed):
    c = create(client, model, tools=[ORDER], tool_choice="required", seed=seed,
               max_tokens=200, parallel_tool_calls=False).choices[0]
    if c.finish_reason != "length":
        (args,) = check_calls(c.message.tool_calls, ("place_order",))
        assert args["customer"]["tier"] in ("gold", "silver") and 1 <= len(args["items"]) <= 3


def test_n_choices_each_parse_with_their_own_ids(client, model):
    res = create(client, model, tool_choice="required", seed=3, n=2, parallel_tool_calls=False)
    ids = set()
    for c in res.choices:
        if c.finish_reason == "tool_calls":
            check_calls(c.message.tool_calls)
            ids.update(t.id for t in c.message.tool_calls)
    assert len(ids) == sum(len(c.message.tool_calls or []) for c in res.choices)


def test_a_tool_result_goes_back_for_a_second_turn(client, model):
    first = create(client, model, tool_choice={"type": "function",
                                               "function": {"name": "get_weather"}}, seed=2)
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    second = create(client, model, messages=messages, seed=2, max_tokens=16)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_the_prompt_lists_the_tools_past_calls_and_results():
    """SmolLM2's template has no tools: they are folded into its messages (Hermes style)."""
    tokenizer = load_bundled_tokenizer()
    from pagedq.tools import ToolSpec

    messages = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4"}]
    text = render_chat(tokenizer, messages, ToolSpec(tools=TOOLS))
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert HERMES.call_text("add", {"a": 2, "b": 2}) in text
    assert "<|im_start|>tool\n<tool_response>\n4\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     None),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tool_requests_are_400s(client, model, body, param):
    body = {"tools": TOOLS, **body}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=8,
                                       **{k: v for k, v in body.items() if v is not None})
    if param:
        assert err.value.body["param"] == param


def test_a_batch_line_with_tools(client, model):
    rows = [{"custom_id": f"t{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "messages": ASK, "tools": TOOLS, "tool_choice": "required",
                      "seed": i, "temperature": 1.0, "max_tokens": 160}} for i in range(3)]
    f = client.files.create(file=("tools.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")
    batch = wait_batch(client, client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id)
    assert batch.status == "completed"
    for line in read_lines(client, batch.output_file_id):
        choice = line["response"]["body"]["choices"][0]
        if choice["finish_reason"] == "tool_calls":
            for call in choice["message"]["tool_calls"]:
                jsonschema.validate(json.loads(call["function"]["arguments"]),
                                    SCHEMAS[call["function"]["name"]])


# -- LangChain (langchain-openai, when installed) ----------------------------------------------
def test_langchain_bind_tools_and_structured_output(gw, model):
    lc = pytest.importorskip("langchain_openai")
    from typing import Literal

    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        """The weather in a city."""

        city: str = Field(max_length=12)
        unit: Literal["celsius", "fahrenheit"]

    llm = lc.ChatOpenAI(model=model, base_url=gw.base + "/v1", api_key="none", temperature=1.0,
                        max_tokens=160, max_retries=0, seed=4)
    msg = llm.bind_tools(TOOLS, tool_choice="required").invoke("Weather in Paris?")
    assert msg.tool_calls
    for call in msg.tool_calls:
        jsonschema.validate(call["args"], SCHEMAS[call["name"]])
        assert call["id"].startswith("call_")
    out = llm.with_structured_output(Weather, method="function_calling").invoke("Paris?")
    assert isinstance(out, Weather) and out.unit in ("celsius", "fahrenheit")


# -- the deprecated functions / function_call ------------------------------------------------
FUNCTIONS = [t["function"] for t in TOOLS]


def test_functions_are_answered_with_one_function_call(client, model):
    for seed in range(3):
        c = client.chat.completions.create(
            model=model, messages=ASK, functions=FUNCTIONS, function_call={"name": "add"},
            seed=seed, temperature=1.0, max_tokens=160).choices[0]
        if c.finish_reason == "length":
            continue
        assert c.finish_reason == "function_call" and c.message.tool_calls is None
        assert c.message.function_call.name == "add"
        jsonschema.validate(json.loads(c.message.function_call.arguments), SCHEMAS["add"])


def test_functions_streamed_and_a_function_result_back(client, model):
    kw = dict(model=model, messages=ASK, functions=FUNCTIONS, temperature=1.0, max_tokens=160,
              function_call={"name": "get_weather"}, seed=5)
    first = client.chat.completions.create(**kw)
    whole = first.choices[0]
    name, args, reason = None, "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            assert not choice.delta.tool_calls
            if choice.delta.function_call is not None:
                name = choice.delta.function_call.name or name
                args += choice.delta.function_call.arguments or ""
            reason = choice.finish_reason or reason
    assert reason == whole.finish_reason
    if reason == "length":
        return
    assert (name, args) == (whole.message.function_call.name, whole.message.function_call.arguments)
    jsonschema.validate(json.loads(args), SCHEMAS["get_weather"])
    messages = ASK + [{"role": "assistant", "content": None,
                       "function_call": {"name": name, "arguments": args}},
                      {"role": "function", "name": name, "content": '{"temp": 21}'}]
    second = client.chat.completions.create(model=model, messages=messages, functions=FUNCTIONS,
                                            max_tokens=8, seed=1)
    assert second.choices[0].finish_reason in ("stop", "length", "function_call")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result
    without = client.chat.completions.create(model=model, messages=messages, functions=FUNCTIONS,
                                             function_call="none", max_tokens=8, seed=1)
    assert without.choices[0].message.function_call is None


@pytest.mark.parametrize("body, param", [
    ({"functions": FUNCTIONS, "tools": TOOLS}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"functions": FUNCTIONS, "function_call": "sometimes"}, "function_call"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),  # over 20 (accepted in [0, 20])
])
def test_bad_legacy_and_prompt_logprobs_requests_are_400s(client, model, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=8, extra_body=body)
    assert err.value.body["param"] == param


# -- chat echo (vLLM's) --------------------------------------------------------------------------
def test_chat_echo_prepends_the_last_assistant_message(client, model):
    messages = ASK + [{"role": "assistant", "content": "The answer is"}]
    kw = dict(model=model, messages=messages, max_tokens=6, seed=3, temperature=1.0)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    echoed = client.chat.completions.create(extra_body={"echo": True}, **kw)
    assert echoed.choices[0].message.content == "The answer is" + plain
    streamed_text = "".join(ch.delta.content or "" for chunk in client.chat.completions.create(
        stream=True, extra_body={"echo": True}, **kw) for ch in chunk.choices)
    assert streamed_text == "The answer is" + plain
    user_last = client.chat.completions.create(model=model, messages=ASK, max_tokens=6, seed=3,
                                               extra_body={"echo": True})
    assert not user_last.choices[0].message.content.startswith(ASK[0]["content"])


# -- the format: the model's, or the operator's override --------------------------------------------
def test_a_gateway_forced_to_the_mistral_format_answers_valid_calls(redis_url, gw, model):
    with serve(redis_url, queue=QUEUE, tool_call_format="mistral") as forced:
        client = forced.openai()
        ended = 0
        for seed in range(4):
            c = create(client, model, tool_choice="required", seed=seed).choices[0]
            if c.finish_reason == "length":
                continue
            ended += 1
            assert c.finish_reason == "tool_calls"
            check_calls(c.message.tool_calls, ("get_weather", "add"))
        assert ended
        content, calls, reason = streamed(client, model, tool_choice="required", seed=1)
        if reason == "tool_calls":
            for call in calls.values():
                jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
