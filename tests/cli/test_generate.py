"""``pagedq chat`` / ``generate``: bad input fails before any weight loads, the KV cache is
sized for the prompts, and prompts come from files and stdin, on a tiny model with a real
tokenizer and chat template."""

from __future__ import annotations

import io
import json

import pytest

import pagedq.worker
from pagedq.worker.cli import main
from pagedq.worker.engine.sizing import blocks_for


@pytest.fixture
def engines(monkeypatch):
    """Every Engine the command builds (real engines, recorded)."""
    built = []

    class Recorded(pagedq.worker.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(pagedq.worker, "Engine", Recorded)
    return built


@pytest.fixture
def no_engine(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(pagedq.worker, "Engine", refuse)


@pytest.mark.parametrize("argv,message", [
    (["chat", ""], "empty"),
    (["generate", "   "], "empty"),
    (["chat", "@/no/such/file.txt"], "cannot read the prompt file"),
    (["chat", "hi", "--temperature", "-1"], "temperature"),
    (["chat", "hi", "--max-num-seqs", "0"], "max_num_seqs"),
    (["generate", "hi", "--max-tokens", "100000"], "max_tokens"),
])
def test_bad_input_fails_before_the_model_loads(tiny_text_model_dir, no_engine, capsys, argv,
                                                message):
    assert main([*argv, "--model", str(tiny_text_model_dir)]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last
    assert "Traceback" not in err and "loading the model" not in err


def test_one_shot_kv_cache_fits_the_prompts(tiny_text_model_dir, engines, capsys):
    prompts = ["The capital of France is", "Hello world! Queues"]
    argv = ["generate", *prompts, "--model", str(tiny_text_model_dir), "--max-tokens", "5",
            "--ignore-eos", "--json", "--block-size", "4"]
    assert main(argv) == 0
    engine = engines[0]
    lengths = [len(engine.tokenizer(p).input_ids) + 5 for p in prompts]
    assert engine.config.num_kv_blocks == blocks_for(lengths, 4)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == prompts
    assert all(len(r["token_ids"]) == 5 for r in rows)


def test_a_size_given_is_kept(tiny_text_model_dir, engines):
    argv = ["chat", "hi", "--model", str(tiny_text_model_dir), "--max-tokens", "2",
            "--kv-cache-memory", "1MiB", "--json"]
    assert main(argv) == 0
    assert engines[0].config.num_kv_blocks is None
    assert engines[0].config.kv_cache_memory == 1 << 20


def test_prompts_from_a_file_and_stdin_equal_the_argument(tiny_text_model_dir, tmp_path,
                                                          monkeypatch, capsys):
    text = "The capital of Italy is"
    (tmp_path / "prompt.txt").write_text(text)
    common = ["--model", str(tiny_text_model_dir), "--max-tokens", "4", "--json"]
    outputs = []
    for source in (text, f"@{tmp_path / 'prompt.txt'}", "-"):
        monkeypatch.setattr("sys.stdin", io.StringIO(text))
        assert main(["chat", source, *common]) == 0
        outputs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outputs[0] == outputs[1] == outputs[2]


def test_chat_applies_the_template_and_generate_does_not(tiny_text_model_dir, engines, capsys):
    for command in ("chat", "generate"):
        assert main([command, "Hello", "--model", str(tiny_text_model_dir), "--max-tokens", "2",
                     "--json"]) == 0
    chat, plain = engines
    tok = chat.tokenizer
    templated = tok.apply_chat_template([{"role": "user", "content": "Hello"}],
                                        add_generation_prompt=True, tokenize=False)
    # each one-shot cache holds exactly its prompt + 2 tokens
    assert chat.kv.pool.num_blocks == blocks_for(
        [len(tok(templated, add_special_tokens=False).input_ids) + 2], chat.config.block_size)
    assert plain.kv.pool.num_blocks == blocks_for([len(tok("Hello").input_ids) + 2],
                                                  plain.config.block_size)


def test_chat_runs_the_bundled_model_packed(engines, capsys):
    """`pagedq chat` with no --model runs the bundled GGUF as shipped (the engine's rule for
    quantization "auto"): the engine's weight form keeps the GGUF's blocks, read from the GGUF
    the cache already holds (no second fetch), with no fp32 conversion; weights about the
    file's size."""
    import torch

    from pagedq.worker.models.build import WeightForm
    from pagedq.worker.models.default_model import default_gguf, default_model_dir
    from pagedq.worker.models.model_cache import packed_source

    fp32_dir = default_model_dir(packed=False)
    # other tests of the session may have made the fp32 conversion: this one must not touch it
    before = fp32_dir.stat().st_mtime_ns if fp32_dir.exists() else None
    assert main(["chat", "What is the capital of France?", "--max-tokens", "24"]) == 0
    assert "Paris" in capsys.readouterr().out
    (engine,) = engines
    assert engine.weight_form == WeightForm("keep", torch.float32) and engine.packed_weights
    gguf = packed_source(engine.model_path)
    assert gguf == default_gguf() and gguf.suffix == ".gguf"
    assert (fp32_dir.stat().st_mtime_ns if fp32_dir.exists() else None) == before
    assert engine.model_path != fp32_dir
    assert engine.stats()["weight_bytes"] <= 1.1 * gguf.stat().st_size


def test_generate_runs_the_bundled_model_packed(engines):
    import torch

    from pagedq.worker.models.build import WeightForm

    assert main(["generate", "The capital of France is", "--max-tokens", "4", "--json"]) == 0
    assert engines[0].weight_form == WeightForm("keep", torch.float32)
