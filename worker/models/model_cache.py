"""pagedq's model cache: where converted models live, and converting a GGUF into it.

A GGUF is turned once into a directory in Hugging Face layout under :func:`cache_dir`: config,
tokenizer and either its tensors dequantized to fp32 or, packed, a marker naming the GGUF whose
blocks the weights are read from (:func:`packed_source`). The loader resolves a model name to
such a directory; the bundled default model (default_model.py) is made the same way. Both import
this module and neither imports the other's caller.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedq.errors import ModelNotFoundError
from pagedq.file_lock import file_lock
from pagedq.logging import get_logger
from pagedq.progress import waiting
from pagedq.worker.config import settings
from pagedq.worker.models.gguf_config import TOKENS, gguf_config
from pagedq.worker.models.gguf_file import GGUFIndex, read_index
from pagedq.worker.models.gguf_tokenizer import TOKENIZER_ARRAYS, bpe_tokenizer

__all__ = [
    "cache_dir",
    "convert_gguf",
    "file_lock",
    "gguf_cache_path",
    "is_converted",
    "packed_source",
    "prune_stale_conversions",
    "release_freed_heap",
]

log = get_logger(__name__)


def cache_dir() -> Path:
    """pagedq's own cache ($PAGEDQ_CACHE or ~/.cache/pagedq): converted GGUF and default models."""
    root = settings().cache_dir
    root.mkdir(parents=True, exist_ok=True)
    return root



def gguf_cache_path(gguf_file: Path, packed: bool = False) -> Path:
    """Where a GGUF file's conversion lives: keyed by path, size and mtime so edits re-convert;
    ``packed`` conversions (config and tokenizer only) apart from fp32 ones."""
    gguf_file = Path(os.path.abspath(gguf_file))
    st = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{gguf_file.stem}-{key}{'-packed' if packed else ''}"


