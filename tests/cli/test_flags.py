"""Every config field is a flag of every command that takes it, with the dataclass's default.

The sample values below are written out by hand (not derived from the code under test): a new
EngineConfig or WorkerConfig field fails ``test_samples_cover_every_field`` until it is added
here, and then every other test checks that each command carries it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from pagedq.bench.command import config_from_args
from pagedq.bench.options import BenchConfig
from pagedq.client.connection import TLSFiles
from pagedq.params import SamplingParams
from pagedq.worker.cli import COMMANDS, build_parser
from pagedq.worker.cli.generate import sampling_from_args
from pagedq.worker.cli.worker_command import standalone_parser, worker_config
from pagedq.worker.config import EngineConfig, QueueConfig, WorkerConfig
from pagedq.worker.config_flags import engine_knobs, field_docs, to_flags

ENGINE_SAMPLE = {
    "model": "/models/tiny", "dtype": "bfloat16", "kv_cache_dtype": "float16", "device": "cpu",
    "block_size": 4, "num_kv_blocks": 99, "kv_cache_memory": 123456,
    "gpu_memory_utilization": 0.5, "max_num_seqs": 7, "max_num_batched_tokens": 33,
    "max_model_len": 777, "long_prefill_token_threshold": 16, "enable_chunked_prefill": False,
    "enable_prefix_caching": False, "num_threads": 3, "seed": 11, "grammar_cache_size": 5,
    "grammar_compile_threads": 3, "grammar_compile_timeout": 2.5, "quantization": "int4",
    "packed_gemm_precision": "bf16", "packed_activations": "int8", "cpu_isa": "avx2",
    "kernel_crossovers": "table",
    "adaptive_threads": False,
    "cpu_kernels": False, "onednn": False, "fused_layer": False, "huge_pages": False,
    "speculative_config": {"method": "suffix", "num_speculative_tokens": 3,
                           "prompt_lookup_min": 1, "prompt_lookup_max": 4,
                           "suffix_decoding_max_tree_depth": 8,
                           "suffix_decoding_max_cached_requests": 50,
                           "disable_by_batch_size": 4, "adaptive": False},
}
WORKER_SAMPLE = {
    "redis_url": "redis://h:1/2", "queue": "q2", "prefix": "px", "consumer_name": "c1",
    "reclaim_after": 4.5, "max_deliveries": 9, "ttl": 77, "checkpoint_interval": 0.25,
    "checkpoint_ttl": 8.0, "drain_timeout": 2.5, "poll_interval": 0.3,
    "ownership_check_interval": 1.5, "read_block_ms": 250, "prompt_len_hint": 64,
    "metrics_port": 9100, "metrics_host": "0.0.0.0", "redis_ca": "/tls/ca.crt",
    "redis_cert": "/tls/client.crt", "redis_key": "/tls/client.key", "solo_deaths": 4,
    "max_request_bytes": 4096, "max_prompt_tokens": 99, "max_n": 3, "max_logprobs": 5,
    "max_stop": 2, "max_stop_chars": 8, "dead_letter_entry_bytes": 512,
    "dead_letter_max_bytes": 65536,
}
# WorkerConfig fields carried by other flags: --model, and the engine group
WORKER_VIA_ENGINE = {"model", "engine"}
ENGINE_COMMANDS = ("generate", "chat", "worker", "bench", "demo", "serve", "batch")
POSITIONAL = {"generate": ["hi"], "chat": ["hi"], "submit": ["hi"], "batch": ["in.jsonl", "-o", "o.jsonl"]}


def argv(sample: dict) -> list[str]:
    out: list[str] = []
    for name, value in sample.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):  # a nested config: JSON
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def parse(command: str, *flags: str) -> argparse.Namespace:
    return build_parser().parse_args([command, *POSITIONAL.get(command, []), *flags])


def engine_config_of(command: str, args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the command builds from its flags."""
    if command == "worker":
        wc = worker_config(args)
        return EngineConfig(**({"model": wc.model} if wc.model else {}), **wc.engine)
    if command == "bench":
        return config_from_args(args).engine_config()
    return EngineConfig(**engine_knobs(args))


