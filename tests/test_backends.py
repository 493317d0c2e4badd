"""Backend selection: defaults by device, the two ways to override, and
clear errors for a backend that cannot serve a call."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import torch_pallas
from torch_pallas.runtime import backends, launch
from helpers import CPU_BACKENDS


def test_cpu_default_is_interpret(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    assert backends.select(torch.device("cpu"), "pallas::add").name == "interpret"


def test_context_manager_overrides_and_restores(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    with torch_pallas.backend("tpu_interpret") as chosen:
        assert chosen.name == "tpu_interpret"
        assert backends.select(torch.device("cpu"), "op").name == "tpu_interpret"
        with torch_pallas.backend("mosaic_gpu_interpret"):
            assert backends.select(torch.device("cpu"), "op").name == "mosaic_gpu_interpret"
        assert backends.select(torch.device("cpu"), "op").name == "tpu_interpret"
    assert backends.select(torch.device("cpu"), "op").name == "interpret"


def test_environment_variable_overrides(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "mosaic_gpu_interpret")
    assert backends.select(torch.device("cpu"), "op").name == "mosaic_gpu_interpret"
    x, y = torch.randn(10), torch.randn(10)
    torch.testing.assert_close(torch.ops.pallas.add(x, y), x + y)


def test_the_environment_variable_is_read_at_each_call(monkeypatch):
    """requested() reads os.environ as it is at the call (its one-lookup
    reader included): a value set, changed or removed between two calls
    counts at the next, as os.environ.get would see it, and an op call
    keys its kernel by it."""
    x, y = torch.randn(3, 7), torch.randn(7)
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    assert backends.requested() is None
    for value in ("tpu_interpret", "mosaic_gpu_interpret", "intérprete"):
        monkeypatch.setenv(backends.ENV_VAR, value)
        assert backends.requested() == value == os.environ.get(backends.ENV_VAR)
    monkeypatch.setenv(backends.ENV_VAR, "tpu_interpret")
    with requests_seen() as seen:
        torch.testing.assert_close(torch.ops.pallas.add(x, y), x + y)
    assert seen == ["tpu_interpret"]
    monkeypatch.delenv(backends.ENV_VAR)
    assert backends.requested() is None
    with requests_seen() as seen:
        torch.testing.assert_close(torch.ops.pallas.add(x, y), x + y)
    assert seen == [None]


@contextlib.contextmanager
def requests_seen():
    """The requested backend each launch inside the block keys its kernel
    by (its call signature's), in order."""
    seen, original = [], launch.call_signature

    def spy(*args, **kwargs):
        signature = original(*args, **kwargs)
        seen.append(signature[2])
        return signature

    launch.call_signature = spy
    try:
        yield seen
    finally:
        launch.call_signature = original


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="unknown backend 'cuda_magic'.*interpret"):
        with torch_pallas.backend("cuda_magic"):
            pass


@pytest.mark.parametrize("name", ["mosaic_gpu", "triton"])
def test_gpu_backend_on_cpu_tensors_raises_naming_it(monkeypatch, name):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with torch_pallas.backend(name):
        with pytest.raises(torch_pallas.BackendError, match=f"pallas::add: backend '{name}'"):
            torch.ops.pallas.add(torch.randn(3), torch.randn(3))


def test_every_cpu_backend_serves_cpu_tensors():
    for name in CPU_BACKENDS:
        backends.check_serves(backends.get(name), torch.device("cpu"), "op")


def test_a_repeated_call_follows_the_backend_chosen_now(monkeypatch):
    """Repeated calls find their kernel by the call's signature; switching
    the backend (context, environment) still switches the kernel."""
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    cpu = torch.device("cpu")
    x, y = torch.randn(37), torch.randn(37)

    def backend_of_call():
        backend, _, _ = launch.compiled_kernel("add", cpu, (x, y), {"out_shape": (37,)})
        torch.testing.assert_close(torch.ops.pallas.add(x, y), x + y)
        return backend.name

    assert backend_of_call() == "interpret"
    with torch_pallas.backend("tpu_interpret"):
        assert backend_of_call() == "tpu_interpret"
    assert backend_of_call() == "interpret"
    monkeypatch.setenv(backends.ENV_VAR, "mosaic_gpu_interpret")
    assert backend_of_call() == "mosaic_gpu_interpret"


def test_triton_on_cpu_is_refused_again_once_its_interpreter_is_off(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, y = torch.randn(9), torch.randn(9)
    with torch_pallas.backend("triton"):
        torch.testing.assert_close(torch.ops.pallas.add(x, y), x + y)
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(torch_pallas.BackendError, match="TRITON_INTERPRET"):
            torch.ops.pallas.add(x, y)


FIRST_CALL = """
import torch
import torch_pallas
from torch_pallas.base import jax_env

x = torch.randn(37, 29)
torch.testing.assert_close(torch_pallas.add(x, x), 2 * x)
print(jax_env.cpu_only_machine(), jax_env.jax().config.jax_platforms)
"""


def test_a_first_call_on_a_machine_without_an_accelerator_starts_no_tpu_runtime():
    """libtpu, installed with the test extra on every Linux machine, prints
    its initialization errors when JAX starts it where there is no TPU;
    there the first kernel starts JAX on the CPU alone, and a machine with
    an accelerator keeps JAX's own choice."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    done = subprocess.run([sys.executable, "-c", FIRST_CALL], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    cpu_only, platforms = done.stdout.split()
    if cpu_only == "True":
        assert platforms == "cpu"
        assert "TPU" not in done.stderr and "libtpu" not in done.stderr, done.stderr
    else:
        assert platforms == "None"
