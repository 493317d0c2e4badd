"""linear_cross_entropy's loss on Hopper: for one chunk of rows of logits z
(R, V) (the op computes them, chunk by chunk, with the matmul kernels) and
their targets, each row's loss and log-sum-exp in float32
(kernels/cross_entropy.py has the formulas).

A program takes one block of 64 rows (a wgmma row tile: its row vectors
live in the registers' WGMMA layout, reduced along the row) and walks its
column tiles once with `plgpu.emit_pipeline` (TMA copies GMEM -> SMEM in
flight while the previous tile computes), carrying the online maximum, the
rescaled sum of exponentials (Milakov & Gimelshein 2018), the target's
logit and, with label smoothing, the sum of the logits; the row vectors
leave from the registers. Rows and columns are zero-padded to whole tiles
outside the kernel (rms_norm.py says why); padded columns are masked out.
An ignored row (target -1) has loss 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels.cross_entropy import capped, row_loss
from torch_pallas.kernels.mosaic_gpu.fences import fenced
from torch_pallas.kernels.mosaic_gpu.rms_norm import ROW_AXIS, RowTilesConfig, Tiles, by_row
from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.spec import KernelSpec


def logit_tiles(tiles: Tiles, z_gmem, t_gmem, row_block):
    """The in_specs of a row block's walk over its logits: the column tiles
    of z, and the block's targets (a row vector) at every step."""
    config = tiles.config
    return [tiles.spec(z_gmem.dtype, lambda j: (row_block, j)),
            plgpu.BlockSpec((config.block_rows,), lambda j: (row_block,))]


def tile_logits(tiles: Tiles, j, z_smem, t_smem, softcap: float):
    """(capped logits, each one's column, whether it is the row's target)
    of column tile j, as float32 tiles."""
    z = capped(tiles.load(z_smem), softcap)
    col = (tiles.tile(jax.lax.broadcasted_iota(jnp.int32, z.shape, 1))
           + j * tiles.config.block_cols)
    return z, col, col == by_row(tiles.load_rows(t_smem), z.shape)


def loss_kernel(z_gmem, t_gmem, loss_gmem, lse_gmem, *, vocab: int, smoothing: float,
                softcap: float, tiles: Tiles):
    """z_gmem (Rp, Cp); t_gmem (Rp,) int32; outputs loss and lse (Rp,)
    float32."""
    config = tiles.config
    row_block = jax.lax.axis_index(ROW_AXIS)
    col_tiles = z_gmem.shape[1] // config.block_cols

    def step(indices, z_smem, t_smem, carry):
        m, s, target_logit, logit_sum = carry
        z, col, is_target = tile_logits(tiles, indices[0], z_smem, t_smem, softcap)
        target_logit = target_logit + jnp.where(is_target, z, 0.0).sum(axis=1)
        valid = col < vocab
        if smoothing:
            logit_sum = logit_sum + jnp.where(valid, z, 0.0).sum(axis=1)
        z = jnp.where(valid, z, -jnp.inf)
        m_new = jnp.maximum(m, z.max(axis=1))  # column 0 is in tile 0
        s = s * jnp.exp(m - m_new) + jnp.exp(z - by_row(m_new, z.shape)).sum(axis=1)
        return m_new, s, target_logit, logit_sum

    zeros = tiles.rows(jnp.zeros((config.block_rows,), jnp.float32))
    minus_inf = tiles.rows(jnp.full((config.block_rows,), -jnp.inf, jnp.float32))
    m, s, target_logit, logit_sum = plgpu.emit_pipeline(
        fenced(step), grid=(col_tiles,), in_specs=logit_tiles(tiles, z_gmem, t_gmem, row_block),
        max_concurrent_steps=tiles.steps(col_tiles),
        init_carry=(minus_inf, zeros, zeros, zeros),
    )(z_gmem, t_gmem)
    lse = m + jnp.log(s)
    # The row vectors straight from the registers: 256 bytes each.
    rows = pl.ds(row_block * config.block_rows, config.block_rows)
    lse_gmem.at[rows][...] = lse
    loss_gmem.at[rows][...] = row_loss(lse, target_logit, logit_sum, vocab=vocab,
                                       smoothing=smoothing)


def padded_inputs(logits, target, config: RowTilesConfig, *per_row):
    """The logits as whole tiles, the targets (-1 past the rows) and any
    other per-row vectors zero-padded to the padded rows."""
    rows, vocab = logits.shape
    padded_rows, padded_cols = config.padded(rows, vocab)
    target = jnp.pad(target, (0, padded_rows - rows), constant_values=-1)
    return (pad_to(logits, (padded_rows, padded_cols)), target,
            *(pad_to(v, (padded_rows,)) for v in per_row))


def linear_cross_entropy(logits, target, *, smoothing: float, softcap: float,
                         config: RowTilesConfig, interpret):
    """(loss, lse), each (R,) float32, for logits (R, V) and target (R,)
    int32 (-1: ignored)."""
    rows, vocab = logits.shape
    inputs = padded_inputs(logits, target, config)
    row_vector = jax.ShapeDtypeStruct(inputs[1].shape, jnp.float32)
    loss, lse = plgpu.kernel(
        functools.partial(loss_kernel, vocab=vocab, smoothing=smoothing, softcap=softcap,
                          tiles=Tiles(hardware=interpret is None, config=config)),
        out_type=(row_vector, row_vector),
        grid=(inputs[1].shape[0] // config.block_rows,),
        grid_names=(ROW_AXIS,),
        interpret=interpret,
    )(*inputs)
    return jnp.where(target >= 0, loss[:rows], 0.0), lse[:rows]


KERNEL = KernelSpec(run=linear_cross_entropy, default_config=RowTilesConfig.default)
