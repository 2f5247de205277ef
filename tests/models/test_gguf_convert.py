"""A GGUF's config and byte-level BPE tokenizer as pagedq converts them (gguf_config.py,
gguf_tokenizer.py) against transformers' own GGUF conversion (the oracle): the same config
fields, the same token ids on a varied corpus, the same decodes and the same chat rendering,
on the bundled model's GGUF and on tiny GGUFs of each family with vocabularies of each shape."""

from __future__ import annotations

import pytest
from transformers import AutoConfig, AutoTokenizer

from pagedq.worker.models.loader import load_config, load_tokenizer
from pagedq.worker.models.model_cache import _write_converted
from tests.gguf_files import BpeVocab, write_gguf
from tests.models.test_light_config import FIELDS, read
from tests.tiny_models import build_tiny_tokenizer

CORPUS = [
    "What is the capital of France?",
    "  leading spaces, trailing too   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "Ünïcödé — 東京 🙂 ok. Привет, мир! 😀👍🏽 مرحبا",
    "digits 1234567890 3.14159 -42 1e10 0x1F",
    "def f(x):\n    return {'a': [x, x ** 2]}  # code",
    "<|im_start|>user\nhi<|im_end|> <s>special</s> in text <think>hmm</think>",
    "",
    "a" * 50 + " " * 20 + "!" * 7,
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def convert_both(gguf, tmp_path):
    """(ours, transformers'): pagedq's packed conversion directory, and transformers' config and
    tokenizer read from the GGUF itself (None when the file has no tokenizer)."""
    ours = tmp_path / "ours"
    ours.mkdir()
    _write_converted(gguf, ours, weights=False)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ValueError, KeyError):
        tokenizer = None
    return ours, config, tokenizer


def assert_same_config(ours, theirs, head_dim: int | None = None) -> None:
    """Every field equal, as AutoConfig and as load_config (the engine) read them; ``head_dim``:
    the model's own where transformers' Qwen3 table leaves the class default (pagedq reads the
    file's attention.key_length there)."""
    mine = AutoConfig.from_pretrained(ours)
    assert type(mine) is type(theirs)
    if head_dim is not None:
        theirs.head_dim = head_dim
    skip = {"_name_or_path", "transformers_version"}
    a, b = mine.to_dict(), theirs.to_dict()
    assert {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}
    light = load_config(ours)
    for field in FIELDS:
        assert read(light, field) == read(theirs, field), field


def assert_same_tokenizer(ours, theirs) -> None:
    mine = load_tokenizer(ours)
    assert mine.added_tokens_decoder == theirs.added_tokens_decoder
    assert mine.all_special_tokens == theirs.all_special_tokens
    for text in CORPUS:
        ids = mine(text)["input_ids"]
        assert ids == theirs(text)["input_ids"], text
        assert mine(text, add_special_tokens=False)["input_ids"] == \
            theirs(text, add_special_tokens=False)["input_ids"], text
        for skip in (False, True):
            assert mine.decode(ids, skip_special_tokens=skip) == \
                theirs.decode(ids, skip_special_tokens=skip), text
    if theirs.chat_template is not None:
        for generation in (False, True):
            kw = {"tokenize": False, "add_generation_prompt": generation}
            assert mine.apply_chat_template(MESSAGES, **kw) == \
                theirs.apply_chat_template(MESSAGES, **kw)


def test_bundled_model_converts_as_transformers_does(tmp_path):
    from pagedq.worker.models.default_model import default_gguf

    ours, config, tokenizer = convert_both(default_gguf(), tmp_path)
    assert_same_config(ours, config)
    assert_same_tokenizer(ours, tokenizer)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_token_id_only_ggufs_convert_as_transformers_does(tiny_model_dir, tmp_path, family):
    ours, config, tokenizer = convert_both(
        write_gguf(tiny_model_dir(family), tmp_path / "m.gguf"), tmp_path)
    assert_same_config(ours, config, head_dim=16 if family == "qwen3" else None)
    assert tokenizer is None and not (ours / "tokenizer.json").exists()


VOCABS = {  # family, general.name, the vocabulary's shape
    "llama-bos": ("llama", None, dict(add_bos=True, ids={"padding": 0}, chat_template=TEMPLATE)),
    "mistral-eos": ("llama", "mistral", dict(add_bos=False, add_eos=True, ids={"unknown": 0})),
    "qwen2-split": ("qwen2", None, dict(pre="qwen2", extra={"<think>": 4, "</think>": 4},
                                        ids={"padding": 0}, chat_template=TEMPLATE)),
    "qwen3-mislabel": ("qwen3", None, dict(pre="llama-bpe", extra={"<｜end▁of▁sentence｜>": 3,
                                                                  "<think>": 4})),
}


@pytest.mark.parametrize("case", VOCABS)
def test_bpe_vocabularies_convert_as_transformers_does(tiny_model_dir, tmp_path, case):
    family, name, shape = VOCABS[case]
    vocab = BpeVocab(build_tiny_tokenizer(tmp_path / "tok"), **shape)
    overrides = {"hidden_size": 128} if family == "qwen3" else {}  # head_dim 16 != 128 / 4
    gguf = write_gguf(tiny_model_dir(family, **overrides), tmp_path / "m.gguf", vocab=vocab,
                      name=name)
    ours, config, tokenizer = convert_both(gguf, tmp_path)
    assert_same_config(ours, config, head_dim=16 if family == "qwen3" else None)
    assert_same_tokenizer(ours, tokenizer)
