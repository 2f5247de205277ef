"""``pagedq plan``: the KV arithmetic from a model's config alone, checked against numbers
computed here from the same config."""

from __future__ import annotations

import json

import pagedq.worker
from pagedq.worker.cli import main
from pagedq.worker.cli.kv_plan import gib


def test_plan_prints_the_formula_and_the_need(tiny_text_model_dir, monkeypatch, capsys):
    monkeypatch.setattr(pagedq.worker, "Engine", None)  # no engine, no weights
    cfg = json.loads((tiny_text_model_dir / "config.json").read_text())
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4
    assert main(["plan", "--model", str(tiny_text_model_dir), "--concurrency", "10",
                 "--seq-len", "100", "--block-size", "8", "--kv-cache-memory", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert (f"2 x {cfg['num_hidden_layers']} layers x {kv_heads} KV heads x {head_dim} x 4 B = "
            f"{per_token:,} B") in out
    blocks = 10 * 13  # ceil(100 / 8) blocks per job
    assert f"10 jobs x 100 tokens = {blocks:,} blocks" in out
    assert f"--num-kv-blocks {blocks}" in out
    in_budget = (1 << 20) // (per_token * 8)
    assert f"= {in_budget:,} blocks" in out and f"{in_budget // 13:,} jobs of 100 tokens" in out


def test_plan_rejects_nonsense(capsys):
    assert main(["plan", "--concurrency", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_suggested_size_holds_the_need():
    from pagedq.worker.config import parse_bytes

    for need in (1, 5 << 20, (1 << 30) + 1, 1_509_949_440):
        assert parse_bytes(gib(need)) >= need


def test_plan_counts_the_weights_as_the_engine_keeps_them(tiny_text_model_dir, tmp_path, capsys):
    """A GGUF stays packed (its size, never an fp32 conversion); int8/int4 take ~1 / 0.625 B."""
    from pagedq.worker.cli.kv_plan import parameter_count
    from tests.gguf_files import write_gguf

    params = parameter_count(tiny_text_model_dir)
    for flag, per in (("float32", 4), ("int8", 1)):
        args = ["--dtype", flag] if flag == "float32" else ["--quantization", flag]
        assert main(["plan", "--model", str(tiny_text_model_dir), *args]) == 0
        assert f"{params / 1e6:,.1f} M parameters x {per:g} B" in capsys.readouterr().out
    gguf = write_gguf(tiny_text_model_dir, tmp_path / "m.gguf", "Q8_0")
    assert main(["plan", "--model", str(gguf)]) == 0
    out = capsys.readouterr().out
    assert "m.gguf kept packed" in out and f"{gguf.stat().st_size / 1e9:.2f} GB" in out
