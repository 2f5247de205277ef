"""A GGUF's byte-level BPE vocabulary ("gpt2" in llama.cpp's terms) as Hugging Face tokenizer files.

transformers builds this tokenizer from a GGUF (``AutoTokenizer.from_pretrained(gguf_file=...)``)
through ``load_gguf_checkpoint``'s config read and a second full metadata read: for the bundled
model's 49k-token vocabulary that peaks ~170 MB above the process, which is what pushed the first
``pagedq chat`` on an empty cache past its 500 MB promise. The vocabulary and merges arrive here
as plain lists from pagedq's own header reader (gguf_file.py), and the tokenizer is assembled
with the ``tokenizers`` library the way transformers' GGUF converter assembles it (its
``byte_level_tokenizer``, ``add_gguf_special_tokens`` and ``set_split_regex`` in
transformers/integrations/gguf/gguf_tokenizer_mapping.py, then ``GPT2Tokenizer`` and
``TokenizersBackend``): the same vocabulary spelling, merges, pre-tokenizer, decoder, added
tokens and post-processor, saved as ``save_pretrained`` saves it. tests/models/
test_gguf_convert.py holds the two to the same ids, decodes and chat renderings.

Other vocabularies (sentencepiece "llama", unigram, a file without merges) return None: the
caller keeps transformers' converter for them.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from pagedq.worker.models.gguf_file import GGUFIndex

__all__ = ["TOKENIZER_ARRAYS", "GGUFTokenizer", "bpe_tokenizer"]

TOKENS, MERGES, TOKEN_TYPE = "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"
TOKENIZER_ARRAYS = (TOKENS, MERGES, TOKEN_TYPE)  # the arrays read_index must decode for this
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
# tokenizer_config.json's special tokens -> the GGUF key of their ids
SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}
GPT2_DEFAULT_SPECIAL = "<|endoftext|>"  # GPT2Tokenizer's unk/bos/eos default, added by its init
VERY_LARGE_INTEGER = int(1e30)  # transformers' model_max_length when nothing bounds it


@dataclass
class GGUFTokenizer:
    """The backend tokenizer, its tokenizer_config.json fields and its chat template."""

    backend: Any  # tokenizers.Tokenizer
    config: dict[str, Any]
    chat_template: str | None

    def save(self, out: Path) -> None:
        """Write tokenizer.json, tokenizer_config.json and chat_template.jinja as transformers'
        ``save_pretrained`` does (the template in its own file, as transformers 5 saves it)."""
        self.backend.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(
            json.dumps(self.config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
        if self.chat_template is not None:
            (out / "chat_template.jinja").write_text(self.chat_template)


def bpe_tokenizer(index: GGUFIndex) -> GGUFTokenizer | None:
    """The tokenizer of a GGUF with a byte-level BPE vocabulary and merges, read with
    ``read_index(path, TOKENIZER_ARRAYS)``; None for any other tokenizer (or none)."""
    meta = index.metadata
    splits = _pre_tokenizer_splits()
    if meta.get("tokenizer.ggml.model") != "gpt2" or TOKENS not in meta or MERGES not in meta \
            or splits is None:
        return None
    tokens: list[str] = meta[TOKENS]
    vocab = _byte_level_vocab(tokens)
    backend = Tokenizer(BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in meta[MERGES]],
                            dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                            fuse_unk=False))
    split = splits.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:  # the regex this vocabulary's merges were learned with
        from tokenizers import Regex

        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, meta.get(TOKEN_TYPE) or [], strict=False))  # no types: none
    alphabet = set(_byte_spelling().values())
    # GPT2Tokenizer's own defaults first, then the file's control tokens (one written outside the
    # byte alphabet is a llama.cpp mislabel, skipped as transformers skips it)
    backend.add_special_tokens([_special(GPT2_DEFAULT_SPECIAL)] + [
        _special(t) for t, kind in typed if kind == CONTROL and set(t) <= alphabet])
    known = backend.get_vocab()
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, kind in typed if kind == USER_DEFINED and t in known])
    named = {name: tokens[meta[key]] if key in meta else None for name, key in SPECIAL_IDS.items()}
    backend.add_special_tokens([_special(t) for t in named.values() if t is not None])
    config = _tokenizer_config(meta, named)
    _set_post_processor(backend, config, named)
    return GGUFTokenizer(backend, config, meta.get("tokenizer.chat_template"))


def _special(content: str):
    return AddedToken(content, normalized=False, special=True)


def _tokenizer_config(meta: dict[str, Any], named: dict[str, str | None]) -> dict[str, Any]:
    config: dict[str, Any] = {"backend": "tokenizers", **named,
                              "model_max_length": VERY_LARGE_INTEGER,
                              "tokenizer_class": "TokenizersBackend"}
    for flag in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{flag}" in meta:
            config[flag] = bool(meta[f"tokenizer.ggml.{flag}"])
    return config


def _set_post_processor(backend, config: dict[str, Any], named: dict[str, str | None]) -> None:
    """TokenizersBackend's template: BOS before and EOS after each sequence when the file asks
    for them (and names them)."""
    bos = named["bos_token"] if config.get("add_bos_token") else None
    eos = named["eos_token"] if config.get("add_eos_token") else None
    single = f"{f'{bos}:0 ' if bos else ''}$A:0{f' {eos}:0' if eos else ''}"
    pair = f"{single}{f' {bos}:1' if bos else ''} $B:1{f' {eos}:1' if eos else ''}"
    specials = [(t, backend.token_to_id(t)) for t in (bos, eos) if t]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                           special_tokens=specials)


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """Token -> id, each token in the byte alphabet (the GGUF spells a few in plain UTF-8)."""
    spelling = _byte_spelling()
    alphabet = set(spelling.values())
    return {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
            for i, t in enumerate(tokens)}


@functools.cache
def _byte_spelling() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for
    themselves, the rest are shifted past 255 in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    shifted = (b for b in range(256) if b not in keep)
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return table


def _pre_tokenizer_splits() -> dict[str, str] | None:
    """transformers' table of split regexes per ``tokenizer.ggml.pre`` (the regexes are data the
    two converters must share); None if this transformers has none, and its converter runs."""
    try:
        # transformers costs ~2-3 s to import (model_cache.py): only a conversion needs it
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_PRE_TOKENIZER_SPLITS,
        )
    except ImportError:
        return None
    return GGUF_PRE_TOKENIZER_SPLITS
