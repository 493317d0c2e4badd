"""LayerNorm's forward on Hopper, as `torch.nn.functional.layer_norm`
computes it (Ba, Kiros & Hinton 2016): per row, in float32, the mean and
the variance by the corrected two-pass algorithm (the row centred on its
rough mean, exact where x is near it, then corrected: tpu/layer_norm.py),
and out = (x - mean) * rstd * weight + bias, rounded once to
x's dtype; mean and rstd kept for the backward.

Tiles as rms_norm.py's: a program per block of 64 rows (row vectors in the
WGMMA layout), the row walked tile by tile of 64 columns by
`plgpu.emit_pipeline`, three times (sum; centred sums and squares; output), the
output leaving through SMEM by TMA. Padded columns are masked out of the
centred squares. The op hands a missing weight as ones and a missing bias
as zeros, broadcast to one tile row outside the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels.mosaic_gpu.fences import fenced
from torch_pallas.kernels.mosaic_gpu.rms_norm import (
    ROW_AXIS,
    RowTilesConfig,
    Tiles,
    by_row,
    store_tiles,
    weight_tile_row,
)
from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels import shapes
from torch_pallas.kernels.spec import KernelSpec


def layer_norm_kernel(x_gmem, w_gmem, b_gmem, o_gmem, mean_gmem, rstd_gmem, *, n: int,
                      eps: float, tiles: Tiles):
    """x_gmem (Rp, Np); weight and bias broadcast to (block_rows, Np);
    outputs o (Rp, Np), mean and rstd (Rp,) float32."""
    config = tiles.config
    row_block = jax.lax.axis_index(ROW_AXIS)
    col_tiles = x_gmem.shape[1] // config.block_cols
    x_spec = tiles.spec(x_gmem.dtype, lambda j: (row_block, j))
    zeros = tiles.rows(jnp.zeros((config.block_rows,), jnp.float32))

    def row_pass(body):
        return plgpu.emit_pipeline(fenced(body), grid=(col_tiles,), in_specs=[x_spec],
                                   max_concurrent_steps=tiles.steps(col_tiles),
                                   init_carry=zeros)(x_gmem)

    shape = (config.block_rows, config.block_cols)
    rough = row_pass(lambda indices, x_smem, total: total + tiles.load(x_smem).sum(axis=1)) / n

    def centred(j, x_smem, shift):
        """x less the rough mean (exact where x is near it) less `shift`."""
        x = tiles.load(x_smem) - by_row(rough, shape) - by_row(shift, shape)
        col = tiles.tile(jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)) + j * config.block_cols
        return jnp.where(col < n, x, 0.0)

    def sums(indices, x_smem, totals):
        d = centred(indices[0], x_smem, zeros)
        return totals[0] + d.sum(axis=1), totals[1] + (d * d).sum(axis=1)

    first, second = plgpu.emit_pipeline(
        fenced(sums), grid=(col_tiles,), in_specs=[x_spec], max_concurrent_steps=tiles.steps(col_tiles),
        init_carry=(zeros, zeros))(x_gmem)
    shift = first / n  # the rough mean's error (corrected two-pass)
    mean = rough + shift
    rstd = jax.lax.rsqrt((second - first * shift) / n + eps)
    # mean and rstd straight from the registers: 256 bytes each
    rows = pl.ds(row_block * config.block_rows, config.block_rows)
    mean_gmem.at[rows][...] = mean
    rstd_gmem.at[rows][...] = rstd

    def normalize(write):
        def body(indices, x_smem, w_smem, b_smem):
            (j,) = indices
            y = centred(j, x_smem, shift) * by_row(rstd, shape)
            write(j, y * tiles.load(w_smem) + tiles.load(b_smem))

        param = lambda gmem: tiles.spec(gmem.dtype, lambda j: (0, j))  # noqa: E731
        plgpu.emit_pipeline(
            body, grid=(col_tiles,), in_specs=[x_spec, param(w_gmem), param(b_gmem)],
            max_concurrent_steps=tiles.steps(col_tiles),
        )(x_gmem, w_gmem, b_gmem)

    store_tiles(normalize, o_gmem, row_block, tiles)


def layer_norm(x, weight, bias, *, eps: float, config: RowTilesConfig, interpret):
    """(out, mean, rstd) for x (..., N), weight and bias (N,): out in x's
    shape and dtype, mean and rstd (...) float32."""
    x, lead = shapes.rows(x)
    rows, n = x.shape
    padded_rows, padded_cols = config.padded(rows, n)
    tiles = Tiles(hardware=interpret is None, config=config)
    stats = jax.ShapeDtypeStruct((padded_rows,), jnp.float32)
    out, mean, rstd = plgpu.kernel(
        functools.partial(layer_norm_kernel, n=n, eps=eps, tiles=tiles),
        out_type=(jax.ShapeDtypeStruct((padded_rows, padded_cols), x.dtype), stats, stats),
        grid=(padded_rows // config.block_rows,),
        grid_names=(ROW_AXIS,),
        interpret=interpret,
    )(pad_to(x, (padded_rows, padded_cols)),
      weight_tile_row(weight, config.block_rows, padded_cols),
      weight_tile_row(bias, config.block_rows, padded_cols))
    return out[:rows, :n].reshape(*lead, n), mean[:rows].reshape(lead), rstd[:rows].reshape(lead)


KERNEL = KernelSpec(run=layer_norm, default_config=RowTilesConfig.default)
