"""KV sizing: the byte arithmetic, container memory limits (cgroup v2 and v1, built as files
the way the kernel lays them out), byte sizes as people write them, and what a one-shot
command reserves."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from pagedq.errors import InvalidRequestError
from pagedq.worker.config import EngineConfig, parse_bytes
from pagedq.worker.engine import sizing

GiB = 1 << 30


def smollm2_config():
    """SmolLM2-135M's shape, written out from its config.json."""
    return SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                           num_hidden_layers=30, max_position_embeddings=8192)


def test_kv_bytes_per_token_is_the_formula():
    # 2 (K and V) x 30 layers x 3 KV heads x 64 head dim x 4 bytes
    assert sizing.kv_bytes_per_token(smollm2_config(), torch.float32) == 2 * 30 * 3 * 64 * 4
    assert sizing.kv_bytes_per_token(smollm2_config(), torch.float16) == 2 * 30 * 3 * 64 * 2


def test_readme_worked_example_fits():
    """32 jobs of 1,024 tokens in fp32 need 1.41 GiB; --kv-cache-memory 1.5GiB holds them,
    each job's partly filled last block included."""
    per_token = sizing.kv_bytes_per_token(smollm2_config(), torch.float32)
    assert 32 * 1024 * per_token / GiB == pytest.approx(1.406, abs=1e-3)
    plan = sizing.plan_kv(smollm2_config(), EngineConfig(kv_cache_memory="1.5GiB"),
                          torch.float32, 8, parse_bytes("1.5GiB"))
    assert plan.num_blocks >= sizing.blocks_for([1024] * 32, 8) + 32
    assert plan.concurrency_at(1024) >= 32


def test_blocks_for_rounds_each_sequence_up():
    assert sizing.blocks_for([1, 8, 9, 16], 8) == 1 + 1 + 2 + 2
    assert sizing.blocks_for([], 8) == 0


@pytest.mark.parametrize("text,expected", [
    ("2GiB", 2 * GiB), ("512MiB", 512 << 20), ("1.5GiB", 3 * GiB // 2), ("2G", 2 * GiB),
    ("2g", 2 * GiB), ("300MB", 300_000_000), ("1KB", 1000), ("4096", 4096), (" 8 KiB ", 8192),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "2Gi", "two", "-1G", "2XB"])
def test_parse_bytes_rejects_what_is_not_a_size(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes(text)


def test_engine_config_takes_a_size_string():
    assert EngineConfig(kv_cache_memory="512MiB").kv_cache_memory == 512 << 20
    with pytest.raises(InvalidRequestError, match="kv_cache_memory"):
        EngineConfig(kv_cache_memory="lots")


# -- container limits -------------------------------------------------------------------------
def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def cgroup_v2(tmp_path: Path, limit: str, current: int, inactive: int = 0,
              parent_limit: str = "max") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    write(root / "kubepods" / "memory.max", parent_limit + "\n")
    write(root / "kubepods" / "pod1" / "memory.max", limit + "\n")
    write(root / "kubepods" / "pod1" / "memory.current", f"{current}\n")
    write(root / "kubepods" / "pod1" / "memory.stat",
          f"anon 1\ninactive_file {inactive}\nactive_file 5\n")
    proc = tmp_path / "proc_cgroup"
    write(proc, "0::/kubepods/pod1\n")
    return root, proc


def test_cgroup_v2_limit_minus_usage(tmp_path):
    root, proc = cgroup_v2(tmp_path, str(4 * GiB), current=1 * GiB)
    assert sizing.cgroup_headroom(root, proc) == 3 * GiB


def test_cgroup_v2_file_cache_does_not_count_as_used(tmp_path):
    root, proc = cgroup_v2(tmp_path, str(4 * GiB), current=3 * GiB, inactive=2 * GiB)
    assert sizing.cgroup_headroom(root, proc) == 3 * GiB


def test_cgroup_v2_tightest_limit_on_the_path(tmp_path):
    root, proc = cgroup_v2(tmp_path, "max", current=GiB, parent_limit=str(2 * GiB))
    assert sizing.cgroup_headroom(root, proc) == GiB


def test_cgroup_v2_unlimited_is_none(tmp_path):
    root, proc = cgroup_v2(tmp_path, "max", current=GiB)
    assert sizing.cgroup_headroom(root, proc) is None


def test_cgroup_v1_limit(tmp_path):
    root = tmp_path / "cgroup"
    leaf = root / "memory" / "docker" / "abc"
    write(leaf / "memory.limit_in_bytes", f"{2 * GiB}\n")
    write(leaf / "memory.usage_in_bytes", f"{GiB}\n")
    write(leaf / "memory.stat", f"cache 9\ntotal_inactive_file {GiB // 2}\n")
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    proc = tmp_path / "proc_cgroup"
    write(proc, "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    assert sizing.cgroup_headroom(root, proc) == GiB + GiB // 2


def test_cgroup_v1_inside_the_container_namespace(tmp_path):
    """Inside a container /proc/self/cgroup may name the host's path, which the container
    sees as the root of its own mount."""
    root = tmp_path / "cgroup"
    write(root / "memory" / "memory.limit_in_bytes", f"{GiB}\n")
    write(root / "memory" / "memory.usage_in_bytes", f"{GiB // 4}\n")
    proc = tmp_path / "proc_cgroup"
    write(proc, "4:memory:/docker/0123456789\n")
    assert sizing.cgroup_headroom(root, proc) == 3 * GiB // 4


def test_no_cgroup_files_means_no_limit(tmp_path):
    assert sizing.cgroup_headroom(tmp_path / "none", tmp_path / "missing") is None


def test_default_cpu_budget_reads_the_container_limit(tmp_path, monkeypatch):
    root, proc = cgroup_v2(tmp_path, str(2 * GiB), current=GiB)
    headroom = sizing.available_memory(root, proc)
    assert headroom == min(GiB, psutil.virtual_memory().available)
    monkeypatch.setattr(sizing, "available_memory", lambda: headroom)
    assert sizing.cpu_kv_budget(EngineConfig()) == min(sizing.DEFAULT_CPU_KV_BYTES, headroom // 4)
    assert sizing.cpu_kv_budget(EngineConfig(kv_cache_memory="3GiB")) == 3 * GiB
