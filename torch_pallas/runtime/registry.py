"""The ops torch_pallas ships and the kernel files that implement each.

Each op file (ops/<op>.py) registers one `OpInfo`: its name, the kernel file
of every family that implements it (each ends with a `KernelSpec` named
`KERNEL`, see kernels/spec.py), its public Python function, torch's own
counterpart and a few example calls with their float64 references.
Everything that lists ops reads this registry: `python -m torch_pallas`, the
opcheck, reliability and lowering tests, and the benchmarks.

Kernel files are imported when a call first needs them (importing
torch_pallas imports no JAX). An op without a kernel for a backend's family
raises BackendError naming the op, the backend and the families that do
implement it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.runtime.backends import Backend, BackendError

NAMESPACE = "pallas"


@dataclasses.dataclass(frozen=True)
class Example:
    """One call of an op on small random inputs, with its float64 reference
    (`expected`) and the elementwise error it may show (`bound`); for an op
    with several outputs, a tuple of each."""

    args: tuple
    kwargs: Mapping[str, Any]
    expected: torch.Tensor | tuple[torch.Tensor, ...]
    bound: torch.Tensor | float | tuple

    def error(self, out, float32_allowance: float = 1.0) -> tuple[float, bool]:
        """(max |out - expected|, whether every element is within the bound,
        a float32 output's bound multiplied by `float32_allowance`: a
        backend's, Backend.float32_allowance)."""
        several = isinstance(self.expected, tuple)
        outs = out if several else (out,)
        expected = self.expected if several else (self.expected,)
        bounds = self.bound if several else (self.bound,)
        worst, within = 0.0, len(outs) == len(expected)
        for o, ref, bound in zip(outs, expected, bounds):
            if o.dtype == torch.float32:
                bound = bound * float32_allowance
            err = (o.cpu().double() - ref.double()).abs()
            worst = max(worst, err.max().item() if err.numel() else 0.0)
            within &= bool((err <= bound).all())
        return worst, within


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """An op: `torch.ops.pallas.<name>`, `torch_pallas.<name>`.

    Attributes:
      name: the op's name in the `pallas` namespace.
      kernels: kernel family -> the module implementing the op in it
        (a file under kernels/<family>/ that defines KERNEL).
      function: the public Python function (`torch_pallas.<name>`).
      torch_function: torch's own op with the same semantics (benchmarks
        compare against it).
      examples: (device, requires_grad) -> example calls; tensors among
        their arguments require grad when asked and the op is
        differentiable.
    """

    name: str
    kernels: Mapping[str, str]
    function: Callable
    torch_function: Callable
    examples: Callable[[torch.device, bool], list[Example]]

    @property
    def qualified_name(self) -> str:
        return f"{NAMESPACE}::{self.name}"

    @property
    def families(self) -> tuple[str, ...]:
        return tuple(self.kernels)

    @property
    def overload(self):
        """`torch.ops.pallas.<name>.default`."""
        return getattr(getattr(torch.ops, NAMESPACE), self.name).default

    def serves(self, backend: Backend) -> bool:
        return backend.family in self.kernels

    def kernel(self, backend: Backend) -> KernelSpec:
        """The op's kernel for `backend`'s family (imported on first use)."""
        module = self.kernels.get(backend.family)
        if module is None:
            raise BackendError(
                f"{self.qualified_name}: backend {backend.name!r} runs {backend.family} "
                f"kernels, and the op has none; it is implemented for "
                f"{', '.join(self.kernels)}"
            )
        return _load(module)


_OPS: dict[str, OpInfo] = {}


def register(info: OpInfo) -> OpInfo:
    if info.name in _OPS:
        raise ValueError(f"torch_pallas: op {info.qualified_name} is registered twice")
    _OPS[info.name] = info
    return info


def ops() -> tuple[OpInfo, ...]:
    """Every shipped op, in registration order."""
    return tuple(_OPS.values())


def get(name: str) -> OpInfo:
    try:
        return _OPS[name.removeprefix(f"{NAMESPACE}::")]
    except KeyError:
        raise ValueError(f"torch_pallas: no op {name!r}; ops: {', '.join(_OPS)}") from None


_loaded: dict[str, KernelSpec] = {}


def _load(module_name: str) -> KernelSpec:
    spec = _loaded.get(module_name)
    if spec is None:
        module = importlib.import_module(module_name)
        spec = getattr(module, "KERNEL", None)
        if not isinstance(spec, KernelSpec):
            raise TypeError(
                f"torch_pallas: {module_name} must define KERNEL, a "
                f"torch_pallas.kernels.spec.KernelSpec; got {spec!r}"
            )
        _loaded[module_name] = spec
    return spec
