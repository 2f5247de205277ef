"""Text in and out: tokenization, streamed text deltas, stop strings, chat templates."""

from __future__ import annotations

import pytest

from pagedq.client import SamplingParams
from pagedq.worker import Engine


@pytest.fixture(scope="module")
def engine(tiny_text_model_dir):
    return Engine(str(tiny_text_model_dir), num_kv_blocks=256, block_size=4)


def stream(engine: Engine, prompt, params):
    engine.add_request("s", prompt, params)
    text, tokens, last = "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.new_text
            tokens += out.new_token_ids
            last = out
    return text, tokens, last


def test_streamed_text_equals_decode(engine):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True,
                            skip_special_tokens=False)
    text, tokens, last = stream(engine, "The capital of", params)
    assert "\ufffd" not in text or "\ufffd" in engine.tokenizer.decode(tokens)
    assert text == engine.tokenizer.decode(tokens, skip_special_tokens=False)
    out = engine.generate(["The capital of"], params)[0].outputs[0]
    assert out.text == text and out.token_ids == tokens


def test_stop_string_across_token_boundaries(engine):
    """Pick a stop string that straddles two generated tokens; output is cut before it."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    out = engine.generate(["Hello"], params)[0].outputs[0]
    tok = engine.tokenizer
    pieces = [tok.decode([t]) for t in out.token_ids]
    k = next(i for i in range(2, len(pieces)) if pieces[i - 1] and pieces[i]
             and out.text.count(pieces[i - 1][-1] + pieces[i][0]) >= 1)
    stop = pieces[k - 1][-1] + pieces[k][0]
    cut = out.text.index(stop)
    stopped = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=30,
                                                        ignore_eos=True, stop=[stop]))
    s = stopped[0].outputs[0]
    assert s.finish_reason == "stop" and s.text == out.text[:cut]
    streamed, _, last = stream(engine, "Hello", SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))
    assert streamed == s.text and last.finish_reason == "stop"


def test_chat_template_applied(engine):
    convo = [{"role": "user", "content": "Hello"}]
    ids = engine.apply_chat_template(convo)
    expected = engine.tokenizer("<s>user: Hello\nassistant:", add_special_tokens=False).input_ids
    assert ids == expected
    outs = engine.chat(convo, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert outs[0].prompt_token_ids == expected and len(outs[0].outputs[0].token_ids) == 5


def test_eos_stops_and_is_not_in_text(engine):
    eos = engine.tokenizer.eos_token_id
    greedy = engine.generate(["Paris"], SamplingParams(temperature=0, max_tokens=8,
                                                       ignore_eos=True))[0].outputs[0]
    engine.eos_token_ids = frozenset({eos, greedy.token_ids[2]})
    try:
        out = engine.generate(["Paris"], SamplingParams(temperature=0, max_tokens=8))[0]
    finally:
        engine.eos_token_ids = frozenset({eos})
    o = out.outputs[0]
    assert o.token_ids == greedy.token_ids[:3] and o.finish_reason == "stop"
    assert o.text == engine.tokenizer.decode(greedy.token_ids[:2])
