"""EngineConfig.cpu_isa: the engine runs the kernels of the level it is capped at, and refuses a
level its CPU lacks before loading anything (tests/kernels/test_isa_levels.py runs whole suites
per level; this checks the engine's own knob)."""

from __future__ import annotations

import pytest

from pagedq.kernels import UnsupportedIsaError
from pagedq.kernels.backend import process_cpu
from pagedq.params import SamplingParams
from pagedq.worker import Engine
from tests.oracle import assert_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("level", ["avx2", "avx2_vnni", "avx512", "avx512_vnni"])
def test_a_capped_engine_runs_that_levels_kernels(cpu_ops, tiny_model_dir, level):
    if level not in process_cpu().levels:
        pytest.skip(f"this CPU runs {', '.join(process_cpu().levels)}, not {level}")
    model = tiny_model_dir("llama", hidden_size=64, intermediate_size=128)
    engine = Engine(str(model), num_kv_blocks=64, cpu_isa=level, quantization="int8")
    backend = engine.model.backend
    assert backend.cpu.level == level
    assert all(("vnni" in c.kernel(1)) == (level == "avx512_vnni")
               for c in backend.packed if c.weight_format != "float32")
    # the many-row panel on AVX-VNNI's vpdpwssd at avx2_vnni only (the int8 weights' from 8 rows)
    assert all(("avx2-vnni" in c.kernel(64)) == (level == "avx2_vnni")
               for c in backend.packed if c.weight_format not in ("float32", "bf16"))
    prompt = list(range(3, 40))
    out = engine.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert len(out) == 6
    fp32 = Engine(str(model), num_kv_blocks=64, cpu_isa=level)
    ref = fp32.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert_greedy(model, prompt, ref)  # the fp32 model at this level: transformers'


def test_a_level_above_the_cpu_is_refused_before_loading(tmp_path):
    missing = [lvl for lvl in ("avx2_vnni", "avx512", "avx512_vnni", "amx")
               if lvl not in process_cpu().levels]
    if not missing:
        pytest.skip("this CPU runs every level")
    with pytest.raises(UnsupportedIsaError, match="this CPU runs"):
        Engine(str(tmp_path / "no-such-model"), cpu_isa=missing[-1])
