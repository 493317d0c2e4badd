"""0, 1, ..., n-1: the Mosaic GPU quickstart's `iota`, for any length.

A parallel grid (`grid` + `grid_names=('i',)`); block `i` finds its slice
with `jax.lax.axis_index('i')` and writes it with `pl.ds(i * block, block)`.
Values are computed in int32 and cast to the output dtype in the kernel.

The kernel uses Warpgroup lowering semantics: under the default Lane
semantics the hardware lowering cannot give `jnp.arange` a register layout
("Failed to infer the output layout of the iota"; the simulator does not
check layouts), while warpgroup layout inference derives it from the store.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels.shapes import cdiv
from torch_pallas.kernels.spec import KernelSpec


@dataclasses.dataclass(frozen=True)
class IotaConfig:
    block: int  # elements written per grid point (a multiple of 128)

    @classmethod
    def default(cls, backend: str) -> "IotaConfig":
        return cls(block=2048)


def iota_kernel(o_gmem, *, block):
    i = jax.lax.axis_index("i")
    values = jnp.arange(block, dtype=jnp.int32) + i * block
    o_gmem[pl.ds(i * block, block)] = values.astype(o_gmem.dtype)


def iota(n, dtype, *, config: IotaConfig, interpret):
    """[0, 1, ..., n-1] as a 1-D array of `dtype` (a name)."""
    blocks = cdiv(n, config.block)
    out = plgpu.kernel(
        functools.partial(iota_kernel, block=config.block),
        out_type=jax.ShapeDtypeStruct((blocks * config.block,), jnp.dtype(dtype)),
        grid=(blocks,),
        grid_names=("i",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup
        ),
        interpret=interpret,
    )()
    return out[:n]


KERNEL = KernelSpec(run=iota, default_config=IotaConfig.default)
