"""linear_cross_entropy's backward on Hopper: dL/dz for one chunk of rows
of logits z (R, V), from the forward's log-sum-exp, each row's gradient
factor and the targets (kernels/cross_entropy.py has the formula).

A program per block of 64 rows walks its column tiles
(`plgpu.emit_pipeline`, the forward's staging: linear_cross_entropy.py),
computing each tile of dz in float32 and storing it, in z's dtype, through
SMEM by TMA (rms_norm.py's `store_tiles`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels.cross_entropy import logit_gradient
from torch_pallas.kernels.mosaic_gpu.linear_cross_entropy import (
    logit_tiles,
    padded_inputs,
    tile_logits,
)
from torch_pallas.kernels.mosaic_gpu.rms_norm import (
    ROW_AXIS,
    RowTilesConfig,
    Tiles,
    by_row,
    store_tiles,
)
from torch_pallas.kernels.spec import KernelSpec


def logit_gradient_kernel(z_gmem, t_gmem, lse_gmem, scale_gmem, dz_gmem, *, vocab: int,
                          smoothing: float, softcap: float, tiles: Tiles):
    """z_gmem (Rp, Cp); t_gmem (Rp,) int32; lse_gmem, scale_gmem (Rp,)
    float32; output dz (Rp, Cp) in z's dtype."""
    config = tiles.config
    row_block = jax.lax.axis_index(ROW_AXIS)
    col_tiles = z_gmem.shape[1] // config.block_cols
    row_spec = plgpu.BlockSpec((config.block_rows,), lambda j: (row_block,))

    def gradients(write):
        def body(indices, z_smem, t_smem, lse_smem, scale_smem):
            (j,) = indices
            z, _, is_target = tile_logits(tiles, j, z_smem, t_smem, softcap)
            lse = by_row(tiles.load_rows(lse_smem), z.shape)
            scale = by_row(tiles.load_rows(scale_smem), z.shape)
            write(j, logit_gradient(z, lse, is_target, scale, vocab=vocab, smoothing=smoothing,
                                    softcap=softcap))

        plgpu.emit_pipeline(
            body, grid=(col_tiles,),
            in_specs=[*logit_tiles(tiles, z_gmem, t_gmem, row_block), row_spec, row_spec],
            max_concurrent_steps=tiles.steps(col_tiles),
        )(z_gmem, t_gmem, lse_gmem, scale_gmem)

    store_tiles(gradients, dz_gmem, row_block, tiles)


def linear_cross_entropy_backward(logits, target, lse, scale, *, smoothing: float,
                                  softcap: float, config: RowTilesConfig, interpret):
    """dL/dz (R, V) in the logits' dtype, for logits (R, V), target (R,)
    int32, lse and scale (R,) float32."""
    rows, vocab = logits.shape
    inputs = padded_inputs(logits, target, config, lse, scale)
    dz = plgpu.kernel(
        functools.partial(logit_gradient_kernel, vocab=vocab, smoothing=smoothing,
                          softcap=softcap, tiles=Tiles(hardware=interpret is None, config=config)),
        out_type=jax.ShapeDtypeStruct(inputs[0].shape, logits.dtype),
        grid=(inputs[0].shape[0] // config.block_rows,),
        grid_names=(ROW_AXIS,),
        interpret=interpret,
    )(*inputs)
    return dz[:rows, :vocab]
KERNEL = KernelSpec(run=linear_cross_entropy_backward, default_config=RowTilesConfig.default)
