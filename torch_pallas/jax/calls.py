"""A shipped op's TPU-family kernel called on JAX arrays, inside or outside
`jax.jit`: the kernel, its config and its backend's execution keywords as
the torch op's call builds them (launch.shipped_entry), with no torch tensor
and no host round trip.

The backend: the one asked for (`TORCH_PALLAS_BACKEND`, `with
torch_pallas.backend(name):`) where it runs TPU kernels, else `tpu` where
JAX's default backend is a TPU (the kernels compiled by Mosaic) and
`interpret` elsewhere (JAX's interpreter, on the CPU).

Inside `with building_for_tpu(chip):` the calls build the `tpu` backend's
kernels whatever JAX's backend and whatever was asked for, without
looking for a TPU: for exporting the functions to a TPU that JAX does not
run here (`jax.export(..., platforms=["tpu"])`: torch_tpu's interop, or a
compile-only check for a chip libtpu describes). `chip` (a JAX device, or
any object with `device_kind` and `num_cores`) is what the kernels are
configured for and what Pallas's `get_tpu_info()` answers with (an
abstract mesh on it) while the block is open.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from torch_pallas.base import jax_env
from torch_pallas.base.errors import BackendError
from torch_pallas.runtime import backends, compile_cache, launch, registry
from torch_pallas.runtime.backends import Backend

_HOST = torch.device("cpu")  # the torch device the TPU family's backends serve

# The chip the calls build the `tpu` backend's kernels for inside
# building_for_tpu (None: no such block; _ANY_CHIP: one of unknown kind).
_ANY_CHIP = object()
_building_for: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "torch_pallas_jax_building_for", default=None)


def _abstract_mesh(chip):
    """A one-device abstract mesh on `chip`'s kind, the way Pallas learns
    a TPU it is not running on (get_tpu_info reads its device), or None
    where this JAX has no abstract devices."""
    jax = jax_env.jax()
    sharding = jax.sharding
    if not all(hasattr(sharding, n) for n in ("AbstractDevice", "AbstractMesh",
                                              "use_abstract_mesh")):
        return None
    try:
        device = sharding.AbstractDevice(chip.device_kind, getattr(chip, "num_cores", 1) or 1)
        return sharding.AbstractMesh((1,), ("torch_pallas_chip",), abstract_device=device)
    except TypeError:  # a JAX whose AbstractMesh takes no device
        return None


@contextlib.contextmanager
def building_for_tpu(chip=None) -> Iterator[None]:
    """Inside the block the calls build the `tpu` backend's kernels (see the
    module's docstring) for `chip`: a JAX TPU device (an abstract one from
    libtpu's topology description: compile-only) or an object with
    `device_kind` and `num_cores`; None for a chip of unknown kind: the
    kernels' defaults, and Pallas asks JAX's default device (a CPU one
    stands for the TPU jax_env.simulate_tpu_on_cpu describes). Used for
    export and compile-only; nothing here runs a kernel, and JAX's
    backends are not started here."""
    token = _building_for.set(_ANY_CHIP if chip is None else chip)
    try:
        if chip is None:
            jax_env.simulate_tpu_on_cpu()
            yield
            return
        mesh = _abstract_mesh(chip)
        if mesh is not None:
            with jax_env.jax().sharding.use_abstract_mesh(mesh):
                yield
        elif isinstance(chip, jax_env.jax().Device):
            with jax_env.jax().default_device(chip):
                yield
        else:
            jax_env.simulate_tpu_on_cpu()
            yield
    finally:
        _building_for.reset(token)


def building() -> bool:
    """Whether a building_for_tpu block is open here."""
    return _building_for.get() is not None


def backend(op: str) -> Backend:
    """The backend a JAX-side call of `op` runs on (see the module's
    docstring); a requested backend of another family raises BackendError."""
    if _building_for.get() is not None:
        return backends.get("tpu")
    name = backends.requested()
    if name is None:
        return backends.get("tpu" if jax_env.jax().default_backend() == "tpu" else "interpret")
    chosen = backends.get(name)
    if chosen.family != "tpu":
        raise BackendError(
            f"{op}: torch_pallas.jax runs the TPU kernels (backends 'interpret', "
            f"'tpu_interpret', 'tpu'); the backend asked for, {name!r}, runs "
            f"{chosen.family} kernels")
    if chosen.name == "tpu":
        backends.check_serves(chosen, _HOST, op)  # raises where JAX sees no TPU
    return chosen


def run(op: str, *arrays, **params):
    """Op `op`'s kernel on `arrays` (JAX arrays or tracers) with its static
    `params`, as the torch op passes them to launch.run: a jitted function
    (the kernels are built to be compiled: some allocate refs that have no
    eager rule), built once per backend, shapes and parameters."""
    info = registry.get(op)
    chosen = backend(info.qualified_name)
    chip = _building_for.get()
    chip = None if chip is _ANY_CHIP else chip
    exporting = _building_for.get() is not None
    avals = tuple((tuple(a.shape), jax_env.jax().numpy.dtype(a.dtype).name) for a in arrays)

    def build():
        spec = info.kernel(chosen)
        reason = spec.refusal(chosen.name, avals, params)
        if reason is not None:
            raise BackendError(f"{info.qualified_name}: backend {chosen.name!r} {reason}")
        if exporting:  # the chip's own cores; no TPU looked for here
            execution = {"interpret": None, "num_cores": getattr(chip, "num_cores", 1) or 1}
            target = chip
        else:
            execution = chosen.execution(device=_HOST, takes_inputs=bool(arrays))
            target = backends.jax_device(_HOST, chosen)
        return jax_env.jax().jit(
            launch.shipped_entry(spec, chosen, target, avals, params, execution))

    # the torch calls' bounded cache (torch_pallas.clear_cache() empties it),
    # under keys of their own
    built_for = (getattr(chip, "device_kind", None), getattr(chip, "num_cores", None)) \
        if exporting else None
    key = ("torch_pallas.jax", info.name, chosen.name, built_for, avals,
           launch.static_key(params))
    return compile_cache.compiled.get(key, build)(*arrays)
