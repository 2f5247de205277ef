"""Model resolution and loading, checked against transformers loading the same files.

The default-model tests share one session-scoped conversion (~40 s on a laptop CPU) into a
temporary PAGEDQ_CACHE; everything else uses tiny saved models and takes milliseconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedq.errors import ModelNotFoundError
from pagedq.worker.config import settings
from pagedq.worker.models import default_model
from pagedq.worker.models.loader import (
    iter_weights,
    load_config,
    load_tokenizer,
    resolve_model,
    weight_files,
)
from pagedq.worker.models.model_cache import cache_dir, convert_gguf, gguf_cache_path, is_converted


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
    settings.cache_clear()
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
    assert "`hf download ORG/NAME`" in message


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


def test_gguf_only_repo_in_hf_cache_converts(tiny_gguf_factory, isolated_env, tmp_path):
    """A GGUF repo in the HF cache: the file is a symlink to a blob named by its hash."""
    src, gguf = tiny_gguf_factory(False)
    repo_files = tmp_path / "repo-files"
    repo_files.mkdir()
    shutil.copy(gguf, repo_files / gguf.name)
    commit = "fedcba9876543210fedcba9876543210fedcba98"
    snapshot = _fake_hf_cache(isolated_env / "hf-hub", "tiny-org/tiny-llama-GGUF", repo_files,
                              commit)
    path = resolve_model("tiny-org/tiny-llama-GGUF")
    assert path == gguf_cache_path(snapshot / gguf.name)
    assert path.name.startswith("tiny-llama.F32-")
    assert load_config(path).architectures == ["LlamaForCausalLM"]
    names = {name for name, _ in iter_weights(path)}
    assert names == {name for name, _ in iter_weights(src)}


def test_repo_id_resolves_from_hf_home(tiny_model_dir, isolated_env, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(isolated_env / "hf-home"))
    settings.cache_clear()
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    snapshot = _fake_hf_cache(isolated_env / "hf-home" / "hub", "tiny-org/tiny-qwen2",
                              tiny_model_dir("qwen2"), commit)
    assert resolve_model("tiny-org/tiny-qwen2") == snapshot


def test_the_suite_never_writes_into_the_users_cache():
    """tests/conftest.py gives the session a temporary pagedq cache, subprocesses included."""
    from tests.conftest import BUNDLED_GGUF, SESSION_CACHE

    assert cache_dir() == SESSION_CACHE != Path.home() / ".cache" / "pagedq"
    assert os.environ["PAGEDQ_CACHE"] == str(SESSION_CACHE)
    assert BUNDLED_GGUF == default_model.GGUF_FILENAME


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


# ------------------------------------------------------------------ GGUF (tiny, written here)

GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
SPECIALS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


def _byte_level_bpe(vocab_size: int) -> dict:
    """A GPT-2-style byte-level BPE trained on a few sentences (what llama.cpp calls 'gpt2')."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello there"] * 20
    tok.train_from_iterator(corpus, trainer)
    return json.loads(tok.to_str())["model"]


def write_tiny_gguf(src: Path, out: Path) -> Path:
    """Write the tiny HF llama at ``src`` as an F32 GGUF the way llama.cpp's converter does
    (its tensor names, q/k rows permuted for its rope layout, a tokenizer, no output.weight when
    tied), so the original model is an oracle for the whole GGUF -> pagedq round trip."""
    import gguf
    import numpy as np
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(src)
    bpe = _byte_level_bpe(cfg.vocab_size)
    tokens = sorted(bpe["vocab"], key=bpe["vocab"].get)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3: control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    heads = {"self_attn.q_proj": cfg.num_attention_heads,
             "self_attn.k_proj": cfg.num_key_value_heads}
    for name, tensor in iter_weights(src):
        v = tensor.numpy()
        if name in GGUF_NAMES:
            gguf_name = GGUF_NAMES[name]
        else:
            _, _, layer, *module, _ = name.split(".")
            module = ".".join(module)
            gguf_name = f"blk.{layer}.{GGUF_LAYER_NAMES[module]}.weight"
            if module in heads:
                n = heads[module]
                v = v.reshape(n, 2, v.shape[0] // n // 2, *v.shape[1:]).swapaxes(1, 2)
        w.add_tensor(gguf_name, np.ascontiguousarray(v.reshape(tensor.shape)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="session")
def tiny_gguf_factory(tiny_model_dir, tmp_path_factory):
    """tied -> (original HF dir, GGUF file written from it), cached per session."""
    made: dict[bool, tuple[Path, Path]] = {}

    def make(tied: bool) -> tuple[Path, Path]:
        if tied not in made:
            src = tiny_model_dir("llama", tie_word_embeddings=tied)
            out = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
            made[tied] = src, write_tiny_gguf(src, out)
        return made[tied]

    return make


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def tiny_gguf(request, tiny_gguf_factory):
    return tiny_gguf_factory(request.param)



def test_stale_conversions_are_removed_when_the_next_one_is_made(tiny_gguf_factory, isolated_env,
                                                                  tmp_path):
    """A conversion whose GGUF was deleted, or changed since (another cache key), is removed the
    next time a conversion is written; the live ones stay."""
    _, gguf = tiny_gguf_factory(False)
    gone, edited, other = (tmp_path / f"{n}.gguf" for n in ("gone", "edited", "other"))
    for copy in (gone, edited, other):
        shutil.copy(gguf, copy)
    gone_dir, edited_dir = resolve_model(gone), resolve_model(edited)
    live = resolve_model(gguf)
    gone.unlink()
    os.utime(edited, ns=(1, 1))  # same bytes, another mtime: gguf_cache_path names a new entry
    assert gguf_cache_path(edited) != edited_dir
    resolve_model(other)
    assert not gone_dir.exists() and not edited_dir.exists()
    assert is_converted(live) and is_converted(gguf_cache_path(other))
    assert not gone_dir.with_name(gone_dir.name + ".lock").exists()


def test_a_conversion_in_progress_is_never_pruned(tiny_gguf_factory, isolated_env, tmp_path):
    """Another process's temp dir (marker written, rename to come) survives a prune even when
    its GGUF is gone: removing it failed that process's conversion (seen in the test suite)."""
    _, gguf = tiny_gguf_factory(False)
    gone = tmp_path / "gone.gguf"
    shutil.copy(gguf, gone)
    done = resolve_model(gone)
    busy = done.with_name(f".{done.name}.tmp-abc")
    shutil.copytree(done, busy)
    gone.unlink()
    resolve_model(gguf)  # a new conversion prunes the stale ones
    assert not done.exists() and is_converted(busy)


def _logits(model_dir: Path, ids: list[int], **kwargs) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              **kwargs).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def test_gguf_converts_once_and_matches_the_original(tiny_gguf, isolated_env):
    import transformers

    src, gguf = tiny_gguf
    path = resolve_model(gguf)
    assert path == gguf_cache_path(gguf) and path.parent == cache_dir() / "gguf"
    assert is_converted(path)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(gguf)) == path  # cached: nothing rewritten
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]

    config = load_config(path)
    assert not hasattr(config, "quantization_config")
    assert config.architectures == ["LlamaForCausalLM"]
    original = load_config(src)
    assert config.tie_word_embeddings == original.tie_word_embeddings
    assert ("lm_head.weight" in dict(iter_weights(path))) != original.tie_word_embeddings

    tokenizer = load_tokenizer(path)
    oracle_tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    text = "hello world, the lazy fox 😀"
    ids = tokenizer.encode(text)
    assert ids == oracle_tok.encode(text)
    assert tokenizer.decode(ids) == text
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False) == "<s>user: hi</s>"

    ids = [5, 9, 33, 200, 7, 300, 11]  # the original model's vocabulary is larger than the BPE's
    expected = _logits(src, ids)
    assert torch.equal(_logits(path, ids), expected)
    assert torch.equal(_logits(gguf.parent, ids, gguf_file=gguf.name), expected)
    # Every converted tensor is bit-identical to the original checkpoint's.
    original_weights = dict(iter_weights(src))
    for name, tensor in iter_weights(path):
        assert torch.equal(tensor, original_weights[name]), name


