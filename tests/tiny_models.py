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
