"""Tiny seeded random models built from transformers configs and saved with ``save_pretrained``.

They are the oracle's subject: the engine loads the saved directory, transformers runs the same
weights, and the tests compare. Weights are drawn with a wide init so greedy logits have clear
winners (near-ties would make token-exact comparisons flaky).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

FAMILIES = ("llama", "qwen2", "qwen3")


def make_config(family: str, **overrides):
    import transformers

    common = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(overrides)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=16, **common)
    raise ValueError(f"unknown family {family!r}")


def build_tiny_model(family: str, path: Path, seed: int = 0, **overrides) -> Path:
    """Save a seeded random ``family`` model (fp32) to ``path`` and return it."""
    import transformers

    config = make_config(family, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A factory: tiny_model_dir("qwen2", tie_word_embeddings=True) -> saved directory (cached)."""
    cache: dict[tuple, Path] = {}

    def make(family: str = "llama", seed: int = 0, **overrides) -> Path:
        key = (family, seed, tuple(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{family}")
            cache[key] = build_tiny_model(family, path, seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session", params=FAMILIES)
def tiny_family_dir(request, tiny_model_dir):
    """Each family in turn: (family, saved directory)."""
    return request.param, tiny_model_dir(request.param)


TOKENIZER_CORPUS = (
    "The capital of France is Paris. The capital of Italy is Rome. Hello world! "
    "Queues, workers and paged attention: blocks of sixteen tokens. Ünïcödé — 東京 🙂 ok. "
) * 20


def build_tiny_tokenizer(path: Path, vocab_size: int = 384) -> Path:
    """A byte-level BPE tokenizer trained on a fixed corpus (deterministic), saved to ``path``.

    Byte-level so every string (emoji, CJK) round-trips, and multi-byte characters split across
    tokens exercise the incremental detokenizer. Ids 0-2 are <pad>, <s>, </s>.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([TOKENIZER_CORPUS], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_text_model_dir(tmp_path_factory) -> Path:
    """A tiny Llama with a real (tiny, byte-level BPE) tokenizer: text prompts and stop strings."""
    path = tmp_path_factory.mktemp("tiny-text")
    build_tiny_model("llama", path, seed=1)
    return build_tiny_tokenizer(path)
