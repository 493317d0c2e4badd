"""What the benchmarks compare, side by side in one run:

- ``torch``: PyTorch's own op (torch.matmul, +, torch.full, torch.arange);
- ``pallas[<backend>]``: ``torch.ops.pallas.<op>`` on each backend available
  here (the simulators only at the smallest size: they time a simulation);
- ``jax[<backend>]``: the same compiled kernel called on JAX arrays, which
  shows what the torch <-> JAX bridge costs;
- ``triton``: the op on the Triton backend, where a GPU exists;
- ``torch.compile``: on a GPU, torch's op (or composition) compiled by
  torch.compile: the bar the fused training ops must clear there.

A provider's `prepare(op, inputs, params)` returns a callable that runs one
call and synchronises the device inside it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
from collections.abc import Callable

import torch

import torch_pallas
from torch_pallas.runtime import backends, bridge, compilation, launch, registry

# Tiny sizes for the smoke test of the default test run.
SMOKE = os.environ.get("TORCH_PALLAS_BENCH_SMOKE") == "1"
DEVICE = backends.default_device()


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def device_name() -> str:
    if DEVICE.type == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def versions() -> dict[str, str]:
    out = {}
    for package in ("torch", "jax", "jaxlib", "triton"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = "not installed"
    return out


@dataclasses.dataclass(frozen=True)
class Provider:
    name: str
    backend: str | None  # the torch_pallas backend it runs on, if any
    kind: str  # "torch", "pallas" or "jax"

    @property
    def simulated(self) -> bool:
        return self.backend is not None and backends.get(self.backend).simulated


def providers() -> list[Provider]:
    """torch, then each backend that runs on this machine's device (Triton's
    CPU interpreter aside: it times an interpreter), as the torch op and,
    for the Pallas families, as the bare JAX kernel."""
    found = [Provider("torch", None, "torch")]
    if DEVICE.type == "cuda":
        found.append(Provider("torch.compile", None, "compiled"))
    for b in backends.available(DEVICE.type):
        if b.family == "triton" and DEVICE.type == "cpu":
            continue
        found.append(Provider(f"pallas[{b.name}]", b.name, "pallas"))
        if b.family != "triton":
            found.append(Provider(f"jax[{b.name}]", b.name, "jax"))
    return found


def shape_cases(shapes, simulated_shape, candidates=None) -> tuple[list, list[str]]:
    """(cases, ids) of a suite timing the torch op against the Pallas op
    (no bare JAX kernel): (provider, shape) for each of `shapes`, the
    simulators at `simulated_shape` of their own (they time a simulation)
    and not in the smoke run; ids "provider-AxBxC". `candidates`: the
    providers to take (those of `providers()` but the jax ones by default)."""
    candidates = candidates or [p for p in providers() if p.kind != "jax"]
    cases = [(p, simulated_shape if p.simulated else shape) for p in candidates
             for shape in shapes if not (p.simulated and SMOKE)]
    return cases, [f"{p.name}-{'x'.join(map(str, s))}" for p, s in cases]


def prepare(provider: Provider, op: str, args: tuple, kwargs=None, kernel_inputs=(),
            kernel_params=None):
    """A callable timing one call of `op` by `provider`.

    `args` and `kwargs` are the op's arguments (the same for torch's op and
    torch_pallas's); `kernel_inputs` and `kernel_params` what `launch` hands
    the kernel for them (for the jax provider)."""
    kwargs = kwargs or {}
    info = registry.get(op)
    if provider.kind == "torch":
        fn = info.torch_function
    elif provider.kind == "compiled":
        fn = torch.compile(info.torch_function)
    elif provider.kind == "pallas":
        pallas_op = info.function
        backend = provider.backend
        if backend == backends.default_for(DEVICE).name:
            fn = pallas_op  # what a user's call costs: no backend override
        else:
            def fn(*a, **kw):
                with torch_pallas.backend(backend):
                    return pallas_op(*a, **kw)
    else:
        with torch_pallas.backend(provider.backend):
            _, kernel, _ = launch.compiled_kernel(op, DEVICE, kernel_inputs, kernel_params)
        device = compilation.input_device(kernel)
        arrays = [bridge.to_jax(t, device) for t in kernel_inputs]

        def run():
            return kernel(*arrays).block_until_ready()

        return warmed_up(run)

    def run():
        out = fn(*args, **kwargs)
        synchronize()
        return out

    return warmed_up(run)


WARMUP_CALLS = 2


def warmed_up(run: Callable) -> Callable:
    """`run` after a few calls: compiled, its memory already touched.
    pytest-benchmark sizes its rounds from the first call it times; a
    compile there leaves it 5 rounds, dominated by first-touch page faults
    of fresh output buffers."""
    for _ in range(WARMUP_CALLS):
        run()
    return run
