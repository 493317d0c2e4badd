"""The torch <-> JAX bridge: zero copies, awkward layouts, no narrowing,
lazy JAX, and the compile cache."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import torch_pallas
from torch_pallas.runtime import bridge, compile_cache
from helpers import shares_memory


def test_contiguous_tensors_cross_without_copies():
    t = torch.randn(64, 33)
    a = bridge.to_jax(t)
    assert shares_memory(t, a)
    back = bridge.to_torch(a)
    assert back.data_ptr() == t.data_ptr()
    torch.testing.assert_close(back, t)


def test_kernel_output_reaches_torch_without_a_copy():
    from torch_pallas.base import jax_env

    jnp = jax_env.jax().numpy
    out = jnp.arange(1000, dtype=jnp.float32) * 2
    t = bridge.to_torch(out)
    assert shares_memory(t, out)
    assert torch.equal(t, torch.arange(1000, dtype=torch.float32) * 2)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(5, 1).expand(5, 7),  # stride 0
        lambda: torch.randn(7, 5).t(),  # transposed
        lambda: torch.randn(10, 14)[::2, 1::2],  # strided
        lambda: torch.randn(3, 7, requires_grad=True),  # requires grad
        lambda: torch.randn(101)[1:36],  # storage offset
        lambda: torch.randn(9).reshape(9, 1).t().unsqueeze(-1),  # size-1 dims, odd strides
    ],
    ids=["expanded", "transposed", "strided", "requires_grad", "offset", "size1_strides"],
)
def test_awkward_layouts_cross_with_their_values(make):
    t = make()
    a = bridge.to_jax(t)
    assert tuple(a.shape) == tuple(t.shape)
    assert torch.equal(bridge.to_torch(a), t.detach())
    arg = bridge.to_kernel_argument(t)  # a NumPy view
    assert torch.equal(torch.from_numpy(np.ascontiguousarray(arg)), t.detach())
    torch.testing.assert_close(torch.ops.pallas.add(t, t), t.detach() * 2)


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int8, torch.uint8, torch.bool],
)
def test_kernel_arguments_share_the_tensor_memory(dtype):
    """CPU tensors reach kernels as NumPy views, no copy (bfloat16 as
    ml_dtypes' bfloat16, the NumPy dtype JAX uses)."""
    t = (torch.randn(16, 40) * 50).to(dtype)
    arg = bridge.to_kernel_argument(t)
    assert arg.ctypes.data == t.data_ptr() and arg.dtype.name == str(dtype).split(".")[1]
    assert tuple(arg.shape) == tuple(t.shape)
    assert torch.equal(torch.as_tensor(np.asarray(arg, dtype=np.float32)), t.float())


def test_small_cpu_kernels_run_on_the_synchronous_client():
    """Kernels XLA estimates as small run on the package's synchronous CPU
    client, large ones on JAX's own; both take tensors of every dtype."""
    from torch_pallas.base import jax_env
    from torch_pallas.runtime import compilation, launch

    jax = jax_env.jax()
    cpu = torch.device("cpu")
    for n, synchronous in ((1000, True), (1 << 22, False)):
        for dtype in (torch.float32, torch.bfloat16, torch.int32):
            x, y = (torch.randn(n) * 100).to(dtype), (torch.randn(n) * 100).to(dtype)
            _, kernel, _ = launch.compiled_kernel("add", cpu, (x, y), {"out_shape": (n,)})
            on_jax_client = compilation.input_device(kernel).client is jax.devices("cpu")[0].client
            assert on_jax_client != synchronous, (n, dtype)
            assert torch.equal(torch.ops.pallas.add(x, y), x + y)


def test_a_kernel_known_too_large_is_lowered_once(monkeypatch):
    """A kernel whose FLOPs rule out the calling thread (matmul's, known
    from its shapes) is lowered for JAX's client alone, not first for the
    synchronous one; a small one still runs synchronously."""
    from torch_pallas.base import jax_env
    from torch_pallas.runtime import compilation, compile_cache, disk_cache, launch

    monkeypatch.setenv(disk_cache.ENV_VAR, "off")  # built here, not read from disk
    jax = jax_env.jax()
    lowered_for = []
    lower = compilation.lower
    monkeypatch.setattr(compilation, "lower", lambda entry, avals, device: (
        lowered_for.append(device.client is jax.devices("cpu")[0].client),
        lower(entry, avals, device))[1])
    compile_cache.clear()
    cpu = torch.device("cpu")
    with torch_pallas.backend("interpret"):
        for m, synchronous in ((3, True), (701, False)):  # 2*701*600*300 > 2e8 FLOPs
            lowered_for.clear()
            a, b = torch.randn(m, 300), torch.randn(300, 600)
            _, kernel, _ = launch.compiled_kernel(
                "matmul", cpu, (a[None], b[None]),
                {"transpose_a": False, "transpose_b": False, "precision": "ieee"})
            assert lowered_for == [not synchronous], (m, lowered_for)
            assert (compilation.input_device(kernel).client is jax.devices("cpu")[0].client) \
                != synchronous
            torch.testing.assert_close(torch_pallas.matmul(a, b), a @ b, rtol=1e-5, atol=1e-4)
    compile_cache.clear()


def test_export_waits_for_the_kernel_to_finish():
    """A result large enough to run asynchronously reaches torch complete."""
    x = torch.randn(1 << 22)
    for _ in range(3):
        out = torch.ops.pallas.add(x, x)
        assert torch.equal(out, x + x)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64])
