"""The kernel switches are EngineConfig fields: flags on every engine command, defaulting to the
environment (PAGEDQ_CPU_KERNEL, PAGEDQ_ONEDNN, PAGEDQ_FUSED_LAYER, PAGEDQ_CPU_ISA), and what the
engine's backend selector is given."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from pagedq.kernel_switches import DEFAULT_PACKED_PRECISION, PACKED_GEMM_PRECISIONS
from pagedq.kernels.backend import PACKED_PRECISIONS
from pagedq.params import SamplingParams
from pagedq.worker import Engine
from pagedq.worker.config import EngineConfig
from pagedq.worker.config_flags import add_engine_flags, engine_knobs, to_flags
from tests.oracle import assert_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_the_switches_are_flags():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--no-cpu-kernels", "--no-onednn", "--fused-layer",
                              "--cpu-isa", "avx2"])
    config = EngineConfig(**engine_knobs(args))
    assert (config.cpu_kernels, config.onednn, config.fused_layer, config.cpu_isa) == \
        (False, False, True, "avx2")
    switches = config.kernel_switches()
    assert (switches.cpu_kernels, switches.onednn, switches.fused_layer) == (False, False, True)
    assert "--no-cpu-kernels" in to_flags(config) and "--no-onednn" in to_flags(config)


def test_the_defaults_come_from_the_environment():
    """A fresh process with PAGEDQ_* set: EngineConfig's defaults (and --help's) follow them."""
    code = ("from pagedq.worker.config import EngineConfig as C; c = C(); "
            "print(c.cpu_kernels, c.onednn, c.fused_layer, c.cpu_isa)")
    base = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}

    def defaults(env: dict[str, str]) -> list[str]:
        return subprocess.run([sys.executable, "-c", code], env={**base, **env},
                              capture_output=True, text=True, check=True).stdout.split()

    assert defaults({"PAGEDQ_CPU_KERNEL": "0", "PAGEDQ_ONEDNN": "off", "PAGEDQ_FUSED_LAYER": "no",
                     "PAGEDQ_CPU_ISA": "avx2"}) == ["False", "False", "False", "avx2"]
    assert defaults({}) == ["True", "True", "True", "auto"]


def test_one_default_precision_and_one_list_of_names():
    assert EngineConfig().packed_gemm_precision == DEFAULT_PACKED_PRECISION
    assert tuple(PACKED_PRECISIONS) == PACKED_GEMM_PRECISIONS


def test_an_engine_runs_the_kernels_its_config_switches_on(cpu_ops, tiny_model_dir):
    """--no-cpu-kernels reaches the selector: the engine runs SDPA and torch linears, and its
    output is still transformers' greedy output."""
    model = tiny_model_dir("llama", hidden_size=64, intermediate_size=128)
    off = Engine(str(model), num_kv_blocks=64, cpu_kernels=False)
    assert off.model.backend.attention == "sdpa" and off.model.backend.ops is None
    assert any("--no-cpu-kernels" in why for why in off.model.backend.reasons)
    prompt = list(range(3, 30))
    out = off.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert_greedy(model, prompt, out)
    unfused = Engine(str(model), num_kv_blocks=64, fused_layer=False)
    assert unfused.model.backend.attention == "cpp" and unfused.model.backend.layer == "python"
