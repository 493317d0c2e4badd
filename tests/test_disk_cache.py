"""Compiled kernels on disk (torch_pallas/runtime/disk_cache.py): a kernel another
process built is loaded instead of built, gives the same result, and a
damaged entry or a cache turned off costs only a build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_pallas
from torch_pallas.runtime import compilation, compile_cache

SCRIPT = """
import torch, torch_pallas
torch.manual_seed(0)
a, b = torch.randn(37, 29), torch.randn(29, 43)
torch.save(torch_pallas.matmul(a, b), {out!r})
"""


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_PALLAS_CACHE_DIR", str(tmp_path / "kernels"))
    compile_cache.clear()
    yield tmp_path / "kernels"
    compile_cache.clear()


def no_builds(*args, **kwargs):
    raise AssertionError("built a kernel the disk cache holds")


def test_a_kernel_built_by_another_process_is_loaded(cache_dir, tmp_path, monkeypatch):
    out = tmp_path / "out.pt"
    env = {**os.environ, "TORCH_PALLAS_CACHE_DIR": str(cache_dir)}
    subprocess.run([sys.executable, "-c", SCRIPT.format(out=str(out))], env=env, check=True,
                   timeout=300)
    assert len(list(cache_dir.glob("*.kernel"))) == 1
    torch.manual_seed(0)
    a, b = torch.randn(37, 29), torch.randn(29, 43)
    monkeypatch.setattr(compilation, "_build", no_builds)
    got = torch_pallas.matmul(a, b)
    assert torch.equal(got, torch.load(out))
    torch.testing.assert_close(got, a @ b, rtol=1e-5, atol=1e-5)


def test_a_damaged_entry_is_rebuilt_and_off_writes_nothing(cache_dir, monkeypatch):
    a, b = torch.randn(21, 19), torch.randn(19, 6)
    expected = torch_pallas.matmul(a, b)
    (entry,) = cache_dir.glob("*.kernel")
    entry.write_bytes(b"not a kernel")
    compile_cache.clear()
    assert torch.equal(torch_pallas.matmul(a, b), expected)  # rebuilt, and filed again
    compile_cache.clear()
    monkeypatch.setattr(compilation, "_build", no_builds)
    assert torch.equal(torch_pallas.matmul(a, b), expected)  # the rewritten entry loads
    monkeypatch.undo()
    off = cache_dir.parent / "off"
    monkeypatch.setenv("TORCH_PALLAS_CACHE_DIR", "off")
    compile_cache.clear()
    torch_pallas.matmul(torch.randn(5, 19), b)
    assert not off.exists() and len(list(cache_dir.glob("*.kernel"))) == 1


def test_users_kernels_and_simulators_are_not_written(cache_dir):
    @torch_pallas.custom_op("diskcache::twice")
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    twice(torch.randn(4))
    with torch_pallas.backend("tpu_interpret"):
        torch_pallas.add(torch.randn(8, 128), torch.randn(8, 128))
    assert not cache_dir.exists() or not list(cache_dir.glob("*.kernel"))


def test_a_kernel_xla_cannot_serialize_is_built_again_not_filed(cache_dir):
    # 1024 float32 rows: XLA's oneDNN dot on x86 (kernels/tpu/matmul.py's
    # cpu_library), whose executable JAX 0.10 cannot serialize; where XLA
    # can (another library, a later JAX), the kernel is filed as any other.
    from jax.experimental import serialize_executable

    a, b = torch.randn(1024, 40, dtype=torch.float32), torch.randn(40, 24)
    expected = (a.double() @ b.double()).float()
    torch.testing.assert_close(torch_pallas.matmul(a, b), expected, rtol=1e-5, atol=1e-4)
    from torch_pallas.runtime import launch
    from torch_pallas.ops import matmul as matmul_op

    params = {"transpose_a": False, "transpose_b": False,
              "precision": matmul_op.float32_precision()}
    kernel = launch.cpu_kernel("matmul", (a[None], b[None]), params)
    assert len(compile_cache.compiled) == 1  # the op's own kernel, found again
    try:
        serialize_executable.serialize(kernel)
        serializable = True
    except Exception:
        serializable = False
    filed = list(cache_dir.glob("*.kernel")) if cache_dir.exists() else []
    assert len(filed) == (1 if serializable else 0)
    compile_cache.clear()  # as a next process: built (or loaded) again, the same result
    torch.testing.assert_close(torch_pallas.matmul(a, b), expected, rtol=1e-5, atol=1e-4)
