"""``load_config`` reads a supported family's config.json without transformers' family classes
(they import sympy, accelerate and torch.distributed.tensor): every field the engine reads must
equal what AutoConfig gives, defaults and RoPE standardization included."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from pagedq.worker.models.loader import load_config

FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
          "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
          "bos_token_id", "eos_token_id", "rope_parameters")

CONFIGS = [
    {"model_type": "llama"},  # every default
    {"model_type": "mistral"},
    {"model_type": "qwen2"},
    {"model_type": "qwen3"},
    {"model_type": "qwen3", "hidden_size": 1024, "num_attention_heads": 16},  # head_dim 128 kept
    {"model_type": "llama", "hidden_size": 512, "num_attention_heads": 8, "rope_theta": 500000.0,
     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
     "max_position_embeddings": 131072, "tie_word_embeddings": True},  # legacy RoPE keys
    {"model_type": "qwen2", "rope_theta": 1000000.0, "num_key_value_heads": 2,
     "rope_scaling": {"type": "linear", "factor": 2.0}},
]


@pytest.mark.parametrize("data", CONFIGS, ids=lambda d: "-".join(map(str, d.values()))[:40])
def test_light_config_equals_autoconfig(tmp_path, data):
    (tmp_path / "config.json").write_text(json.dumps(data))
    ours, theirs = load_config(tmp_path), AutoConfig.from_pretrained(tmp_path)
    for field in FIELDS:
        assert read(ours, field) == read(theirs, field), field


def read(config, field: str):
    """A field as the engine reads it (llama.py, sizing.py): absent flags are False, an absent
    head_dim is hidden_size // num_attention_heads."""
    if field == "head_dim":
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if field == "attention_bias":
        return bool(getattr(config, "attention_bias", False))
    return getattr(config, field, None)
