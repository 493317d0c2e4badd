"""LayerNorm's backward on Hopper, from the forward's mean and rstd. With
x_hat = (x - mean) * rstd and g = dy * w, in float32:

    dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))     per row
    dw = sum over rows of dy * x_hat,   db = sum over rows of dy

Two kernels, as rms_norm_backward.py's: dx by row blocks, the row walked
twice (both row sums at once, then dx), and dw, db by column tiles, each
accumulated over every row block into a (64, 64) float32 tile whose 64
rows one sum outside the kernel adds up. Padded columns need no mask here:
the padded weight and dy are zeros there.
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
from torch_pallas.kernels.mosaic_gpu.rms_norm_backward import COL_AXIS
from torch_pallas.kernels.mosaic_gpu.tiles import smem_transforms
from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.spec import KernelSpec


def rows_spec(config: RowTilesConfig, index):
    return plgpu.BlockSpec((config.block_rows,), index)


def layer_norm_dx_kernel(dy_gmem, x_gmem, mean_gmem, rstd_gmem, w_gmem, dx_gmem, *, n: int,
                         tiles: Tiles):
    config = tiles.config
    row_block = jax.lax.axis_index(ROW_AXIS)
    col_tiles = x_gmem.shape[1] // config.block_cols
    specs = [tiles.spec(dy_gmem.dtype, lambda j: (row_block, j)),
             tiles.spec(x_gmem.dtype, lambda j: (row_block, j)),
             rows_spec(config, lambda j: (row_block,)), rows_spec(config, lambda j: (row_block,)),
             tiles.spec(w_gmem.dtype, lambda j: (0, j))]
    gmem = (dy_gmem, x_gmem, mean_gmem, rstd_gmem, w_gmem)

    def terms(dy_smem, x_smem, mean_smem, rstd_smem, w_smem):
        rstd = tiles.load_rows(rstd_smem)
        dy = tiles.load(dy_smem)
        x_hat = (tiles.load(x_smem) - by_row(tiles.load_rows(mean_smem), dy.shape)) * by_row(
            rstd, dy.shape)
        return rstd, x_hat, dy * tiles.load(w_smem)

    def row_sums(indices, *refs):
        *smem, (total_g, total_gx) = refs
        _, x_hat, g = terms(*smem)
        return total_g + g.sum(axis=1), total_gx + (g * x_hat).sum(axis=1)

    zeros = tiles.rows(jnp.zeros((config.block_rows,), jnp.float32))
    total_g, total_gx = plgpu.emit_pipeline(
        fenced(row_sums), grid=(col_tiles,), in_specs=specs, max_concurrent_steps=tiles.steps(col_tiles),
        init_carry=(zeros, zeros),
    )(*gmem)
    mean_g, mean_gx = total_g / n, total_gx / n

    def write_dx(write):
        def body(indices, *smem):
            rstd, x_hat, g = terms(*smem)
            shape = g.shape
            write(indices[0], by_row(rstd, shape) * (g - by_row(mean_g, shape)
                                                     - x_hat * by_row(mean_gx, shape)))

        plgpu.emit_pipeline(body, grid=(col_tiles,), in_specs=specs,
                            max_concurrent_steps=tiles.steps(col_tiles))(*gmem)

    store_tiles(write_dx, dx_gmem, row_block, tiles)


def layer_norm_dwdb_kernel(dy_gmem, x_gmem, mean_gmem, rstd_gmem, dw_gmem, db_gmem, *,
                           tiles: Tiles):
    """Outputs the (block_rows, Np) float32 shares of dw and db."""
    config = tiles.config
    col_tile = jax.lax.axis_index(COL_AXIS)
    row_blocks = x_gmem.shape[0] // config.block_rows
    shape = (config.block_rows, config.block_cols)

    def accumulate(indices, dy_smem, x_smem, mean_smem, rstd_smem, carry):
        acc_w, acc_b = carry
        dy = tiles.load(dy_smem)
        x_hat = (tiles.load(x_smem) - by_row(tiles.load_rows(mean_smem), shape)) * by_row(
            tiles.load_rows(rstd_smem), shape)
        return acc_w + dy * x_hat, acc_b + dy

    zeros = tiles.tile(jnp.zeros(shape, jnp.float32))
    acc_w, acc_b = plgpu.emit_pipeline(
        fenced(accumulate), grid=(row_blocks,),
        in_specs=[tiles.spec(dy_gmem.dtype, lambda i: (i, col_tile)),
                  tiles.spec(x_gmem.dtype, lambda i: (i, col_tile)),
                  rows_spec(config, lambda i: (i,)), rows_spec(config, lambda i: (i,))],
        max_concurrent_steps=tiles.steps(row_blocks), init_carry=(zeros, zeros),
    )(dy_gmem, x_gmem, mean_gmem, rstd_gmem)

    def store(w_smem, b_smem):
        cols = pl.ds(col_tile * config.block_cols, config.block_cols)
        w_smem[...] = acc_w
        b_smem[...] = acc_b
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(w_smem, dw_gmem.at[:, cols])
        plgpu.copy_smem_to_gmem(b_smem, db_gmem.at[:, cols])
        plgpu.wait_smem_to_gmem(0)

    tile = plgpu.SMEM(shape, jnp.float32,
                      transforms=smem_transforms(jnp.float32, config.block_cols * 4))
    pl.run_scoped(store, tile, tile)


def layer_norm_backward(grad_out, x, mean, rstd, weight, *, config: RowTilesConfig, interpret):
    """(dx, dw, db): dx in x's dtype, dw and db float32, for x and grad_out
    (R, N), mean and rstd (R,) float32, weight (N,)."""
    rows, n = x.shape
    padded_rows, padded_cols = config.padded(rows, n)
    dy = pad_to(grad_out, (padded_rows, padded_cols))
    xp = pad_to(x, (padded_rows, padded_cols))
    mean_p, rstd_p = pad_to(mean, (padded_rows,)), pad_to(rstd, (padded_rows,))
    tiles = Tiles(hardware=interpret is None, config=config)
    dx = plgpu.kernel(
        functools.partial(layer_norm_dx_kernel, n=n, tiles=tiles),
        out_type=jax.ShapeDtypeStruct((padded_rows, padded_cols), x.dtype),
        grid=(padded_rows // config.block_rows,),
        grid_names=(ROW_AXIS,),
        interpret=interpret,
    )(dy, xp, mean_p, rstd_p, weight_tile_row(weight, config.block_rows, padded_cols))
    share = jax.ShapeDtypeStruct((config.block_rows, padded_cols), jnp.float32)
    dw, db = plgpu.kernel(
        functools.partial(layer_norm_dwdb_kernel, tiles=tiles),
        out_type=(share, share),
        grid=(padded_cols // config.block_cols,),
        grid_names=(COL_AXIS,),
        interpret=interpret,
    )(dy, xp, mean_p, rstd_p)
    return dx[:rows, :n], dw[:, :n].sum(axis=0), db[:, :n].sum(axis=0)


KERNEL = KernelSpec(run=layer_norm_backward, default_config=RowTilesConfig.default)