def test_samples_cover_every_field():
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    worker_fields = {f.name for f in dataclasses.fields(WorkerConfig)}
    assert set(ENGINE_SAMPLE) == engine_fields
    assert set(WORKER_SAMPLE) | WORKER_VIA_ENGINE == worker_fields
    for sample, cls in ((ENGINE_SAMPLE, EngineConfig), (WORKER_SAMPLE, WorkerConfig)):
        defaults = cls()
        for name, value in sample.items():
            assert value != getattr(defaults, name), f"{name}: pick a non-default sample"


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_every_engine_field_is_a_flag(command):
    config = engine_config_of(command, parse(command, *argv(ENGINE_SAMPLE)))
    assert dataclasses.asdict(config) == ENGINE_SAMPLE


@pytest.mark.parametrize("command", ("generate", "chat", "worker", "demo"))
def test_engine_defaults_are_the_dataclass_defaults(command):
    assert engine_config_of(command, parse(command)) == EngineConfig()


def test_bench_engine_defaults_are_the_dataclass_defaults_but_its_context_length():
    """The bench pins max_model_len (llama-server needs a context size, and figures must not
    depend on the model's); every other engine knob keeps EngineConfig's default."""
    got = dataclasses.asdict(engine_config_of("bench", parse("bench")))
    want = dataclasses.asdict(EngineConfig())
    assert {k for k in got if got[k] != want[k]} == {"max_model_len"}
    assert got["max_model_len"] == BenchConfig().max_model_len == 2048


def test_every_worker_field_is_a_flag():
    args = parse("worker", *argv(WORKER_SAMPLE), "--model", "/models/tiny", "--max-num-seqs", "5")
    config = worker_config(args)
    for name, value in WORKER_SAMPLE.items():
        assert getattr(config, name) == value, name
    assert config.model == "/models/tiny" and config.engine == {"max_num_seqs": 5}


def test_worker_defaults_are_the_dataclass_defaults():
    assert worker_config(parse("worker")) == WorkerConfig()


def test_python_m_worker_takes_the_same_flags_as_pagedq_worker():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))

    def options(parser: argparse.ArgumentParser) -> set[str]:
        return {s for a in parser._actions for s in a.option_strings}

    assert options(sub.choices["worker"]) == options(standalone_parser())
    args = standalone_parser().parse_args(argv(WORKER_SAMPLE))
    assert worker_config(args) == worker_config(parse("worker", *argv(WORKER_SAMPLE)))


def test_to_flags_rebuilds_the_config():
    """The bench starts its worker subprocess with to_flags(config): it must round-trip."""
    config = EngineConfig(**ENGINE_SAMPLE)
    assert engine_config_of("worker", parse("worker", *to_flags(config))) == config
    assert to_flags(EngineConfig()) == []


def test_deprecated_spellings_still_work():
    config = engine_config_of("worker", parse("worker", "--threads", "2", "--no-prefix-caching"))
    assert config.num_threads == 2 and config.enable_prefix_caching is False
    assert config_from_args(parse("bench", "--threads", "2")).num_threads == 2


def test_every_field_has_user_facing_help():
    for cls in (EngineConfig, WorkerConfig):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name != "engine":
                assert len(docs.get(f.name, "")) > 10, f"{cls.__name__}.{f.name} has no help"
    help_text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    assert "--max-num-seqs" in help_text and "Most sequences running at once" in help_text
    assert "(default: 64)" in help_text and "--no-enable-chunked-prefill" in help_text


def test_generate_seed_seeds_the_engine_and_each_request():
    args = parse("generate", "--seed", "5", "--temperature", "0.7", "--stop", "a", "--stop", "b")
    params = sampling_from_args(args)
    assert params.seed == 5 and params.temperature == 0.7 and params.stop == ["a", "b"]
    assert EngineConfig(**engine_knobs(args)).seed == 5
    unseeded = sampling_from_args(parse("generate"))
    assert unseeded.seed is None and unseeded.max_tokens == 128 and unseeded.temperature == 0.0


def test_submit_sampling_flags_build_sampling_params():
    args = parse("submit", "--n", "2", "--top-k", "5", "--seed", "3", "--ignore-eos")
    from pagedq.worker.cli.flags import COMMAND_SAMPLING, sampling_params

    params = sampling_params(args, COMMAND_SAMPLING["submit"])
    assert params == SamplingParams(n=2, top_k=5, seed=3, ignore_eos=True, max_tokens=64,
                                    temperature=0.0)


