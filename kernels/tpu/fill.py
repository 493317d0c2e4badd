"""Fill an array with a constant: the Pallas TPU quickstart's `fill_42`,
generalised to any shape, dtype and value.

Each TensorCore writes the value into one VMEM block, then copies that block
(`pltpu.sync_copy`, VMEM -> HBM) to every block of the output it owns. Block
`b` belongs to core `b % num_cores`, so no two cores write the same bytes;
the quickstart's version, where every core writes the whole output, is the
data race tests/test_races.py plants.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels.shapes import cdiv
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu import chip
from torch_pallas.kernels.tpu.cores import core_index, tensorcore_mesh


@dataclasses.dataclass(frozen=True)
class FillConfig:
    block: int | None  # elements per VMEM block; None: the whole output

    @classmethod
    def default(cls, backend: str) -> "FillConfig":
        # The generic interpreter pays per block: one block on CPU.
        return cls(block=None) if backend == "interpret" else cls(block=1024)


def fill_kernel(o_hbm, o_vmem, *, value, blocks_per_core, num_cores):
    core = core_index(num_cores)
    block = o_vmem.shape[0]
    o_vmem[...] = jnp.full(o_vmem.shape, value, o_vmem.dtype)

    @pl.loop(0, blocks_per_core)
    def _(i):
        b = i * num_cores + core
        pltpu.sync_copy(o_vmem, o_hbm.at[pl.ds(b * block, block)])


def fill(shape, value, dtype, *, config: FillConfig, num_cores: int, interpret):
    """An array of `shape` and `dtype` (a name) holding `value`."""
    dtype = jnp.dtype(dtype)
    n = math.prod(shape)
    block = config.block or n
    blocks_per_core = cdiv(cdiv(n, block), num_cores)
    out = pl.kernel(
        functools.partial(
            fill_kernel, value=value, blocks_per_core=blocks_per_core, num_cores=num_cores
        ),
        out_type=jax.ShapeDtypeStruct((blocks_per_core * num_cores * block,), dtype),
        mesh=tensorcore_mesh(num_cores),
        scratch_types=dict(o_vmem=pltpu.VMEM((block,), dtype)),
        interpret=interpret,
    )()
    return out[:n].reshape(shape)


KERNEL = KernelSpec(run=chip.widening_float16(fill), default_config=FillConfig.default)
