"""How the TPU kernels share work between TensorCores: the mesh they run on,
which core is running, and the `emit_pipeline` keywords that split a grid
across the cores.

With one core nothing binds the core axis (no `axis_index`, no
`core_axis_name`), which lets JAX's generic interpreter run the kernels.
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import tpu as pltpu

CORE_AXIS = "core"


def tensorcore_mesh(num_cores: int):
    """The mesh a kernel runs on: `num_cores` TensorCores along CORE_AXIS.
    JAX 0.11 on spells it `pltpu.TensorCoreMesh(axis_name=, num_cores=)` (the
    seeds' spelling) and deprecates `create_tensorcore_mesh`, which is 0.10's
    only public one."""
    mesh = getattr(pltpu, "TensorCoreMesh", None)
    if mesh is not None:
        return mesh(axis_name=CORE_AXIS, num_cores=num_cores)
    return pltpu.create_tensorcore_mesh(CORE_AXIS, num_cores=num_cores)


def core_index(num_cores: int):
    """This TensorCore's index (0 on a one-core mesh, which has no axis)."""
    return jax.lax.axis_index(CORE_AXIS) if num_cores > 1 else 0


def pipeline_core_split(num_cores: int, parallel_dims: int, sequential_dims: int = 1) -> dict:
    """`emit_pipeline` keywords splitting the first `parallel_dims` grid
    dimensions (PARALLEL) across the cores, the `sequential_dims` after them
    sequential (ARBITRARY) on each core; none with one core."""
    if num_cores <= 1:
        return {}
    return dict(
        core_axis_name=CORE_AXIS,
        dimension_semantics=(pltpu.PARALLEL,) * parallel_dims + (pltpu.ARBITRARY,) * sequential_dims,
    )
