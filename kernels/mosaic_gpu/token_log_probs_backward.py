"""token_log_probs' backward on Hopper: dz for one chunk of rows of logits
z (R, V), from the forward's log-sum-exp and E (each row's p-weighted mean
of the tempered logits) and the upstream gradients of each row's
log-probability and entropy (kernels/cross_entropy.py's
`log_prob_gradient`).

linear_cross_entropy's backward's walk (linear_cross_entropy_backward.py):
a program per block of 64 rows walks its column tiles with
`plgpu.emit_pipeline`, computing each tile of dz in float32 and storing it,
in z's dtype, through SMEM by TMA.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels.cross_entropy import log_prob_gradient
from torch_pallas.kernels.mosaic_gpu.linear_cross_entropy import logit_tiles, padded_inputs
from torch_pallas.kernels.mosaic_gpu.rms_norm import (
    ROW_AXIS,
    RowTilesConfig,
    Tiles,
    by_row,
    store_tiles,
)
from torch_pallas.kernels.mosaic_gpu.token_log_probs import tile_tempered
from torch_pallas.kernels.spec import KernelSpec


def log_prob_gradient_kernel(z_gmem, t_gmem, lse_gmem, expected_gmem, grad_log_prob_gmem,
                             grad_entropy_gmem, dz_gmem, *, softcap: float, temperature: float,
                             tiles: Tiles):
    """z_gmem (Rp, Cp); t_gmem (Rp,) int32; the per-row inputs (Rp,)
    float32; output dz (Rp, Cp) in z's dtype."""
    config = tiles.config
    row_block = jax.lax.axis_index(ROW_AXIS)
    col_tiles = z_gmem.shape[1] // config.block_cols
    row_spec = plgpu.BlockSpec((config.block_rows,), lambda j: (row_block,))

    def gradients(write):
        def body(indices, z_smem, t_smem, *row_smem):
            (j,) = indices
            u, _, is_target = tile_tempered(tiles, j, z_smem, t_smem, softcap, temperature)
            lse, expected, a, b = (by_row(tiles.load_rows(r), u.shape) for r in row_smem)
            write(j, log_prob_gradient(u, lse, expected, is_target, a, b, softcap=softcap,
                                       temperature=temperature))

        plgpu.emit_pipeline(
            body, grid=(col_tiles,),
            in_specs=[*logit_tiles(tiles, z_gmem, t_gmem, row_block)] + [row_spec] * 4,
            max_concurrent_steps=tiles.steps(col_tiles),
        )(z_gmem, t_gmem, lse_gmem, expected_gmem, grad_log_prob_gmem, grad_entropy_gmem)

    store_tiles(gradients, dz_gmem, row_block, tiles)


def token_log_probs_backward(logits, target, lse, expected, grad_log_prob, grad_entropy, *,
                             softcap: float, temperature: float, config: RowTilesConfig,
                             interpret):
    """dz (R, V) in the logits' dtype, for logits (R, V), target (R,) int32
    and the per-row float32 vectors (R,)."""
    rows, vocab = logits.shape
    inputs = padded_inputs(logits, target, config, lse, expected, grad_log_prob, grad_entropy)
    dz = plgpu.kernel(
        functools.partial(log_prob_gradient_kernel, softcap=softcap, temperature=temperature,
                          tiles=Tiles(hardware=interpret is None, config=config)),
        out_type=jax.ShapeDtypeStruct(inputs[0].shape, logits.dtype),
        grid=(inputs[0].shape[0] // config.block_rows,),
        grid_names=(ROW_AXIS,),
        interpret=interpret,
    )(*inputs)
    return dz[:rows, :vocab]


KERNEL = KernelSpec(run=token_log_probs_backward, default_config=RowTilesConfig.default)
