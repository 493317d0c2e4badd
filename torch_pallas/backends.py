"""Which backend serves a call: the one module that branches on devices.

A backend is a kernel family plus a way to execute it:

==========================  ===========  ==========================================
backend                     kernels      runs where
==========================  ===========  ==========================================
``mosaic_gpu``              mosaic_gpu   CUDA, compute capability 9.0+ (Hopper on)
``triton``                  triton       CUDA; CPU only with ``TRITON_INTERPRET=1``
``interpret``               tpu          CPU, JAX's generic interpreter (default)
``mosaic_gpu_interpret``    mosaic_gpu   CPU, Mosaic GPU interpret mode
``tpu_interpret``           tpu          CPU, TPU interpret mode (2 TensorCores)
==========================  ===========  ==========================================

The default comes from the device (CPU: ``interpret``; CUDA: ``mosaic_gpu``
on Hopper and newer, ``triton`` before). ``TORCH_PALLAS_BACKEND=name`` or
``with torch_pallas.backend(name):`` choose one explicitly; an explicit
choice that cannot serve a call raises, it never falls back.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from collections.abc import Iterator

import torch

from torch_pallas.kernels import triton as triton_kernels  # no `import triton` here

ENV_VAR = "TORCH_PALLAS_BACKEND"


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    family: str  # the folder under kernels/ holding its kernels
    device_type: str  # the torch device type it serves
    simulated: bool  # runs hardware kernels in a CPU simulator
    description: str


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("interpret", "tpu", "cpu", False,
                "TPU kernels in JAX's generic interpreter, CPU-sized blocks"),
        Backend("mosaic_gpu_interpret", "mosaic_gpu", "cpu", True,
                "Mosaic GPU kernels in Mosaic GPU interpret mode"),
        Backend("tpu_interpret", "tpu", "cpu", True,
                "TPU kernels in TPU interpret mode, 2 TensorCores"),
        Backend("mosaic_gpu", "mosaic_gpu", "cuda", False,
                "Mosaic GPU kernels on a Hopper (sm90+) GPU"),
        Backend("triton", "triton", "cuda", False,
                "Triton kernels (CUDA; CPU under TRITON_INTERPRET=1)"),
    )
}

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "torch_pallas_backend", default=None
)


class BackendError(RuntimeError):
    """A backend that cannot serve a call, or one that does not exist."""


def get(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"torch_pallas: unknown backend {name!r}; choose one of "
            f"{', '.join(BACKENDS)}"
        ) from None


@contextlib.contextmanager
def backend(name: str | None) -> Iterator[Backend | None]:
    """Runs the calls inside the block on backend `name` (None: the default).

    >>> with torch_pallas.backend("tpu_interpret"):
    ...     torch.ops.pallas.add(x, y)
    """
    chosen = get(name) if name is not None else None
    token = _override.set(name)
    try:
        yield chosen
    finally:
        _override.reset(token)


def requested() -> str | None:
    """The explicitly requested backend name, if any (context, then env)."""
    return _override.get() or os.environ.get(ENV_VAR) or None


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _jax_has_gpu() -> bool:
    from torch_pallas import jax_env

    try:
        return bool(jax_env.jax().devices("gpu"))
    except RuntimeError:
        return False


def default_for(device: torch.device) -> Backend:
    """The device's backend when none is requested: on CUDA, mosaic_gpu on
    Hopper and newer when JAX has a GPU backend, else triton (an automatic
    choice falls back; an explicit one never does)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, _ = _cuda_capability(index)
        return BACKENDS["mosaic_gpu" if major >= 9 and _jax_has_gpu() else "triton"]
    return BACKENDS["interpret"]


def check_serves(b: Backend, device: torch.device, op: str) -> None:
    """Raises BackendError unless backend `b` can run `op` on `device`."""
    if b.name == "triton" and device.type == "cpu":
        if triton_kernels.interpreting():
            return
        raise BackendError(
            f"{op}: backend 'triton' runs CPU tensors only under "
            "TRITON_INTERPRET=1 (got a tensor on cpu)"
        )
    if device.type != b.device_type:
        raise BackendError(
            f"{op}: backend {b.name!r} runs on {b.device_type} tensors, "
            f"got a tensor on {device}"
        )
    if b.name == "mosaic_gpu":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = _cuda_capability(index)
        if major < 9:
            raise BackendError(
                f"{op}: backend 'mosaic_gpu' needs compute capability 9.0+ "
                f"(Hopper or newer); {device} has {major}.{minor}"
            )


def fall_back(device: torch.device, op: str, backend: Backend, reason: str) -> Backend:
    """The backend for a call `backend` cannot run (`reason`): an automatic
    choice falls back to triton; an explicit request raises."""
    if requested() is not None:
        raise BackendError(f"{op}: backend {backend.name!r} {reason}")
    fallback = BACKENDS["triton"]
    check_serves(fallback, device, op)
    return fallback


def select(device: torch.device, op: str) -> Backend:
    """The backend for a call of `op` on `device`: requested, else default."""
    name = requested()
    b = get(name) if name is not None else default_for(device)
    check_serves(b, device, op)
    return b