def convert_gguf(gguf_file: Path, out_dir: Path, weights: bool = True) -> Path:
    """Write a GGUF checkpoint as a Hugging Face directory at ``out_dir`` (once): config,
    tokenizer and, with ``weights``, the tensors dequantized to fp32. Without them the directory
    names its GGUF (:func:`packed_source`) and the weights are read from there, packed.

    transformers reads GGUF but refuses to ``save_pretrained`` what it read, so the state dict is
    written with safetensors directly. The result appears atomically (temp dir + rename) and a
    file lock serialises concurrent converters, so a crash or a race never leaves a half cache.
    Returns ``out_dir``; if it already holds a conversion nothing is done.
    """
    gguf_file, out_dir = Path(os.path.abspath(gguf_file)), Path(out_dir)
    if is_converted(out_dir):
        return out_dir
    if not gguf_file.is_file():
        raise ModelNotFoundError(f"GGUF file {gguf_file} does not exist; pass an existing .gguf.")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out_dir.with_name(out_dir.name + ".lock")):
        if is_converted(out_dir):  # another process finished while we waited
            return out_dir
        _make_room(out_dir)  # fail fast, before the slow part
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            what = "safetensors" if weights else "config and tokenizer (weights stay in the GGUF)"
            with waiting(f"converting {gguf_file.name} to {what} (once; kept in "
                         f"{out_dir.parent})", log, delay=0, gguf=str(gguf_file), out=str(out_dir)):
                _write_converted(gguf_file, tmp, weights)
                _make_shareable(tmp)
                os.rename(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if out_dir.parent == cache_dir() / "gguf":  # the cache only, never a directory of the caller's
        prune_stale_conversions(out_dir.parent, keep=out_dir)
    release_freed_heap()
    return out_dir


def prune_stale_conversions(directory: Path, keep: Path) -> list[Path]:
    """Remove the conversions in ``directory`` that no lookup can reach any more: their GGUF
    is gone, or it changed (size or mtime) since, so gguf_cache_path now names another entry.

    Why: every edited or deleted GGUF (and every test run's temporary files) would otherwise
    leave its conversion behind for good, up to an fp32 copy of the weights each. Returns what
    was removed."""
    removed = []
    for entry in directory.iterdir():
        marker = entry / _DONE_MARKER
        # a dot-named entry is another process's conversion in progress (its temp dir, marker
        # written, not yet renamed): never ours to remove, even with its GGUF gone
        if entry == keep or entry.name.startswith(".") or not marker.is_file():
            continue
        try:
            source = Path(json.loads(marker.read_text())["source"])
            stale = not source.is_file() or gguf_cache_path(source, entry.name.endswith("-packed")) != entry
        except (OSError, ValueError, KeyError):
            continue  # unreadable or being written: not ours to judge now
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
            entry.with_name(entry.name + ".lock").unlink(missing_ok=True)
            removed.append(entry)
    if removed:
        log.info("removed stale GGUF conversions", count=len(removed), directory=str(directory))
    return removed


_DONE_MARKER = "pagedq_converted.json"


def is_converted(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds a finished conversion (the marker is written last)."""
    return (out_dir / _DONE_MARKER).is_file()


def packed_source(model_dir: Path) -> Path | None:
    """The GGUF whose blocks a packed conversion reads its weights from; None for a directory
    with weights of its own."""
    marker = Path(model_dir) / _DONE_MARKER
    if not marker.is_file():
        return None
    info = json.loads(marker.read_text())
    return Path(info["source"]) if info.get("packed") else None


def _make_shareable(directory: Path) -> None:
    """mkdtemp and safetensors create owner-only files; a model cache is meant to be shared."""
    directory.chmod(0o755)
    for file in directory.iterdir():
        file.chmod(0o644)


def _make_room(out_dir: Path) -> None:
    """Clear the way for the rename; never delete a non-empty directory we did not write."""
    if not out_dir.exists():
        return
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
        return
    raise ModelNotFoundError(
        f"Cannot write the converted model to {out_dir}: it exists and is not a pagedq "
        f"conversion (no {_DONE_MARKER}). Remove it or choose another output directory."
    )


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """transformers' GGUF loader draws tqdm bars; they would garble JSON logs, and its
    dequantizing bar sits at 100 % through the slow part that follows (our waits say what
    runs instead). Its GGUF module calls tqdm directly, so that name is swapped too."""
    # transformers costs ~2-3 s to import: only a conversion (once per GGUF) needs it here
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if was_enabled:
            hf_logging.enable_progress_bar()


def _write_converted(gguf_file: Path, out: Path, weights: bool = True) -> None:
    """Save ``gguf_file``'s config, tokenizer and (``weights``) fp32 tensors in HF layout.

    The metadata is read once, by pagedq's own reader: the config of the families the engine
    runs (gguf_config.py) and a byte-level BPE tokenizer (gguf_tokenizer.py) are built from it
    directly; transformers' GGUF readers (~+170 MB at peak for the bundled model's vocabulary)
    only build what those modules do not cover."""
    index = read_index(gguf_file, TOKENIZER_ARRAYS)
    if weights:
        _write_fp32(gguf_file, out)
    else:
        _write_config(index, out)
    with waiting("building the tokenizer from the GGUF's vocabulary", log):
        tokenizer = bpe_tokenizer(index)
        del index  # the vocabulary's lists, before the save
        if tokenizer is not None:
            tokenizer.save(out)
        else:
            _write_hf_tokenizer(gguf_file, out)
    (out / _DONE_MARKER).write_text(json.dumps(
        {"source": str(gguf_file), "size": gguf_file.stat().st_size, "packed": not weights}) + "\n")


def _write_hf_tokenizer(gguf_file: Path, out: Path) -> None:
    """transformers' tokenizer from the GGUF, for the vocabularies gguf_tokenizer.py does not
    build (sentencepiece, unigram)."""
    from transformers import AutoTokenizer  # start-up cost: see _quiet_progress_bars

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    except (ValueError, KeyError) as exc:  # a GGUF without tokenizer metadata is legal
        log.warning("gguf has no usable tokenizer; the model will take token ids only",
                    gguf=str(gguf_file), error=str(exc))
    else:
        tokenizer.save_pretrained(out)


def _write_fp32(gguf_file: Path, out: Path) -> None:
    """The model dequantized by transformers, saved with its config and generation config."""
    from transformers import AutoModelForCausalLM  # start-up cost: see _quiet_progress_bars

    with _quiet_progress_bars(), waiting("dequantizing the GGUF's weights", log):
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                     dtype=torch.float32)
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {
        k: v.detach().contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    with waiting("writing model.safetensors", log):
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    del state
    # The loaded config says "quantized with gguf"; the saved weights are plain fp32.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    del model


def _write_config(index: GGUFIndex, out: Path) -> None:
    """The model's config (and a generation config from it) read from the GGUF's metadata alone:
    built by gguf_config.py for the families it maps, by transformers' reader otherwise."""
    from transformers import GenerationConfig, PretrainedConfig  # see _quiet_progress_bars

    data = gguf_config(index, len(index.metadata.get(TOKENS) or []) or None)
    if data is None:
        from transformers import AutoConfig  # as above

        config = AutoConfig.from_pretrained(index.path.parent, gguf_file=index.path.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        head_dim = index.arch_int("attention.key_length")
        if head_dim and head_dim != config.hidden_size // config.num_attention_heads:
            config.head_dim = head_dim
        config.save_pretrained(out)
    else:
        (out / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        config = PretrainedConfig.from_dict({**data, "use_cache": True})  # the families' default
    GenerationConfig.from_model_config(config).save_pretrained(out)


def release_freed_heap() -> None:
    """Hand the heap that a conversion or a model load freed back to the OS: both free many
    temporaries among long-lived objects (transformers' GGUF reader builds ~160 MB of them for
    the bundled model's vocabulary), and glibc keeps such pages resident. No-op off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
