"""torch's private API behind torch_compat: each probe, made to fail
(TORCH_PALLAS_PUBLIC_API), leaves every op working through the public
fallback; and JAX's private API in jax_env, whose failures the bridge and
the call path survive."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_pallas
from torch_pallas.base import jax_env, torch_compat
from torch_pallas.runtime import bridge, compile_cache

WORKLOAD = Path(__file__).with_name("compat_workload.py")


def test_the_private_device_dispatch_agrees_with_the_public_reads():
    assert torch_compat.privateuse1_name("tpu") == torch._C._get_privateuse1_backend_name()
    assert torch_compat.device_key_set("cpu") == torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def test_this_torch_offers_every_private_path():
    """The fast paths are in use here (the fallbacks are for other torch
    versions)."""
    assert all(torch_compat.available().values()), torch_compat.available()


# "all" turns every private path off at once, so each fallback carries the
# load there; each probe alone (the others' private paths on) is the long
# part, run with -m exhaustive where it takes every op's examples or a
# compile (15-30 s each on the 2-core CPU).
_LONG_PROBES = {"autograd_kernel", "eager_direct", "tracing_types", "symint_hint"}


@pytest.mark.parametrize("public", ["all", *(
    pytest.param(p, marks=pytest.mark.exhaustive) if p in _LONG_PROBES else p
    for p in torch_compat.PROBES)])
def test_ops_work_with_the_public_api_alone(public):
    env = dict(os.environ, **{torch_compat.ENV_VAR: public})
    result = subprocess.run([sys.executable, str(WORKLOAD), public], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]


def test_the_default_device_read_fast_is_torchs():
    """torch_compat.default_device() against torch.get_default_device():
    none set, set_default_device, `with torch.device(...)` inside it, and
    a factory op under each (its tensor lands where torch.full's does)."""
    def agree():
        assert torch_compat.default_device() == torch.get_default_device()
        assert torch_pallas.fill((3,), 1.5).device == torch.full((3,), 1.5).device

    agree()
    try:
        torch.set_default_device("meta")
        agree()
        with torch.device("cpu"):
            agree()
        agree()
    finally:
        torch.set_default_device(None)
    agree()
    assert torch_compat.default_device() == torch.device("cpu")


def test_wrap_triton_takes_every_kernel_the_ops_launch():
    """torch_compat.wrap_triton: the interpreter's kernels (bare, autotuned
    or under heuristics) as they are, whatever this torch's wrap_triton
    makes of them (torch 2.11 refuses them); a compiled kernel as
    torch.library.wrap_triton wraps it."""
    import triton  # the test extra's
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def kernel(x_ptr):
        pass

    interpreted = InterpretedFunction(kernel)
    for k in (interpreted, triton.autotune(configs=[triton.Config({})], key=[])(interpreted),
              triton.heuristics({"B": lambda args: 1})(interpreted)):
        assert torch_compat.wrap_triton(k) is k
    compiled = JITFunction(kernel)
    assert type(torch_compat.wrap_triton(compiled)) is type(torch.library.wrap_triton(compiled))


def test_an_unknown_probe_name_is_refused():
    env = dict(os.environ, **{torch_compat.ENV_VAR: "autograd_kernal"})
    result = subprocess.run([sys.executable, "-c", "import torch_pallas"], env=env,
                            capture_output=True, text=True)
    assert result.returncode != 0 and "autograd_kernal" in result.stderr


@pytest.fixture
def fresh_bridge():
    """The bridge's probed crossings and the compiled kernels, rebuilt for
    the test and again after it."""
    def reset():
        compile_cache.clear()
        for cached in (bridge._importer, bridge._exporter, jax_env.dlpack_to_buffer,
                       jax_env.buffer_to_dlpack):
            getattr(cached, "cache_clear", lambda: None)()  # (a test may replace it)

    reset()
    yield
    reset()


def test_without_jaxlibs_private_dlpack_calls_the_public_api_serves(monkeypatch, fresh_bridge):
    def missing(*args, **kwargs):
        raise AttributeError("no such jaxlib function")

    for name in ("dlpack_to_buffer", "buffer_to_dlpack", "dlpack_import_target"):
        monkeypatch.setattr(jax_env, name, missing)
    assert bridge._importer() is bridge._from_dlpack_public
    assert bridge._exporter() is bridge._to_torch_public
    x, y = torch.randn(33, 7), torch.randn(7)
    torch.testing.assert_close(torch_pallas.add(x, y), x + y)
    cpu = jax_env.jax().devices("cpu")[0]
    assert torch.equal(torch.from_dlpack(bridge.to_jax(x, cpu)), x)


def test_without_a_synchronous_cpu_client_kernels_run_on_jaxs(monkeypatch, fresh_bridge):
    monkeypatch.setattr(jax_env, "synchronous_cpu_device", lambda: None)
    a, b = torch.randn(20, 30), torch.randn(30, 10)
    torch.testing.assert_close(torch_pallas.matmul(a, b), a @ b, rtol=1e-5, atol=1e-5)
