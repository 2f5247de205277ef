"""The backend selector (kernels/backend.py): which kernels run for each device, dtype, CPU and
switch setting, that the environment is read once, and the line it logs.

Machines are described with CpuFeatures.of(...) and switches with Switches(...), so no test
changes the environment. Rows that choose the C++ kernels need them to build here.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest
import structlog
import torch

from pagedq.kernels import (
    BackendUnavailableError,
    KernelArgumentError,
    Selector,
    Switches,
    paged_attention,
    plan_attention,
    reference_paged_attention,
)
from pagedq.kernels.backend import default_attention, portable_backend, process_selector
from pagedq.kernels.cases import make_case
from pagedq.kernels.cpu_features import CpuFeatures

AVX512 = CpuFeatures.of("avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512dq", "avx512_vnni",
                        "amx_tile", "amx_bf16", "amx_int8")
AVX2 = CpuFeatures.of("avx2", "fma", "f16c")
NO_AVX2 = CpuFeatures.of("fma", "f16c")
ARM = CpuFeatures.of(arch="aarch64")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
ONEDNN = "onednn" if torch.backends.mkldnn.is_available() else "torch"
ROOT = Path(__file__).resolve().parents[2]

# (cpu, switches, dtype, kv_dtype, head_dim) -> (attention, linear, norm, layer)
CPU_CASES = {
    "avx512": (AVX512, Switches(), F32, None, 64,
               ("cpp", f"cpp-skinny-avx512<=16+{ONEDNN}", "cpp", "cpp-fused")),
    "avx2": (AVX2, Switches(), F32, None, 64, ("cpp", f"cpp-skinny-avx2<=16+{ONEDNN}", "cpp", "cpp-fused")),
    "fp16-cache": (AVX512, Switches(), F32, F16, 64,
                   ("cpp", f"cpp-skinny-avx512<=16+{ONEDNN}", "cpp", "cpp-fused")),
    "no-onednn": (AVX512, Switches(onednn=False), F32, None, 64,
                  ("cpp", "cpp-skinny-avx512<=16+torch", "cpp", "cpp-fused")),
    "no-fused": (AVX512, Switches(fused_layer=False), F32, None, 64,
                 ("cpp", f"cpp-skinny-avx512<=16+{ONEDNN}", "cpp", "python")),
    "odd-head-dim": (AVX512, Switches(), F32, None, 12,
                     ("sdpa", f"cpp-skinny-avx512<=16+{ONEDNN}", "cpp", "python")),
    "bf16-model": (AVX512, Switches(), BF16, None, 64, ("cpp", "torch", "torch", "python")),
    "kernels-off": (AVX512, Switches(cpu_kernels=False), F32, None, 64, ("sdpa", ONEDNN, "torch", "python")),
    "no-avx2": (NO_AVX2, Switches(), F32, None, 64, ("sdpa", ONEDNN, "torch", "python")),
    "arm": (ARM, Switches(), F32, None, 64, ("sdpa", ONEDNN, "torch", "python")),
}


def chosen(backend) -> tuple[str, str, str, str]:
    return backend.attention, backend.linear_for("float32" if backend.dtype == F32 else "bfloat16").name, \
        backend.norm, backend.layer


@pytest.mark.parametrize("case", list(CPU_CASES))
def test_cpu_choices(case, request):
    cpu, switches, dtype, kv_dtype, head_dim, expected = CPU_CASES[case]
    if expected[0] == "cpp" or "cpp" in expected[1]:
        request.getfixturevalue("cpu_ops")  # skips where the C++ library cannot build
    backend = Selector(switches, cpu=cpu).select("cpu", dtype, kv_dtype, head_dim)
    assert chosen(backend) == expected
    assert backend.kv_write == "torch" and backend.device == "cpu" and backend.cpu is cpu
    assert (backend.ops is not None) == (expected[2] == "cpp" or expected[0] == "cpp")


def test_the_reasons_say_why(cpu_ops):
    off = Selector(Switches(cpu_kernels=False), cpu=AVX512).select("cpu")
    assert any("PAGEDQ_CPU_KERNEL=0" in r for r in off.reasons)
    assert any("lacks avx2" in r for r in Selector(cpu=CpuFeatures.of("fma", "f16c")).select("cpu").reasons)
    odd = Selector(cpu=AVX512).select("cpu", F32, None, 12)
    assert any("head_dim % 8" in r for r in odd.reasons)
    assert any("float32 models only" in r for r in Selector(cpu=AVX512).select("cpu", BF16).reasons)
    assert not any("float32 models only" in r for r in odd.reasons)


@pytest.mark.parametrize("has_triton", [True, False])
@pytest.mark.parametrize("dtype", [F16, BF16])
def test_cuda_choices(has_triton, dtype):
    """On CUDA the Triton kernels when triton imports, else SDPA; linears are torch's."""
    backend = Selector(cpu=AVX512, has_triton=has_triton).select("cuda", dtype)
    kernel = "triton" if has_triton else None
    assert (backend.attention, backend.kv_write) == (kernel or "sdpa", kernel or "torch")
    assert backend.linear_for(str(dtype).removeprefix("torch.")).name == "torch"
    assert (backend.norm, backend.layer, backend.ops) == ("torch", "python", None)


def test_portable_backend_runs_only_torch():
    backend = portable_backend("cpu", F32)
    assert chosen(backend) == ("sdpa", "torch", "torch", "python") and backend.ops is None


