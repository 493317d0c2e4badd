"""Building a kernel for one call: lowered by `jax.jit` for the inputs'
shapes and dtypes on the backend's JAX device, compiled with the kernel's
XLA options.

Small kernels on a backend that asks for it (`interpret` on CPU) are built
for a synchronous JAX CPU client of this package's own, which runs them on
the calling thread (jax_env.synchronous_cpu_device): lowered for it first,
and again for JAX's own client only when they turn out too large for it (a
lowering costs as much as the compile). docs/performance.md has the
measurements behind the limits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from torch_pallas.kernels.spec import Avals
from torch_pallas.base import jax_env
from torch_pallas.runtime import backends, disk_cache
from torch_pallas.runtime.backends import Backend

# A kernel under both runs on the calling thread: beyond them JAX's worker
# threads win.
SYNCHRONOUS_MAX_FLOPS = 2e8  # XLA's estimate
SYNCHRONOUS_MAX_BYTES = 16 * 2**20  # operands and results


def build(entry: Callable, avals: Avals, options: Mapping[str, Any], backend: Backend,
          device: torch.device, identity: tuple | None = None, flops: float | None = None):
    """`entry` (JAX arrays in and out) compiled for `avals` on `device`.
    `identity`: what the kernel follows from, as stable values, for a kernel
    that may be kept on disk for the next process (torch_pallas/runtime/disk_cache.py),
    and read back from there if an earlier process built it. `flops`: the
    kernel's own count where it knows one before a trace (a kernel too large
    for the calling thread then skips that lowering: 38 of the 83 ms a
    (768 x 512) @ (512 x 1376) matmul took to build)."""
    synchronous = None
    if backend.compiles_for_calling_thread(device) and _may_run_synchronously(avals, flops):
        synchronous = jax_env.synchronous_cpu_device()
    clients = ([("synchronous", synchronous.client)] if synchronous is not None else []) + [
        ("jax", backends.jax_device(device, backend).client)]
    if identity is not None:
        for kind, client in clients:
            found = disk_cache.load(disk_cache.digest((identity, kind)), client)
            if found is not None:
                return found
    compiled, kind = _build(entry, avals, options, backends.jax_device(device, backend),
                            synchronous)
    if identity is not None:
        disk_cache.store(disk_cache.digest((identity, kind)), compiled)
    return compiled


def _build(entry, avals, options, target, synchronous):
    """(compiled, which client runs it: "synchronous" or "jax")."""
    if synchronous is not None:
        try:
            lowered = lower(entry, avals, synchronous)
            if runs_synchronously(lowered):
                return compile_lowered(lowered, options), "synchronous"
        except Exception:  # a JAX that cannot build for a second client
            pass
    return compile_lowered(lower(entry, avals, target), options), "jax"


def lower(entry: Callable, avals: Avals, jax_device):
    jax = jax_env.jax()
    sharding = jax.sharding.SingleDeviceSharding(jax_device)
    shapes = [jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype), sharding=sharding)
              for shape, dtype in avals]
    return jax.jit(entry, out_shardings=sharding).lower(*shapes)


def _small_enough(moved: int, flops: float | None) -> bool:
    """The synchronous client's limits: `moved` bytes of operands (and
    results), `flops` where known."""
    return moved < SYNCHRONOUS_MAX_BYTES and (flops is None or flops < SYNCHRONOUS_MAX_FLOPS)


def _nbytes(shapes_and_dtypes) -> int:
    jax = jax_env.jax()
    return sum(math.prod(shape) * jax.numpy.dtype(dtype).itemsize
               for shape, dtype in shapes_and_dtypes)


def _may_run_synchronously(avals: Avals, flops: float | None) -> bool:
    """Whether a kernel with these inputs (and FLOPs, where known) could be
    small enough for the calling thread: what is known before lowering."""
    return _small_enough(_nbytes(avals), flops)


def runs_synchronously(lowered) -> bool:
    """Whether a lowered kernel is small enough for the calling thread."""
    jax = jax_env.jax()
    moved = _nbytes((a.shape, a.dtype)
                    for a in jax.tree.leaves((lowered.in_avals, lowered.out_info)))
    try:
        cost = lowered.cost_analysis() or {}
    except Exception:  # no estimate: JAX's default
        return False
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per computation
        cost = cost[0] if cost else {}
    return _small_enough(moved, cost.get("flops", math.inf))


def compile_lowered(lowered, options: Mapping[str, Any]):
    """`lowered` compiled with the kernel's XLA `options`, or without them on
    an XLA that does not know them (they choose speed, never results)."""
    if options:
        try:
            return lowered.compile(dict(options))
        except RuntimeError as e:
            if "INVALID_ARGUMENT" not in str(e) or "option" not in str(e):
                raise
    return lowered.compile()


def input_device(kernel):
    """The JAX device a compiled kernel takes its inputs on (None: no inputs)."""
    shardings, _ = kernel.input_shardings
    return next(iter(shardings[0].device_set)) if shardings else None
