"""A GGUF's model config, built from pagedq's own header reader (gguf_file.py).

transformers builds it with ``load_gguf_checkpoint``, which parses the whole metadata with the
``gguf`` package's GGUFReader: a NumPy object per vocabulary string and merge (~+167 MB for the
bundled model's 49k-token vocabulary), and ``AutoTokenizer`` then reads the file a second time.
The families the engine runs need a dozen integers, so this module maps them itself, field for
field as transformers' GGUF tables do (``GGUF_CONFIG_MAPPING`` in transformers/integrations/
ggml.py and ``load_gguf_checkpoint``; tests/models/test_gguf_convert.py holds the two equal).
Other architectures return None and keep transformers' path.
"""

from __future__ import annotations

from typing import Any

from pagedq.worker.models.gguf_file import GGUFIndex

__all__ = ["CONFIG_ARCHITECTURES", "gguf_config"]

# GGUF's "<architecture>.<key>" -> the config field, for every family load_config runs
ARCH_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# transformers reads rope.dimension_count as head_dim for these only (partial rotary elsewhere)
ROPE_DIM_IS_HEAD_DIM = ("llama", "mistral")
CLASS_HEAD_DIM = {"qwen3": 128}  # the config classes' head_dim defaults (loader.FAMILY_DEFAULTS)
CONFIG_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
TOKEN_IDS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "unk_token_id": "tokenizer.ggml.unknown_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}
TOKENS = "tokenizer.ggml.tokens"


def gguf_config(index: GGUFIndex, vocab_length: int | None = None) -> dict[str, Any] | None:
    """config.json's fields for the GGUF ``index`` describes, or None for an architecture this
    module does not map (transformers' reader then does). ``vocab_length`` is the length of the
    file's token list, the vocabulary size where the file states none (as transformers does)."""
    arch = index.architecture
    if arch not in CONFIG_ARCHITECTURES:
        return None
    meta = index.metadata
    # llama.cpp writes Mistral as "llama"; transformers tells them apart by the exact name only
    model_type = "mistral" if arch == "llama" and meta.get("general.name") == "mistral" else arch
    config: dict[str, Any] = {"model_type": model_type}
    if "general.name" in meta:
        config["_model_name_or_path"] = meta["general.name"]
    config["tie_word_embeddings"] = all(t.name != "output.weight" for t in index.tensors)
    for key, field in ARCH_KEYS.items():
        if f"{arch}.{key}" in meta:
            config[field] = meta[f"{arch}.{key}"]
    if model_type in ROPE_DIM_IS_HEAD_DIM and f"{arch}.rope.dimension_count" in meta:
        config["head_dim"] = meta[f"{arch}.rope.dimension_count"]
    for field, key in TOKEN_IDS.items():
        if key in meta:
            config[field] = meta[key]
    # transformers' qwen3 table leaves the head size out, so Qwen3Config's default (128) would
    # stand in for it: the file's own attention.key_length is written wherever it differs
    implied = CLASS_HEAD_DIM.get(model_type) or config["hidden_size"] // config["num_attention_heads"]
    key_length = index.arch_int("attention.key_length")
    if key_length and config.get("head_dim", implied) != key_length:
        config["head_dim"] = key_length
    if "vocab_size" not in config and vocab_length is not None:
        config["vocab_size"] = vocab_length
    if "rope_theta" in config:  # saved as transformers 5 standardizes it
        config["rope_parameters"] = {"rope_theta": float(config.pop("rope_theta")),
                                     "rope_type": "default"}
    return config