def test_dir_with_one_gguf_resolves_to_its_conversion(tiny_gguf, isolated_env):
    _, gguf = tiny_gguf
    assert resolve_model(gguf.parent) == gguf_cache_path(gguf)


def test_concurrent_conversions_do_not_clash(tiny_gguf_factory, isolated_env):
    """Two processes resolving the same new GGUF at once: one converts, the other waits for it."""
    _, gguf = tiny_gguf_factory(False)
    code = (
        "import sys; from pagedq.worker.models.loader import resolve_model; "
        "print(resolve_model(sys.argv[1]))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(gguf)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=os.environ.copy())
        for _ in range(2)
    ]
    results = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), results
    assert {out.strip() for out, _ in results} == {str(gguf_cache_path(gguf))}
    assert sum(err.count("done: converting") for _, err in results) == 1
    siblings = sorted(p.name for p in gguf_cache_path(gguf).parent.iterdir())
    assert siblings == [gguf_cache_path(gguf).name, gguf_cache_path(gguf).name + ".lock"]


def test_failed_conversion_leaves_nothing(isolated_env, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)  # right magic, garbage after it
    with pytest.raises(Exception):  # noqa: B017 - whatever the GGUF parser raises
        resolve_model(bad)
    out = gguf_cache_path(bad)
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir()] == [out.name + ".lock"]


# ------------------------------------------------------------------ the default model


@pytest.fixture(scope="session")
def default_model_dir():
    """The default model in the session's pagedq cache (converted on first use, ~40 s, then
    shared with the session's later tests; $PAGEDQ_TEST_CACHE keeps it between sessions)."""
    return default_model.ensure_default_model()


def test_default_model_second_use_is_cached(default_model_dir, monkeypatch):
    path = default_model_dir
    assert path == cache_dir() / "models" / default_model.DEFAULT_MODEL_NAME
    assert is_converted(path)
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    # Second use needs no GGUF at all (a bogus source proves it is not looked at).
    monkeypatch.setenv(default_model.GGUF_ENV, str(path / "no-such.gguf"))
    settings.cache_clear()
    assert default_model.ensure_default_model() == path
    assert resolve_model(None) == path
    assert weights.stat().st_mtime_ns == stamp


def test_default_model_cli_prints_the_path(default_model_dir):
    proc = subprocess.run([sys.executable, "-m", "pagedq.worker.models.default_model"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(default_model_dir)


def test_default_model_config_and_tokenizer(default_model_dir):
    path = default_model_dir
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
    assert prompt.startswith("<|im_start|>system\n")  # the template's default system prompt
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    text = "Hello, wörld! 日本語 😀"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_default_model_logits_match_gguf_loaded_transformers(default_model_dir, tmp_path):
    """The oracle: transformers loading the very GGUF we converted (fetched again if needed)."""
    gguf = default_model._find_gguf(tmp_path)
    ids = load_tokenizer(default_model_dir).encode("The capital of France is")
    expected = _logits(gguf.parent, ids, gguf_file=gguf.name)
    assert torch.equal(_logits(default_model_dir, ids), expected)