def test_64_bit_tensors_are_refused_not_narrowed(dtype):
    with pytest.raises(TypeError, match="narrowed"):
        bridge.to_jax(torch.zeros(3, dtype=dtype))


def test_outputs_do_not_alias_inputs_that_torch_mutates_later():
    x, y = torch.randn(50), torch.randn(50)
    out = torch.ops.pallas.add(x, y)
    expected = out.clone()
    x.add_(100.0)  # the op's result must not see this
    assert torch.equal(out, expected)


def run_python(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    return subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env
    ).stdout


def test_import_does_not_import_jax():
    out = run_python(
        "import sys, torch, torch_pallas; print(torch.ops.pallas.matmul); "
        "print('jax' in sys.modules)"
    )
    assert out.split() == ["pallas.matmul", "False"]


def test_first_call_imports_jax_without_gpu_preallocation():
    out = run_python(
        "import os, torch, torch_pallas; torch_pallas.add(torch.ones(2), torch.ones(2)); "
        "print(os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])"
    )
    assert out.strip() == "false"


def test_repeated_calls_reuse_the_compiled_kernel():
    a, b = torch.randn(21, 11), torch.randn(11, 5)
    torch.ops.pallas.matmul(a, b)
    builds = compile_cache.compiled.builds
    for _ in range(3):
        torch.ops.pallas.matmul(torch.randn(21, 11), torch.randn(11, 5))
    assert compile_cache.compiled.builds == builds
    torch.ops.pallas.matmul(torch.randn(22, 11), b)  # a new shape is a new kernel
    assert compile_cache.compiled.builds == builds + 1


def test_compile_cache_is_bounded_and_clearable():
    cache = compile_cache.CompileCache(max_entries=3)
    for i in range(5):
        cache.get(i, lambda i=i: f"kernel {i}")
    assert len(cache) == 3 and cache.builds == 5
    assert cache.get(4, lambda: "rebuilt") == "kernel 4"
    cache.remember_signature("call", 4, "resolved")
    assert cache.lookup_signature("call") == (4, "resolved", "kernel 4")
    cache.clear()
    assert len(cache) == 0 and cache.lookup_signature("call") is None
    torch_pallas.clear_cache()
    assert len(compile_cache.compiled) == 0


def test_a_ready_call_leaves_the_compile_cache_with_its_kernel():
    """A call made ready to run is found by call signature while its kernel
    is cached, keeps the kernel recently used, and goes when the kernel is
    evicted or the cache cleared (it holds the compiled kernel)."""
    cache = compile_cache.CompileCache(max_entries=2)
    cache.set_ready("absent", lambda: "never kept")  # no entry: nothing kept
    assert cache.ready("absent call") is None
    cache.get("k", lambda: "kernel")
    cache.remember_signature("call", "k")
    assert cache.ready("call") is None  # none set yet
    cache.set_ready("k", lambda: "ran")
    for i in range(4):  # other kernels come and go; the ready one is used each time
        cache.get(i, lambda i=i: f"kernel {i}")
        assert cache.ready("call")() == "ran"
    cache.get("x", lambda: "x")
    cache.get("y", lambda: "y")  # "k" is now the least recently used: evicted
    assert cache.ready("call") is None and cache.lookup_signature("call") is None
    cache.get("k", lambda: "kernel again")
    assert cache.ready("call") is None  # a rebuilt entry is filed and made ready again
    cache.remember_signature("call", "k")
    cache.set_ready("k", lambda: "ran again")
    assert cache.ready("call")() == "ran again"
    cache.clear()
    assert cache.ready("call") is None


def test_repeated_calls_run_ready_and_follow_clear_cache(monkeypatch):
    from torch_pallas.runtime import launch

    made = []
    make = launch._cpu_call
    monkeypatch.setattr(launch, "_cpu_call", lambda *args: made.append(1) or make(*args))
    a, b = torch.randn(13, 7), torch.randn(13, 7)
    torch_pallas.clear_cache()
    torch.testing.assert_close(torch.ops.pallas.add(a, b), a + b)
    builds = compile_cache.compiled.builds
    torch.testing.assert_close(torch.ops.pallas.add(b, a), a + b)  # the ready call
    assert compile_cache.compiled.builds == builds and len(made) == 1
    torch_pallas.clear_cache()
    torch.testing.assert_close(torch.ops.pallas.add(a, a), a + a)
    assert compile_cache.compiled.builds == builds + 1 and len(made) == 2


def test_compile_cache_drops_the_least_recently_used_kernel():
    """A kernel used on every step stays while others come and go, whether
    it is found by key or by call signature."""
    cache = compile_cache.CompileCache(max_entries=3)
    cache.get("hot", lambda: "hot kernel")
    cache.remember_signature("hot call", "hot")
    for i in range(10):
        cache.get(i, lambda i=i: f"kernel {i}")
        if i % 2:
            assert cache.lookup_signature("hot call") == ("hot", None, "hot kernel")
        else:
            assert cache.get("hot", lambda: "rebuilt") == "hot kernel"
    assert cache.builds == 11
