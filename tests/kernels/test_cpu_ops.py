"""Building and loading the C++ library (kernels/cpu_ops.py): once per process, never raising."""

from __future__ import annotations

import os

import torch

from pagedq.kernels.cpu_ops import (
    LIBRARY,
    STALE_LOCK_SECONDS,
    build_directory,
    clear_stale_lock,
    load_cpu_ops,
    try_build,
    unavailable_reason,
)


def test_the_library_loads_once_with_every_op(cpu_ops):
    assert load_cpu_ops() is cpu_ops
    assert cpu_ops.build_dir.name.startswith(LIBRARY + "_torch")
    for name in ("paged_attention_rows", "skinny_linear", "rms_norm", "decoder_layers"):
        assert getattr(cpu_ops, name) is getattr(torch.ops.pagedq_cpu, name)
    assert not hasattr(torch.ops.pagedq_cpu, "decoder_layer")  # one all-layers op, no per-layer op


def test_build_failure_returns_none_with_a_reason(tmp_path):
    """A source that does not compile yields None and a reason, never an exception."""
    broken = tmp_path / "broken.cpp"
    broken.write_text('#error "deliberately broken"\n')
    assert try_build((broken,), name="pagedq_cpu_ops_broken_test", root=tmp_path / "ext") is None
    assert "deliberately broken" in unavailable_reason()
    assert (tmp_path / "ext").is_dir()  # built under the given root (TORCH_EXTENSIONS_DIR)
    assert try_build((tmp_path / "missing.cpp",), name="pagedq_missing", root=tmp_path) is None
    assert "is not installed" in unavailable_reason()


def test_build_directory_is_per_torch_and_python_version(tmp_path):
    path = build_directory(LIBRARY, tmp_path)
    assert path.parent == tmp_path and path.name.startswith(f"{LIBRARY}_torch")


def test_stale_build_lock_is_removed(tmp_path):
    """cpp_extension would wait forever on the lock of a build killed mid-compile."""
    fresh, stale = tmp_path / "fresh", tmp_path / "stale"
    for d in (fresh, stale):
        d.mkdir()
        (d / "lock").touch()
    old = (stale / "lock").stat().st_mtime - STALE_LOCK_SECONDS - 60
    os.utime(stale / "lock", (old, old))
    clear_stale_lock(fresh)
    clear_stale_lock(stale)
    assert (fresh / "lock").exists() and not (stale / "lock").exists()
