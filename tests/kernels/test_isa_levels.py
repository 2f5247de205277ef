"""Every ISA level this machine runs passes the same tests (the issue's rule: a path tested only
where it was written is untested).

The rest of the suite runs at the machine's own level. Here, for each lower level, a fresh
process runs the kernel tests, the quantization fidelity tests and an engine batch of more than
64 rows on the default model with the CPU capped at that level: PAGEDQ_CPU_ISA for pagedq's
kernels (Python and C++), ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY and MKL_ENABLE_INSTRUCTIONS for
the libraries under torch (cpu_features.isa_environment). So an AMX machine runs what an AVX2 or
an AVX-512-without-AMX machine runs. A level this CPU lacks is skipped, saying so; an inner run
that tests nothing fails (tests/subprocess_pytest.py).
"""

from __future__ import annotations

import pytest

from pagedq.kernels.cpu_features import ISA_LEVELS, detect_cpu_features, isa_environment
from tests.subprocess_pytest import finish_pytest, start_pytest

MACHINE = detect_cpu_features()
SUITES = [
    "tests/kernels/test_quant_kernels.py",
    "tests/kernels/test_int8_acts.py",
    "tests/kernels/test_gemv.py",
    "tests/kernels/test_argmax.py",
    "tests/kernels/test_backend_packed.py",
    "tests/kernels/test_cpu_ops.py",
    # the attention kernel's AVX2 tiles (AVX-512 machines take its 16-lane path elsewhere)
    "tests/kernels/test_cpu_attention.py::test_every_group_size_and_head_dim",
    "tests/kernels/test_cpu_attention.py::test_decodes_over_one_shared_prefix",
    "tests/kernels/test_cpu_attention.py::test_groups_of_rows_sharing_different_prefixes",
    "tests/kernels/test_cpu_attention.py::test_half_caches_on_both_sides_of_the_avx512_threshold",
    "tests/models/test_fused_layer.py",
    "tests/models/test_quant_fidelity.py",
    "tests/models/test_default_model.py::test_a_batch_over_64_rows_follows_the_twin",
    "tests/models/test_default_model.py::test_the_engine_hands_over_where_this_machine_measured",
    "tests/kernels/test_crossover.py",
]
# The fidelity tests of every format on a tiny model, and the bundled file, run at every level;
# the bundled model's int8/int4 and re-quantized GGUF perplexities (minutes each, through the
# same kernels as the formats above) only at the machine's own level, to keep CI in budget.
DESELECT = "not bundled_perplexity and not gguf_of_the_bundled"


def lower_levels() -> list[str]:
    """The levels this machine runs below its own (the rest of the suite runs its own)."""
    return [lv for lv in ISA_LEVELS if lv in MACHINE.levels and lv != MACHINE.level]


@pytest.fixture(scope="module")
def inner_runs():
    """Every lower level's run, started at once: each is mostly single-threaded kernel and
    fidelity tests, so two levels side by side take about the time of one on 2 cores."""
    runs = {lv: start_pytest([*SUITES, "-k", DESELECT], isa_environment(lv)) for lv in lower_levels()}
    yield runs
    for run in runs.values():
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.communicate()


@pytest.mark.parametrize("level", ISA_LEVELS)
def test_every_level_this_machine_runs(level, inner_runs):
    if level not in MACHINE.levels:
        pytest.skip(f"this CPU ({MACHINE.summary()}) cannot run level {level}; it runs "
                    f"{', '.join(MACHINE.levels) or 'none'}")
    if level == MACHINE.level:
        pytest.skip(f"{level} is this machine's own level: the rest of the suite runs it")
    counts = finish_pytest(inner_runs[level])
    assert counts.get("failed", 0) == 0 and counts.get("error", 0) == 0, counts
