"""``pagedq demo`` end to end on a tiny model: an embedded Redis, a worker in the process, the
prompts submitted together, every answer printed, and a final stats row written after the
last answer (nothing running, no KV block held)."""

from __future__ import annotations

from pagedq.worker.cli import main


def test_demo_streams_every_prompt_and_ends_on_fresh_stats(tiny_text_model_dir, capsys):
    prompts = ["Hello world", "The capital of France is", "Queues and workers"]
    code = main(["demo", *prompts, "--model", str(tiny_text_model_dir), "--max-tokens", "12",
                 "--ignore-eos", "--num-kv-blocks", "512", "--block-size", "4"])
    out = capsys.readouterr().out
    assert code == 0
    for i, prompt in enumerate(prompts, 1):
        assert f"[{i}] >>> {prompt}" in out
    assert out.count("it reached the token limit (--max-tokens) (12 tokens generated") == 3
    row = next(line for line in out.splitlines() if line.startswith("demo "))
    name, state, jobs, running, waiting, kv, *_ = row.split()
    assert (state, jobs, running, waiting, kv) == ("serving", "0", "0", "0", "0/512")


def test_demo_rejects_a_bad_prompt_before_starting_anything(capsys):
    assert main(["demo", ""]) == 2
    assert "empty" in capsys.readouterr().err
