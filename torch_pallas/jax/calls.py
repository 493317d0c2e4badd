"""A shipped op's TPU-family kernel called on JAX arrays, inside or outside
`jax.jit`: the kernel, its config and its backend's execution keywords as
the torch op's call builds them (launch.shipped_entry), with no torch tensor
and no host round trip.

The backend: the one asked for (`TORCH_PALLAS_BACKEND`, `with
torch_pallas.backend(name):`) where it runs TPU kernels, else `tpu` where
JAX's default backend is a TPU (the kernels compiled by Mosaic) and
`interpret` elsewhere (JAX's interpreter, on the CPU).
"""

from __future__ import annotations

import torch

from torch_pallas.base import jax_env
from torch_pallas.base.errors import BackendError
from torch_pallas.runtime import backends, compile_cache, launch, registry
from torch_pallas.runtime.backends import Backend

_HOST = torch.device("cpu")  # the torch device the TPU family's backends serve


def backend(op: str) -> Backend:
    """The backend a JAX-side call of `op` runs on (see the module's
    docstring); a requested backend of another family raises BackendError."""
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
    avals = tuple((tuple(a.shape), jax_env.jax().numpy.dtype(a.dtype).name) for a in arrays)

    def build():
        spec = info.kernel(chosen)
        reason = spec.refusal(chosen.name, avals, params)
        if reason is not None:
            raise BackendError(f"{info.qualified_name}: backend {chosen.name!r} {reason}")
        execution = chosen.execution(device=_HOST, takes_inputs=bool(arrays))
        target = backends.jax_device(_HOST, chosen)
        return jax_env.jax().jit(
            launch.shipped_entry(spec, chosen, target, avals, params, execution))

    # the torch calls' bounded cache (torch_pallas.clear_cache() empties it),
    # under keys of their own
    key = ("torch_pallas.jax", info.name, chosen.name, avals, launch.static_key(params))
    return compile_cache.compiled.get(key, build)(*arrays)
