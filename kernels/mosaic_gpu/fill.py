"""Fill an array with a constant: the Mosaic GPU quickstart's `fill_42`,
generalised to any shape, dtype and value.

A parallel grid over blocks of the flattened output; each block (one CUDA
block, one warpgroup) writes its slice straight from registers to GMEM, the
path the quickstart gives for pure-ALU work (no SMEM, no Tensor Cores).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels.shapes import cdiv
from torch_pallas.kernels.spec import KernelSpec


@dataclasses.dataclass(frozen=True)
class FillConfig:
    block: int  # elements written per grid point (a multiple of 128)

    @classmethod
    def default(cls, backend: str) -> "FillConfig":
        return cls(block=2048)


def fill_kernel(o_gmem, *, value, block):
    i = jax.lax.axis_index("i")
    o_gmem[pl.ds(i * block, block)] = jnp.full((block,), value, o_gmem.dtype)


def fill(shape, value, dtype, *, config: FillConfig, interpret):
    """An array of `shape` and `dtype` (a name) holding `value`."""
    n = math.prod(shape)
    blocks = cdiv(n, config.block)
    out = plgpu.kernel(
        functools.partial(fill_kernel, value=value, block=config.block),
        out_type=jax.ShapeDtypeStruct((blocks * config.block,), jnp.dtype(dtype)),
        grid=(blocks,),
        grid_names=("i",),
        interpret=interpret,
    )()
    return out[:n].reshape(shape)


KERNEL = KernelSpec(run=fill, default_config=FillConfig.default)
