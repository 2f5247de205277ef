"""Incremental detokenization against the oracle ``tokenizer.decode(all_output_ids)``.

Uses the default model's byte-level BPE tokenizer (SmolLM2: emoji and CJK characters span several
tokens) and a small SentencePiece-style tokenizer (Metaspace + byte fallback, like Llama 2)
trained here, whose decode strips the first token's leading space.
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedq.worker.engine.detokenizer import IncrementalDetokenizer, find_stop, partial_stop_len

MULTI_BYTE_TEXTS = [
    "Hello 😀 world",
    "日本語のテキストです。中文也可以。한국어도.",
    "family: 👩‍👩‍👧‍👦 flags: 🇯🇵🇫🇷 skin: 👍🏽 keycap: 1️⃣",
    "café naïve ñ Ωμέγα Привет עברית العربية",
    "math 𝔸𝔹ℂ ∀x∈ℝ, emoji at the end 🎉",
    "🎉",
    "  leading and trailing spaces  ",
    "line\nbreaks\tand tabs\r\n",
]


@pytest.fixture(scope="session")
def smol_tokenizer():
    from pagedq.worker.models.default_model import ensure_default_model
    from pagedq.worker.models.loader import load_tokenizer

    return load_tokenizer(ensure_default_model())


@pytest.fixture(scope="session")
def sp_tokenizer():
    """A Llama-2-like tokenizer: Metaspace pre-tokenizer, BPE with byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def build(model):
        tok = Tokenizer(model)
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                     split=False)
        tok.decoder = decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ])
        return tok

    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=list("▁abcdefghijklmnopqrstuvwxyz"))
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello there"] * 50
    trained = build(models.BPE(unk_token="<unk>"))
    trained.train_from_iterator(corpus, trainer)
    state = json.loads(trained.to_str())["model"]
    vocab = dict(state["vocab"])
    for b in range(256):  # byte fallback pieces must live in the BPE vocab itself
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tok = build(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    """Feed ``ids`` in pieces of the given sizes (cycled), then flush; return all deltas."""
    deltas, i, k = [], 0, 0
    while i < len(ids):
        n = chunks[k % len(chunks)]
        deltas.append(detok.append(ids[i : i + n]))
        i, k = i + n, k + 1
    deltas.append(detok.flush())
    return deltas


def assert_streams_like_decode(tokenizer, prompt_ids, ids, chunks=(1,), skip=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
    deltas = stream(detok, ids, list(chunks))
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    assert detok.text == expected
    assert "".join(deltas) == detok.text
    if "\ufffd" not in expected:  # never a replacement char for a character still being built
        assert not any("\ufffd" in d for d in deltas)
    return deltas


@pytest.mark.parametrize("text", MULTI_BYTE_TEXTS)
def test_multi_byte_text_one_token_at_a_time(smol_tokenizer, text):
    ids = smol_tokenizer.encode(text)
    assert len(ids) > 1 or text == "🎉"
    prompt = smol_tokenizer.encode("Please repeat:")
    deltas = assert_streams_like_decode(smol_tokenizer, prompt, ids)
    assert "".join(deltas) == text
    if "😀" in text:  # the emoji spans two tokens: one step emits "", the next the whole emoji
        assert "" in deltas[:-1] and any("😀" in d for d in deltas)


@pytest.mark.parametrize("seed", range(4))
def test_random_resplits(smol_tokenizer, seed):
    rng = random.Random(seed)
    text = "".join(rng.sample(MULTI_BYTE_TEXTS, len(MULTI_BYTE_TEXTS)))
    ids = smol_tokenizer.encode(text)
    chunks = [rng.randint(1, 5) for _ in range(10)]
    prompt = smol_tokenizer.encode(rng.choice(["", "Hi", "日本", "x 😀"]))
    deltas = assert_streams_like_decode(smol_tokenizer, prompt, ids, chunks)
    assert "".join(deltas) == text


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_ids_match_decode(smol_tokenizer, skip):
    """Arbitrary ids, special tokens included: invalid byte runs still decode as decode does."""
    rng = random.Random(1234)
    vocab = len(smol_tokenizer)
    special = smol_tokenizer.all_special_ids
    for _ in range(60):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(vocab)
               for _ in range(rng.randint(1, 40))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        chunks = [rng.randint(1, 3) for _ in range(5)]
        assert_streams_like_decode(smol_tokenizer, prompt, ids, chunks, skip=skip)


def test_special_tokens_skipped_or_kept(smol_tokenizer):
    tok = smol_tokenizer
    ids = tok.encode("Hi there") + [tok.convert_tokens_to_ids("<|im_end|>")]
    skipped = assert_streams_like_decode(tok, [], ids, skip=True)
    kept = assert_streams_like_decode(tok, [], ids, skip=False)
    assert "".join(skipped) == "Hi there"
    assert "".join(kept) == "Hi there<|im_end|>"


def test_prompt_ending_mid_character(smol_tokenizer):
    ids = smol_tokenizer.encode("a😀b")
    for cut in range(1, len(ids)):
        assert_streams_like_decode(smol_tokenizer, ids[:cut], ids[cut:])


def test_incomplete_tail_is_held_then_flushed(smol_tokenizer):
    ids = smol_tokenizer.encode("ok 😀")
    detok = IncrementalDetokenizer(smol_tokenizer, [])
    assert detok.append(ids[:-1]) == "ok"  # the emoji's first bytes are held back
    assert detok.flush() == smol_tokenizer.decode(ids[-2:-1])  # finish mid-char: like decode
    assert detok.text == smol_tokenizer.decode(ids[:-1])
    assert detok.flush() == ""


def test_no_tokenizer_means_no_text():
    detok = IncrementalDetokenizer(None, [1, 2, 3])
    assert detok.append([4, 5]) == ""
    assert detok.flush() == ""
    assert detok.text == ""


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(min_size=1, max_size=40),
    prompt=st.text(max_size=10),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=5),
)
def test_hypothesis_any_unicode(smol_tokenizer, text, prompt, chunks):
    ids = smol_tokenizer.encode(text)
    if not ids:
        return
    assert_streams_like_decode(smol_tokenizer, smol_tokenizer.encode(prompt), ids, chunks)


