"""Elementwise addition, pipelined: the Pallas TPU quickstart's
`add_matrices_pipelined`, for any shape (broadcasting included) and dtype.

The operands are broadcast, flattened and viewed as a (rows, cols) matrix,
zero-padded to whole blocks. `pltpu.emit_pipeline` walks the blocks,
double-buffering HBM -> VMEM copies around the body; its first grid
dimension is PARALLEL and split across the TensorCores (`core_axis_name`),
the second ARBITRARY.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels.padding import as_rows
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu import chip
from torch_pallas.kernels.tpu.cores import pipeline_core_split, tensorcore_mesh


@dataclasses.dataclass(frozen=True)
class AddConfig:
    block_rows: int | None  # None: the whole array as one (1, n) block
    block_cols: int | None

    @classmethod
    def default(cls, backend: str) -> "AddConfig":
        if backend == "interpret":
            return cls(block_rows=None, block_cols=None)
        return cls(block_rows=32, block_cols=128)  # (8, 128)-tiled VMEM blocks


def add_kernel(x_hbm, y_hbm, o_hbm, *, block, num_cores):
    def body(x_vmem, y_vmem, o_vmem):
        o_vmem[...] = x_vmem[...] + y_vmem[...]

    rows, cols = x_hbm.shape
    spec = pl.BlockSpec(block, lambda i, j: (i, j))
    pltpu.emit_pipeline(
        body,
        grid=(rows // block[0], cols // block[1]),
        in_specs=[spec, spec],
        out_specs=spec,
        **pipeline_core_split(num_cores, parallel_dims=1),
    )(x_hbm, y_hbm, o_hbm)


def add(x, y, out_shape, *, config: AddConfig, num_cores: int, interpret):
    """x + y, broadcast to `out_shape`."""
    n = math.prod(out_shape)
    x = jnp.broadcast_to(x, out_shape)
    y = jnp.broadcast_to(y, out_shape)
    if config.block_cols is None:
        block = (1, n)
        xm, ym = x.reshape(block), y.reshape(block)
    else:
        block = (config.block_rows, config.block_cols)
        xm = as_rows(x, config.block_cols, config.block_rows)
        ym = as_rows(y, config.block_cols, config.block_rows)
    out = pl.kernel(
        functools.partial(add_kernel, block=block, num_cores=num_cores),
        out_type=jax.ShapeDtypeStruct(xm.shape, xm.dtype),
        mesh=tensorcore_mesh(num_cores),
        interpret=interpret,
    )(xm, ym)
    return out.reshape(-1)[:n].reshape(out_shape)


KERNEL = KernelSpec(run=chip.widening_float16(add), default_config=AddConfig.default)
