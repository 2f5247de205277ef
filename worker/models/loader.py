"""Find a model's files on local disk and read them: config, weights, tokenizer.

Nothing here downloads from a model hub. A model is named by a local directory in Hugging Face
layout, a ``.gguf`` file (converted once to such a directory and cached), a repo id already in
the local Hugging Face cache, or nothing at all (the bundled default model). The engine only ever
sees a directory with ``config.json`` + weights, so our own forward pass (``llama.py``) never has
to know where the files came from.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from pagedq.errors import ModelNotFoundError
from pagedq.logging import get_logger
from pagedq.worker.config import settings
from pagedq.worker.models.default_model import ensure_default_model
from pagedq.worker.models.gguf_weights import Weight, iter_gguf_weights
from pagedq.worker.models.model_cache import convert_gguf, gguf_cache_path, packed_source

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

__all__ = [
    "resolve_model",
    "load_config",
    "iter_weights",
    "load_tokenizer",
    "hf_hub_cache_dir",
    "weight_files",
]

log = get_logger(__name__)

# Any one of these makes ``AutoTokenizer.from_pretrained`` able to build a tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def hf_hub_cache_dir() -> Path:
    """The Hugging Face hub cache (HF_HUB_CACHE, HF_HOME/hub or ~/.cache/huggingface/hub).

    Taken from pagedq's settings rather than huggingface_hub's constants, which freeze at import.
    """
    return settings().hf_hub_cache


# --------------------------------------------------------------------------- resolution


def resolve_model(model: str | os.PathLike | None, packed: bool = False) -> Path:
    """Turn what the user passed into a local directory holding config.json + weights.

    ``packed``: a GGUF keeps its blocks, so its directory holds config and tokenizer only and
    :func:`iter_weights` reads the tensors from the GGUF itself (the bundled default model too);
    otherwise a GGUF is dequantized to an fp32 directory once. Raises ModelNotFoundError naming
    every place that was looked at.
    """
    if model is None or (isinstance(model, str) and not model.strip()):
        return ensure_default_model(packed)
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.exists():
        return _resolve_local(path, packed)
    tried = [f"local path {str(path.absolute())!r}: does not exist"]
    repo_id, revision = _split_revision(text)
    if _looks_like_repo_id(repo_id):
        snapshot, why = _hf_cache_snapshot(repo_id, revision)
        if snapshot is not None:
            return _resolve_local(snapshot, packed)  # config.json, or a GGUF-only repo
        tried.append(why)
    else:
        tried.append(f"{text!r} is not a Hugging Face repo id (org/name): HF cache not searched")
    raise ModelNotFoundError(_not_found_message(text, tried))


def _resolve_local(path: Path, packed: bool = False) -> Path:
    # Absolute but symlinks kept: the HF cache links "model.gguf" to a blob named by its hash.
    path = Path(os.path.abspath(path))
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return convert_gguf(path, gguf_cache_path(path, packed), weights=not packed)
        raise ModelNotFoundError(
            _not_found_message(str(path), [f"{path} is a file but not a .gguf file"])
        )
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return convert_gguf(ggufs[0], gguf_cache_path(ggufs[0], packed), weights=not packed)
    why = f"directory {path} has no config.json"
    if ggufs:
        names = ", ".join(g.name for g in ggufs)
        why += f" and {len(ggufs)} .gguf files ({names}): pass one of them"
    raise ModelNotFoundError(_not_found_message(str(path), [why]))


def _split_revision(text: str) -> tuple[str, str | None]:
    """'org/name@rev' -> ('org/name', 'rev'); the revision must already be in the local cache."""
    if "@" in text:
        repo_id, _, revision = text.partition("@")
        return repo_id, revision or None
    return text, None


def _looks_like_repo_id(text: str) -> bool:
    from huggingface_hub.utils import validate_repo_id  # with transformers' cost (load_config)

    if text.count("/") > 1 or text.startswith((".", "/", "~")):
        return False
    try:
        validate_repo_id(text)
    except Exception:
        return False
    return True


def _hf_cache_snapshot(repo_id: str, revision: str | None) -> tuple[Path | None, str]:
    """The cached snapshot directory of ``repo_id``, offline only; (None, why) when absent."""
    from huggingface_hub import snapshot_download  # with transformers' cost (load_config)

    hub = hf_hub_cache_dir()
    where = f"Hugging Face cache {str(hub)!r} (offline) for {repo_id!r}"
    if revision:
        where += f" at revision {revision!r}"
    try:
        snapshot = Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=hub, local_files_only=True
            )
        )
    except Exception as exc:  # LocalEntryNotFoundError and friends: all mean "not cached"
        return None, f"{where}: not cached ({type(exc).__name__})"
    return snapshot, ""


def _not_found_message(model: str, tried: list[str]) -> str:
    lines = [f"Could not find model {model!r} on local disk (pagedq never downloads from a hub)."]
    lines += ["Tried:"] + [f"  - {t}" for t in tried]
    lines += [
        "Pass one of: a directory with config.json and *.safetensors / pytorch_model*.bin; "
        "a .gguf file; a repo id already in the Hugging Face cache (fetch it first with "
        "`hf download ORG/NAME`, or `huggingface-cli download` with huggingface_hub < 0.34; set "
        "HF_HUB_CACHE or HF_HOME if the cache lives elsewhere); or no model at all for the "
        "bundled default (SmolLM2-135M-Instruct)."
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- reading


# Each supported family's defaults for the fields the engine reads, where config.json leaves
# them out: the values of transformers' own LlamaConfig, MistralConfig, Qwen2Config and
# Qwen3Config (tests/models/test_loader.py checks them against those classes). ``head_dim``
# None means hidden_size // num_attention_heads; ``num_key_value_heads`` None means one KV head
# per attention head.
_COMMON_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
}
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _COMMON_DEFAULTS,
    "mistral": {**_COMMON_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": {**_COMMON_DEFAULTS, "vocab_size": 151936, "intermediate_size": 22016,
              "num_key_value_heads": 32,
              "max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None,
              "use_sliding_window": False, "sliding_window": None},
    "qwen3": {**_COMMON_DEFAULTS, "vocab_size": 151936, "intermediate_size": 22016,
              "num_key_value_heads": 32,
              "head_dim": 128, "max_position_embeddings": 32768, "bos_token_id": None,
              "eos_token_id": None, "use_sliding_window": False, "sliding_window": None},
}


def load_config(path: Path) -> PretrainedConfig:
    """The model's transformers config (architecture flags the forward pass reads).

    For the families the forward pass runs, config.json is read into transformers' base
    ``PretrainedConfig`` with the family's defaults (:data:`FAMILY_DEFAULTS`) and its RoPE
    parameters standardized as the family's class does: importing any of transformers 5's
    family config classes (or AutoConfig, which imports them) loads its type validators, which
    import torch.distributed.tensor, sympy and accelerate: ~70 MB resident, a seventh of
    ``pagedq chat``'s peak, for a dozen integers. Other model types go through AutoConfig (the
    engine then names them unsupported).
    """
    # transformers costs ~2-3 s to import: the engine package and the worker's service import
    # this module without needing it until a model loads.
    from transformers import PretrainedConfig

    data = json.loads((Path(path) / "config.json").read_text())
    defaults = FAMILY_DEFAULTS.get(data.get("model_type", ""))
    if defaults is None:
        from transformers import AutoConfig  # a family pagedq does not run: the full class

        return AutoConfig.from_pretrained(Path(path))
    rope_keys = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor")
    # RoPE keys are standardized below, once every other field (max_position_embeddings) is set
    config = PretrainedConfig.from_dict({k: v for k, v in {**defaults, **data}.items()
                                         if k not in rope_keys})
    config.model_type = data["model_type"]  # the base class's is "" (a class attribute)
    config._name_or_path = str(path)  # as from_pretrained sets it (AutoTokenizer reads it)
    if config.head_dim is None:
        config.head_dim = config.hidden_size // config.num_attention_heads
    if config.num_key_value_heads is None:
        config.num_key_value_heads = config.num_attention_heads
    config.rope_parameters = data.get("rope_parameters")
    extra = {k: data[k] for k in rope_keys[1:] if k in data}
    config.convert_rope_params_to_dict(**extra)  # legacy rope_theta / rope_scaling, as 5.x does
    return config


def weight_files(path: Path) -> list[Path]:
    """Checkpoint files in load order: safetensors if any (as transformers prefers), else .bin."""
    path = Path(path)
    for index_name, pattern in (
        ("model.safetensors.index.json", "*.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
    ):
        index = path / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return [path / name for name in sorted(set(weight_map.values()))]
        # Mistral repos also ship consolidated.safetensors (same weights, other names): skip it.
        files = sorted(f for f in path.glob(pattern) if not f.name.startswith("consolidated"))
        if files:
            return files
    raise ModelNotFoundError(
        f"No weights in {path}: expected model*.safetensors (optionally sharded with "
        f"model.safetensors.index.json) or pytorch_model*.bin. Re-save the model with "
        f"save_pretrained, or pass a .gguf file instead."
    )


def iter_weights(path: Path, huge_pages: bool = False) -> Iterator[tuple[str, Weight]]:
    """Yield (checkpoint name, tensor) one at a time, so peak memory stays ~one tensor.

    safetensors are opened lazily (each tensor is read on demand); .bin files are memory-mapped.
    Names are exactly the checkpoint's (Hugging Face names); dtypes are the checkpoint's too. A
    packed GGUF conversion yields its GGUF's tensors, blocks kept (QuantWeight), on huge pages
    with ``huge_pages`` (iter_gguf_weights).
    """
    source = packed_source(path)
    if source is not None:
        yield from iter_gguf_weights(source, huge_pages=huge_pages)
        return
    for file in weight_files(path):
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # pre-1.6 (non-zip) torch.save format cannot be mmapped
                state = torch.load(file, map_location="cpu", weights_only=True)
            yield from state.items()
            del state


def load_tokenizer(path: Path, config: PretrainedConfig | None = None
                   ) -> PreTrainedTokenizerBase | None:
    """The model's tokenizer, or None for a token-id-only model directory (``config``: the
    model's, from :func:`load_config`, when the caller has it)."""
    path = Path(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        log.info("no tokenizer files; token ids only", model=str(path))
        return None
    from transformers import AutoTokenizer  # start-up cost: see load_config

    if config is None and (path / "config.json").is_file():
        config = load_config(path)
    # given the config, AutoTokenizer does not build its own through AutoConfig (see load_config)
    extra = {} if config is None else {"config": config}
    return AutoTokenizer.from_pretrained(path, **extra)