def test_each_command_shows_its_row_of_the_sampling_table():
    """One table (flags.COMMAND_SAMPLING) holds every command's sampling defaults; each
    command's --help states its row, and a command given no flag samples with it."""
    from pagedq.worker.cli.flags import COMMAND_SAMPLING, sampling_params

    assert set(COMMAND_SAMPLING) == {"generate", "chat", "submit", "demo"}
    sub = build_parser()._subparsers._group_actions[0]
    for command, row in COMMAND_SAMPLING.items():
        text = " ".join(sub.choices[command].format_help().split())
        help_line = text.split("--max-tokens N ")[-1].split("--")[0]
        assert f"(default: {row['max_tokens']})" in help_line, (command, help_line)
        args = parse(command)
        assert sampling_params(args, row) == SamplingParams(**row)


def test_every_command_is_registered():
    sub = build_parser()._subparsers._group_actions[0]
    registered = set(sub.choices)
    assert {c for cmds in COMMANDS.values() for c in cmds} <= registered
    assert {"generate", "chat", "worker", "submit", "stats", "demo", "bench"} <= registered


def test_log_level_is_one_flag_everywhere():
    """Every command's --log-level is config_flags.add_log_level_flag's: the same choices, any case."""
    from pagedq.worker.config_flags import LOG_LEVELS

    sub = build_parser()._subparsers._group_actions[0]
    having = []
    for command, parser in sub.choices.items():
        (action,) = [a for a in parser._actions if "--log-level" in a.option_strings] or [None]
        if action is None:
            continue
        having.append(command)
        assert tuple(action.choices) == LOG_LEVELS, command
        assert parse(command, "--log-level", "debug").log_level == "DEBUG"
    assert {"worker", "serve", "chat", "generate", "plan", "demo"} <= set(having)


QUEUE_SAMPLE = {"redis_url": "rediss://h:1/2", "redis_ca": "/tls/ca.crt",
                "redis_cert": "/tls/client.crt", "redis_key": "/tls/client.key", "queue": "q2",
                "prefix": "px", "ttl": 77}


@pytest.mark.parametrize("command", ("worker", "serve", "batch", "submit", "stats"))
def test_every_queue_command_takes_the_one_queue_config(command):
    """QueueConfig's fields are the same flags on every command that talks to the queue, and
    each command's config carries what they say."""
    from pagedq.gateway.commands import gateway_config
    from pagedq.worker.cli.queue_commands import queue_config

    assert {f.name for f in dataclasses.fields(QueueConfig)} == set(QUEUE_SAMPLE)
    args = parse(command, *argv(QUEUE_SAMPLE))
    config = {"worker": worker_config, "serve": gateway_config, "batch": gateway_config,
              "submit": queue_config, "stats": queue_config}[command](args)
    assert config.queue_config == QueueConfig(**QUEUE_SAMPLE)
    assert config.tls == TLSFiles("/tls/ca.crt", "/tls/client.crt", "/tls/client.key")
    options = config.client_options()
    assert (options["queue"], options["prefix"], options["ttl"]) == ("q2", "px", 77)


def test_the_bench_takes_the_queue_config_and_serves_a_queue_of_its_own():
    from pagedq.bench.options import quick

    config = quick().with_settings(["prefix=px", "ttl=77", "queue=stem", "redis_ca=/tls/ca.crt"])
    run = config.run_queue("rediss://h:1/2", "queue")
    assert run.queue.startswith("stem-queue-") and run.redis_url == "rediss://h:1/2"
    assert (run.prefix, run.ttl, run.tls) == ("px", 77, TLSFiles("/tls/ca.crt"))
    assert to_flags(run)[:2] == ["--redis-url", "rediss://h:1/2"] and "--redis-ca" in to_flags(run)
    with pytest.raises(ValueError, match="FIELD one of"):
        config.with_settings(["FLAG_HELP=x"])


def test_each_config_words_the_redis_url_for_its_command():
    """One field, one default; the help says what each command does without a URL."""
    helps = {cls: field_docs(cls)["redis_url"] for cls in (QueueConfig, WorkerConfig)}
    assert "localhost:6379" in helps[QueueConfig] and "starts" not in helps[QueueConfig]
    assert "else a new one" in helps[WorkerConfig]
