"""The registry of ops (torch_pallas/runtime/registry.py): every op's kernels load as
the contract says (kernels/spec.py); a backend whose family lacks an op is
refused by name, or, chosen automatically, falls back; `python -m
torch_pallas` reports every op on every backend asked for."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import torch_pallas
from torch_pallas import __main__ as health
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.runtime import backends, compile_cache, launch, registry

FAMILIES = sorted({b.family for b in backends.BACKENDS.values()})


@pytest.mark.parametrize("info", registry.ops(), ids=lambda info: info.name)
def test_every_op_has_a_kernel_in_every_family(info):
    assert sorted(info.families) == FAMILIES
    for family in FAMILIES:
        backend = next(b for b in backends.BACKENDS.values() if b.family == family)
        assert isinstance(info.kernel(backend), KernelSpec)
    assert torch_pallas.__dict__[info.name] is info.function
    assert info.overload.name() == info.qualified_name


@pytest.fixture
def add_with_kernels(monkeypatch):
    """Makes `add` implemented by the given families only, for one test."""
    def restrict(*families):
        info = registry.get("add")
        kernels = {f: m for f, m in info.kernels.items() if f in families}
        monkeypatch.setitem(registry._OPS, "add", dataclasses.replace(info, kernels=kernels))
        compile_cache.clear()

    yield restrict
    compile_cache.clear()


def test_a_family_without_the_op_is_refused_by_name(add_with_kernels):
    add_with_kernels("tpu", "triton")
    x, y = torch.randn(5), torch.randn(5)
    with torch_pallas.backend("mosaic_gpu_interpret"):
        with pytest.raises(torch_pallas.BackendError) as info:
            torch_pallas.add(x, y)
    message = str(info.value)
    for word in ("pallas::add", "'mosaic_gpu_interpret'", "mosaic_gpu kernels", "tpu, triton"):
        assert word in message, message
    with torch_pallas.backend("tpu_interpret"):  # its family still serves
        torch.testing.assert_close(torch_pallas.add(x, y), x + y)


def test_an_automatic_choice_falls_back_when_its_family_lacks_the_op(add_with_kernels, monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton, the fallback, runs on CPU here
    add_with_kernels("triton")
    x, y = torch.randn(6, 3), torch.randn(3)
    backend, _, _ = launch.compiled_kernel("add", x.device, (x, y), {"out_shape": (6, 3)})
    assert backend.name == "triton"
    torch.testing.assert_close(torch_pallas.add(x, y), x + y)


def test_a_kernel_file_without_its_kernel_spec_is_named():
    info = dataclasses.replace(registry.get("add"), kernels={"tpu": "torch_pallas.kernels.spec"})
    with pytest.raises(TypeError, match="torch_pallas.kernels.spec must define KERNEL"):
        info.kernel(backends.get("interpret"))


def test_ops_are_registered_once():
    with pytest.raises(ValueError, match="pallas::add is registered twice"):
        registry.register(registry.get("add"))


def test_import_loads_no_kernel_and_no_jax():
    code = ("import sys, time, torch; start = time.perf_counter(); import torch_pallas; "
            "print(time.perf_counter() - start); "
            "print(sorted(m for m in sys.modules if m.startswith(('jax', 'triton', "
            "'torch_pallas.kernels.'))))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout.split("\n")
    seconds, loaded = float(out[0]), out[1]
    # The contract modules (plain Python) only: no kernel.
    assert loaded == ("['torch_pallas.kernels.attention_shapes', "
                      "'torch_pallas.kernels.rms_norm_casting', 'torch_pallas.kernels.spec', "
                      "'torch_pallas.kernels.triton']"), loaded
    assert seconds <= 0.5, f"import torch_pallas took {seconds:.2f} s"


def test_health_report_gives_unavailable_backends_a_row_each():
    """Without TRITON_INTERPRET and without a GPU, triton and mosaic_gpu
    cannot run: a row per op with the reason, exit status 0, and the
    interpret rows still run."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(
        [sys.executable, "-m", "torch_pallas", "--backend", "triton", "--backend", "mosaic_gpu",
         "--backend", "interpret"], env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines()
            if line.split()[:1] and line.split()[0] in {i.name for i in registry.ops()}]
    by_backend = {}
    for row in rows:
        by_backend.setdefault(row[1], []).append(row)
    n = len(registry.ops())
    assert [len(by_backend[b]) for b in ("triton", "mosaic_gpu", "interpret")] == [n, n, n]
    assert all(row[3] == "unavailable:" for b in ("triton", "mosaic_gpu") for row in by_backend[b])
    assert all(row[3] == "ok" for row in by_backend["interpret"])


def test_health_report_fails_on_a_wrong_op(monkeypatch, capsys):
    info = registry.get("add")

    def wrong(device, requires_grad):
        x = torch.randn(4)
        return [registry.Example((x, x), {}, x.double(), 0.0)]  # x + x is not x

    monkeypatch.setitem(registry._OPS, "add", dataclasses.replace(info, examples=wrong))
    assert health.main(["--backend", "interpret"]) == 1
    assert "WRONG" in capsys.readouterr().out