def test_switches_from_the_environment():
    assert Switches.from_environ({}) == Switches()
    env = {"PAGEDQ_CPU_KERNEL": "0", "PAGEDQ_ONEDNN": "off", "PAGEDQ_FUSED_LAYER": "No",
           "TRITON_INTERPRET": "1", "TORCH_EXTENSIONS_DIR": "/tmp/ext", "PAGEDQ_CPU_ISA": "AVX2"}
    assert Switches.from_environ(env) == Switches(False, False, False, True, Path("/tmp/ext"), "avx2")
    assert Switches.from_environ({"PAGEDQ_CPU_KERNEL": "1", "TRITON_INTERPRET": "0"}) == Switches()


def test_each_switch_is_read_once():
    class Recording(dict):
        reads: Counter = Counter()

        def get(self, key, default=None):
            self.reads[key] += 1
            return super().get(key, default)

    env = Recording(PAGEDQ_FUSED_LAYER="0")
    Switches.from_environ(env)
    assert set(env.reads) == {"PAGEDQ_CPU_KERNEL", "PAGEDQ_ONEDNN", "PAGEDQ_FUSED_LAYER",
                              "TRITON_INTERPRET", "TORCH_EXTENSIONS_DIR", "PAGEDQ_CPU_ISA"}
    assert set(env.reads.values()) == {1}


def test_the_process_reads_the_environment_once(monkeypatch):
    """The process's selector keeps the switches it started with: a later change of the
    environment does not change what runs (nothing reads it per call any more)."""
    first = process_selector()
    flipped = not first.switches.cpu_kernels
    monkeypatch.setenv("PAGEDQ_CPU_KERNEL", "1" if flipped else "0")
    assert process_selector() is first and process_selector().switches.cpu_kernels != flipped


def test_no_kernel_module_reads_the_environment():
    """The model's forward pass and the kernel modules never read os.environ or os.getenv:
    pagedq/kernel_switches.py reads the switches once, and the engine passes its config's."""
    readers = []
    for path in [*(ROOT / "kernels").glob("*.py"), ROOT / "worker" / "models" / "llama.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
                readers.append(path.name)
    assert readers == [], readers


def test_it_logs_one_line_with_the_choice_and_why(cpu_ops):
    with structlog.testing.capture_logs() as logs:
        Selector(Switches(fused_layer=False), cpu=AVX2).select("cpu", F32, F16, 64)
    lines = [entry for entry in logs if entry["event"] == "kernel_backend"]
    assert len(lines) == 1
    line = lines[0]
    assert line["attention"] == "cpp" and line["layer"] == "python" and line["norm"] == "cpp"
    assert line["linear"] == f"float32: cpp-skinny-avx2<=16+{ONEDNN}"
    assert line["cpu"] == "avx2 fma f16c" and line["dtype"] == "float32"
    assert "PAGEDQ_FUSED_LAYER=0" in line["why"] and "AVX2" in line["why"]


def test_switched_off_kernels_leave_sdpa_which_matches_the_reference():
    backend = Selector(Switches(cpu_kernels=False)).select("cpu")
    case = make_case([5, 1, 1, 11, 1, 2], [0, 24, 7, 18, 0, 9], block_size=8)
    plan = plan_attention(case.block_table, case.seq_lens, case.cu_seqlens_q, 8)
    out = paged_attention(*case.attention_args(), backend=backend.attention, plan=plan)
    torch.testing.assert_close(out, reference_paged_attention(*case.attention_args()),
                               atol=1e-4, rtol=1e-4)
    assert "sdpa" in plan._derived and "cpp" not in plan._derived


def test_default_attention_follows_the_selector(cpu_ops):
    """paged_attention(backend=None) runs what the process's selector picks for the tensors."""
    assert default_attention("cpu", F32, F32, 64) == process_selector().select("cpu", F32, F32, 64).attention
    assert default_attention("cpu", F32, F32, 12) == "sdpa"


def test_names_that_do_not_say_what_runs_are_refused(cpu_ops):
    case = make_case([1], [4], block_size=8)
    with pytest.raises(BackendUnavailableError, match="use one of"):
        paged_attention(*case.attention_args(), backend="torch")
    odd = make_case([1, 3], [4, 2], num_heads=2, num_kv_heads=1, head_dim=12, block_size=8)
    with pytest.raises(KernelArgumentError, match="backend='sdpa'"):
        paged_attention(*odd.attention_args(), backend="cpp")
    torch.testing.assert_close(paged_attention(*odd.attention_args()),
                               reference_paged_attention(*odd.attention_args()), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_onednn_rows_are_bucketed_and_the_result_is_unchanged():
    """The batched GEMM pads its rows to a few buckets (bounded per-shape memory in oneDNN and
    the allocator); the padding never shows in the result."""
    from pagedq.kernels.backend import LinearChoice, padded_rows

    assert [padded_rows(r) for r in (17, 31, 32, 33, 129, 200, 1000)] == \
        [32, 32, 32, 48, 144, 208, 1024]
    assert len({padded_rows(r) for r in range(17, 4097)}) < 60
    choice = LinearChoice("float32", "onednn")
    weight, bias = torch.randn(48, 40), torch.randn(48)
    packed = choice.prepack(weight)
    for rows in (17, 33, 100, 257):
        x = torch.randn(rows, 40)
        torch.testing.assert_close(choice(x, weight, bias, packed),
                                   torch.nn.functional.linear(x, weight, bias))
