"""RoPE tables without the modeling modules: the frequencies equal what each family's own
``*RotaryEmbedding`` computes (the oracle), for default and statically scaled RoPE."""

from __future__ import annotations

import importlib

import pytest
import torch
from transformers import AutoConfig

from pagedq.worker.models.llama import rope_frequencies, rope_tables

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


def config_for(family: str, scaling: dict | None):
    config = AutoConfig.for_model(family, hidden_size=64, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=256,
                                  head_dim=16, rope_theta=5000.0)
    if scaling is not None:
        params = dict(getattr(config, "rope_parameters", None) or {"rope_theta": 5000.0})
        params.update(scaling)
        if hasattr(config, "rope_parameters"):
            config.rope_parameters = params
        else:
            config.rope_scaling = scaling
    return config


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("kind", list(SCALINGS))
def test_frequencies_match_the_family_rotary_embedding(family, kind):
    config = config_for(family, SCALINGS[kind])
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    rotary = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))(config)
    inv_freq, scale = rope_frequencies(config, kind)
    torch.testing.assert_close(inv_freq.float(), rotary.inv_freq.float(), rtol=0, atol=0)
    assert scale == pytest.approx(rotary.attention_scaling)
    table = rope_tables(config, 32, torch.float32, "cpu")
    assert table.shape == (32, 2, 16)
