"""Elementwise addition with operands staged GMEM -> SMEM by
`plgpu.emit_pipeline`, for any shape (broadcasting included) and dtype.

The operands are broadcast, flattened and viewed as a (rows, cols) matrix,
zero-padded to whole blocks. A parallel grid gives each CUDA block
`blocks_per_program` consecutive row blocks; inside it `emit_pipeline` keeps
up to `max_concurrent_steps` TMA copies of x and y in flight while the body
adds the previous pair in registers and stores the sum to its GMEM slice.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels.mosaic_gpu.fences import fenced
from torch_pallas.kernels.padding import as_rows
from torch_pallas.kernels.spec import KernelSpec


@dataclasses.dataclass(frozen=True)
class AddConfig:
    block_rows: int
    block_cols: int
    blocks_per_program: int  # pipeline steps per CUDA block
    max_concurrent_steps: int

    @classmethod
    def default(cls, backend: str) -> "AddConfig":
        return cls(block_rows=32, block_cols=128, blocks_per_program=4, max_concurrent_steps=2)


def add_kernel(x_gmem, y_gmem, o_gmem, *, config: AddConfig):
    rows_per_block = config.block_rows
    first = jax.lax.axis_index("p") * config.blocks_per_program

    def body(indices, x_smem, y_smem):
        (step,) = indices
        rows = pl.ds((first + step) * rows_per_block, rows_per_block)
        o_gmem[rows, :] = x_smem[...] + y_smem[...]

    spec = plgpu.BlockSpec(
        (config.block_rows, config.block_cols), lambda step: (first + step, 0)
    )
    plgpu.emit_pipeline(
        fenced(body),  # plain loads of the slots the pipeline refills by TMA
        grid=(config.blocks_per_program,),
        in_specs=[spec, spec],
        max_concurrent_steps=config.max_concurrent_steps,
    )(x_gmem, y_gmem)


def add(x, y, out_shape, *, config: AddConfig, interpret):
    """x + y, broadcast to `out_shape`."""
    n = math.prod(out_shape)
    rows_per_program = config.block_rows * config.blocks_per_program
    xm = as_rows(jnp.broadcast_to(x, out_shape), config.block_cols, rows_per_program)
    ym = as_rows(jnp.broadcast_to(y, out_shape), config.block_cols, rows_per_program)
    out = plgpu.kernel(
        functools.partial(add_kernel, config=config),
        out_type=jax.ShapeDtypeStruct(xm.shape, xm.dtype),
        grid=(xm.shape[0] // rows_per_program,),
        grid_names=("p",),
        interpret=interpret,
    )(xm, ym)
    return out.reshape(-1)[:n].reshape(out_shape)


KERNEL = KernelSpec(run=add, default_config=AddConfig.default)
