"""0, 1, ..., n-1: the Pallas TPU quickstart's `iota`, split across
TensorCores with `jax.lax.axis_index('core')` and the core count, for any
length.

Core `c` computes its blocks (`c`, `c + num_cores`, ...) in VMEM and copies
each to its slice of the HBM output (`pltpu.sync_copy` to `o.at[pl.ds(...)]`).
Values are computed in int32 and cast to the output dtype in the kernel, as
torch.arange rounds exact integers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels.shapes import cdiv
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu import chip
from torch_pallas.kernels.tpu.cores import core_index, tensorcore_mesh


@dataclasses.dataclass(frozen=True)
class IotaConfig:
    block: int | None  # elements per VMEM block; None: the whole output

    @classmethod
    def default(cls, backend: str) -> "IotaConfig":
        return cls(block=None) if backend == "interpret" else cls(block=1024)


def iota_kernel(o_hbm, o_vmem, *, blocks_per_core, num_cores):
    core = core_index(num_cores)
    block = o_vmem.shape[0]

    @pl.loop(0, blocks_per_core)
    def _(i):
        b = i * num_cores + core
        values = jax.lax.broadcasted_iota(jnp.int32, (block,), 0) + b * block
        o_vmem[...] = values.astype(o_vmem.dtype)
        pltpu.sync_copy(o_vmem, o_hbm.at[pl.ds(b * block, block)])


def iota(n, dtype, *, config: IotaConfig, num_cores: int, interpret):
    """[0, 1, ..., n-1] as a 1-D array of `dtype` (a name)."""
    dtype = jnp.dtype(dtype)
    block = config.block or n
    blocks_per_core = cdiv(cdiv(n, block), num_cores)
    out = pl.kernel(
        functools.partial(iota_kernel, blocks_per_core=blocks_per_core, num_cores=num_cores),
        out_type=jax.ShapeDtypeStruct((blocks_per_core * num_cores * block,), dtype),
        mesh=tensorcore_mesh(num_cores),
        scratch_types=dict(o_vmem=pltpu.VMEM((block,), dtype)),
        interpret=interpret,
    )()
    return out[:n]


KERNEL = KernelSpec(run=chip.widening_float16(iota), default_config=IotaConfig.default)
