"""token_log_probs on Hopper: for one chunk of rows of logits z (R, V) and
their targets, each row's log-probability of its target at temperature T,
the entropy of its distribution and its log-sum-exp, in float32
(kernels/cross_entropy.py has the formulas).

linear_cross_entropy's loss kernel's walk (linear_cross_entropy.py): a
program per block of 64 rows walks its column tiles once with
`plgpu.emit_pipeline`, carrying in registers the online maximum, the
rescaled sums of exp(u - m) and of exp(u - m) * u, and the target's
tempered logit; the row vectors leave from the registers. An ignored row
(target -1) gives 0 for both outputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels.mosaic_gpu.fences import fenced
from torch_pallas.kernels.mosaic_gpu.linear_cross_entropy import (
    logit_tiles,
    padded_inputs,
    tile_logits,
)
from torch_pallas.kernels.mosaic_gpu.rms_norm import ROW_AXIS, RowTilesConfig, Tiles, by_row
from torch_pallas.kernels.spec import KernelSpec


def tile_tempered(tiles: Tiles, j, z_smem, t_smem, softcap: float, temperature: float):
    """(u = capped logits / T, each one's column, whether it is the target)
    of column tile j, as float32 tiles."""
    z, col, is_target = tile_logits(tiles, j, z_smem, t_smem, softcap)
    return (z if temperature == 1.0 else z * (1.0 / temperature)), col, is_target


def log_prob_kernel(z_gmem, t_gmem, log_prob_gmem, entropy_gmem, lse_gmem, *, vocab: int,
                    softcap: float, temperature: float, tiles: Tiles):
    """z_gmem (Rp, Cp); t_gmem (Rp,) int32; outputs (Rp,) float32."""
    config = tiles.config
    row_block = jax.lax.axis_index(ROW_AXIS)
    col_tiles = z_gmem.shape[1] // config.block_cols

    def step(indices, z_smem, t_smem, carry):
        m, s, w, target_logit = carry
        u, col, is_target = tile_tempered(tiles, indices[0], z_smem, t_smem, softcap,
                                          temperature)
        target_logit = target_logit + jnp.where(is_target, u, 0.0).sum(axis=1)
        valid = col < vocab
        u = jnp.where(valid, u, -jnp.inf)
        m_new = jnp.maximum(m, u.max(axis=1))  # column 0 is in tile 0
        rescale = jnp.exp(m - m_new)
        e = jnp.exp(u - by_row(m_new, u.shape))
        s = s * rescale + e.sum(axis=1)
        w = w * rescale + jnp.where(valid, e * u, 0.0).sum(axis=1)
        return m_new, s, w, target_logit

    zeros = tiles.rows(jnp.zeros((config.block_rows,), jnp.float32))
    minus_inf = tiles.rows(jnp.full((config.block_rows,), -jnp.inf, jnp.float32))
    m, s, w, target_logit = plgpu.emit_pipeline(
        fenced(step), grid=(col_tiles,), in_specs=logit_tiles(tiles, z_gmem, t_gmem, row_block),
        max_concurrent_steps=tiles.steps(col_tiles),
        init_carry=(minus_inf, zeros, zeros, zeros),
    )(z_gmem, t_gmem)
    lse = m + jnp.log(s)
    rows = pl.ds(row_block * config.block_rows, config.block_rows)
    lse_gmem.at[rows][...] = lse
    log_prob_gmem.at[rows][...] = target_logit - lse
    entropy_gmem.at[rows][...] = lse - w / s


def token_log_probs(logits, target, *, softcap: float, temperature: float,
                    config: RowTilesConfig, interpret):
    """(log_prob, entropy, lse), each (R,) float32, for logits (R, V) and
    target (R,) int32 (-1: ignored)."""
    rows, vocab = logits.shape
    inputs = padded_inputs(logits, target, config)
    row_vector = jax.ShapeDtypeStruct(inputs[1].shape, jnp.float32)
    log_prob, entropy, lse = plgpu.kernel(
        functools.partial(log_prob_kernel, vocab=vocab, softcap=softcap,
                          temperature=temperature,
                          tiles=Tiles(hardware=interpret is None, config=config)),
        out_type=(row_vector,) * 3,
        grid=(inputs[1].shape[0] // config.block_rows,),
        grid_names=(ROW_AXIS,),
        interpret=interpret,
    )(*inputs)
    valid = target >= 0
    return (jnp.where(valid, log_prob[:rows], 0.0), jnp.where(valid, entropy[:rows], 0.0),
            lse[:rows])


KERNEL = KernelSpec(run=token_log_probs, default_config=RowTilesConfig.default)
