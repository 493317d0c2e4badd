"""RMSNorm's backward on Hopper, from the forward's rstd. With
x_hat = x * rstd and g = dy * w (dy without a weight, dy * (1 + w) in the
GEMMA casting), in float32:

    dx = rstd * (g - x_hat * mean(g * x_hat))      per row
    dw = sum over rows of dy * x_hat               (x_hat rounded to x's dtype
                                                    in the LLAMA casting)

Two kernels, each over tiles as the forward (rms_norm.py) stages them:
- dx: a program per block of 64 rows walks its row's column tiles twice
  (`plgpu.emit_pipeline`), once for the row sums mean(g * x_hat), once to
  write dx;
- dw: a program per tile of 64 columns walks every row block, adding
  dy * x_hat into a (64, 64) float32 tile in its registers (elementwise:
  no reduction across a tile's rows, which its layout splits between
  threads); the 64 rows of each column tile's sum leave by TMA and one sum
  outside the kernel finishes them.
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
from torch_pallas.kernels import rms_norm_math
from torch_pallas.kernels.mosaic_gpu.tiles import smem_transforms
from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.rms_norm_casting import Casting
from torch_pallas.kernels.spec import KernelSpec

COL_AXIS = "cols"


def rms_norm_dx_kernel(dy_gmem, x_gmem, rstd_gmem, *refs, n: int, casting: Casting,
                       has_weight: bool, tiles: Tiles):
    """dy, x (Rp, Np); rstd (Rp,) float32; the weight broadcast to
    (block_rows, Np) when `has_weight`; output dx (Rp, Np)."""
    w_gmem, (dx_gmem,) = (refs[0], refs[1:]) if has_weight else (None, refs)
    config = tiles.config
    row_block = jax.lax.axis_index(ROW_AXIS)
    col_tiles = x_gmem.shape[1] // config.block_cols
    specs = [tiles.spec(dy_gmem.dtype, lambda j: (row_block, j)),
             tiles.spec(x_gmem.dtype, lambda j: (row_block, j)),
             plgpu.BlockSpec((config.block_rows,), lambda j: (row_block,))]
    if has_weight:
        specs.append(tiles.spec(w_gmem.dtype, lambda j: (0, j)))
    gmem = (dy_gmem, x_gmem, rstd_gmem, *([w_gmem] if has_weight else []))

    def terms(dy_smem, x_smem, rstd_smem, w_smem):
        rstd = tiles.load_rows(rstd_smem)
        dy = tiles.load(dy_smem)
        x_hat = tiles.load(x_smem) * by_row(rstd, dy.shape)
        g = dy * rms_norm_math.weight_factor(tiles.load(w_smem), casting) if has_weight else dy
        return rstd, x_hat, g

    def row_sums(indices, dy_smem, x_smem, rstd_smem, *rest):
        *w_smem, total = rest
        _, x_hat, g = terms(dy_smem, x_smem, rstd_smem, w_smem[0] if has_weight else None)
        return total + (g * x_hat).sum(axis=1)

    total = plgpu.emit_pipeline(
        fenced(row_sums), grid=(col_tiles,), in_specs=specs,
        max_concurrent_steps=tiles.steps(col_tiles),
        init_carry=tiles.rows(jnp.zeros((config.block_rows,), jnp.float32)),
    )(*gmem)
    mean = total / n

    def write_dx(write):
        def body(indices, dy_smem, x_smem, rstd_smem, *w_smem):
            rstd, x_hat, g = terms(dy_smem, x_smem, rstd_smem, w_smem[0] if has_weight else None)
            write(indices[0], by_row(rstd, g.shape) * (g - x_hat * by_row(mean, g.shape)))

        plgpu.emit_pipeline(
            body, grid=(col_tiles,), in_specs=specs, max_concurrent_steps=tiles.steps(col_tiles),
        )(*gmem)

    store_tiles(write_dx, dx_gmem, row_block, tiles)


def rms_norm_dw_kernel(dy_gmem, x_gmem, rstd_gmem, shares_gmem, *, casting: Casting,
                       tiles: Tiles):
    """dy, x (Rp, Np); rstd (Rp,) float32; output shares (block_rows, Np)
    float32, whose column sums are dw."""
    config = tiles.config
    col_tile = jax.lax.axis_index(COL_AXIS)
    row_blocks = x_gmem.shape[0] // config.block_rows
    shape = (config.block_rows, config.block_cols)

    def accumulate(indices, dy_smem, x_smem, rstd_smem, acc):
        dy = tiles.load(dy_smem)
        x_hat = tiles.load(x_smem) * by_row(tiles.load_rows(rstd_smem), dy.shape)
        return acc + dy * rms_norm_math.rounded(x_hat, casting, x_gmem.dtype)

    zeros = jnp.zeros(shape, jnp.float32)
    if tiles.hardware:
        zeros = plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)
    acc = plgpu.emit_pipeline(
        fenced(accumulate), grid=(row_blocks,),
        in_specs=[tiles.spec(dy_gmem.dtype, lambda i: (i, col_tile)),
                  tiles.spec(x_gmem.dtype, lambda i: (i, col_tile)),
                  plgpu.BlockSpec((config.block_rows,), lambda i: (i,))],
        max_concurrent_steps=tiles.steps(row_blocks), init_carry=zeros,
    )(dy_gmem, x_gmem, rstd_gmem)

    def store(acc_smem):
        acc_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            acc_smem, shares_gmem.at[:, pl.ds(col_tile * config.block_cols, config.block_cols)])
        plgpu.wait_smem_to_gmem(0)

    row_bytes = config.block_cols * 4
    pl.run_scoped(store, plgpu.SMEM(shape, jnp.float32,
                                    transforms=smem_transforms(jnp.float32, row_bytes)))


def rms_norm_backward(grad_out, x, rstd, weight=None, *, casting: Casting = Casting.NONE,
                      config: RowTilesConfig, interpret):
    """(dx, dw): dx in x's dtype, dw in the weight's (empty float32 without
    a weight), for x (R, N), grad_out (R, N) (in the forward output's
    dtype), rstd (R,) float32."""
    rows, n = x.shape
    padded_rows, padded_cols = config.padded(rows, n)
    dy = pad_to(grad_out, (padded_rows, padded_cols))
    xp = pad_to(x, (padded_rows, padded_cols))
    rstd_p = pad_to(rstd, (padded_rows,))
    tiles = Tiles(hardware=interpret is None, config=config)
    inputs = [dy, xp, rstd_p]
    if weight is not None:
        inputs.append(weight_tile_row(weight, config.block_rows, padded_cols))
    dx = plgpu.kernel(
        functools.partial(rms_norm_dx_kernel, n=n, casting=casting, has_weight=weight is not None,
                          tiles=tiles),
        out_type=jax.ShapeDtypeStruct((padded_rows, padded_cols), x.dtype),
        grid=(padded_rows // config.block_rows,),
        grid_names=(ROW_AXIS,),
        interpret=interpret,
    )(*inputs)[:rows, :n]
    if weight is None:
        return dx, jnp.zeros((0,), jnp.float32)
    shares = plgpu.kernel(
        functools.partial(rms_norm_dw_kernel, casting=casting, tiles=tiles),
        out_type=jax.ShapeDtypeStruct((config.block_rows, padded_cols), jnp.float32),
        grid=(padded_cols // config.block_cols,),
        grid_names=(COL_AXIS,),
        interpret=interpret,
    )(dy, xp, rstd_p)
    return dx, shares[:, :n].sum(axis=0).astype(weight.dtype)


KERNEL = KernelSpec(run=rms_norm_backward, default_config=RowTilesConfig.default)