# ------------------------------------------------------------------ SentencePiece-style


@pytest.mark.parametrize("text", ["hello world", "the fox 😀 jumps", "über 日本 ok"])
def test_sentencepiece_style_keeps_leading_space_in_context(sp_tokenizer, text):
    """With a prompt before it, the first output word keeps its space (decode of the output
    alone would strip it): the output text is what the prompt+output decode adds."""
    tok = sp_tokenizer
    prompt = tok.encode("the quick", add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream(detok, ids, [1])
    whole = tok.decode(prompt + ids)
    assert detok.text == whole[len(tok.decode(prompt)) :]
    assert not any("\ufffd" in d for d in deltas)
    # Without a prompt it is exactly decode(output_ids).
    assert_streams_like_decode(tok, [], ids)


# ------------------------------------------------------------------ stop strings


def brute_force_stop(text: str, stops: list[str]):
    hits = [(text.find(s), i, s) for i, s in enumerate(stops) if s in text]
    return (min(hits)[0], min(hits)[2]) if hits else None


def test_stop_split_across_tokens(smol_tokenizer):
    tok = smol_tokenizer
    ids = tok.encode("The answer is 42.\nObservation: done")
    stops = ["Observation:", "\n\n"]
    detok = IncrementalDetokenizer(tok, [])
    found = None
    for token in ids:
        delta = detok.append([token])
        found = find_stop(detok.text, len(detok.text) - len(delta), stops)
        if found:
            break
    assert found == (detok.text.index("Observation:"), "Observation:")
    assert detok.text[: found[0]] == "The answer is 42.\n"


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab😀", max_size=30),
    stops=st.lists(st.text(alphabet="ab😀", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(1, 5), min_size=1, max_size=6),
)
def test_find_stop_incremental_matches_brute_force(text, stops, cuts):
    """Scanning each new chunk plus a short tail finds what a full rescan finds, first time."""
    end, k = 0, 0
    while end < len(text):
        start, end = end, min(len(text), end + cuts[k % len(cuts)])
        k += 1
        got = find_stop(text[:end], start, stops)
        assert got == brute_force_stop(text[:end], stops)
        if got:
            return


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc", max_size=12),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=5), max_size=3))
def test_partial_stop_len_matches_brute_force(text, stops):
    expected = max(
        [n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1)
         if text.endswith(s[:n])],
        default=0,
    )
    assert partial_stop_len(text, stops) == expected
