"""token_log_probs on the TensorCores: for one chunk of rows of logits z
(R, V) (the op computes them, chunk by chunk, with the matmul kernels) and
their targets, each row's log-probability of its target at temperature T,
the entropy of its distribution and its log-sum-exp, in float32
(kernels/cross_entropy.py has the formulas):

    u = capped(z) / T,   lse = log sum_j exp(u_j),   E = sum_j p_j u_j
    log p_t = u_t - lse,  entropy = lse - E

One walk over the column blocks, as linear_cross_entropy's loss kernel
walks them (its blocks, padding and core split): the running maximum, the
rescaled sums of exp(u - m) and of exp(u - m) * u, and the target's logit
accumulate in VMEM scratch. A target of -1 marks an ignored row (0 for
both outputs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels.cross_entropy import tempered
from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.shapes import cdiv
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu import chip
from torch_pallas.kernels.tpu.cores import pipeline_core_split, tensorcore_mesh
from torch_pallas.kernels.tpu.linear_cross_entropy import LANES, LogitBlocksConfig, column_index


def log_prob_kernel(z_hbm, t_hbm, log_prob_hbm, entropy_hbm, lse_hbm, *, m_vmem, s_vmem,
                    w_vmem, ut_vmem, vocab: int, softcap: float, temperature: float, block,
                    num_cores: int):
    """z_hbm (Rp, Cp), t_hbm (Rp, 1) int32; outputs (Rp, 1) float32; scratch
    (block rows, LANES) float32 each."""
    rows, cols = z_hbm.shape
    grid = (rows // block[0], cdiv(cols, block[1]))
    ragged = vocab % block[1] != 0

    def body(z_ref, t_ref, log_prob_ref, entropy_ref, lse_ref):
        j = pl.program_id(1)

        @pl.when(j == 0)
        def _():
            m_vmem[...] = jnp.full_like(m_vmem, -jnp.inf)
            for ref in (s_vmem, w_vmem, ut_vmem):
                ref[...] = jnp.zeros_like(ref)

        u = tempered(z_ref[...].astype(jnp.float32), softcap, temperature)
        col = column_index(u.shape, j, block[1])
        ut_vmem[...] += jnp.sum(jnp.where(col == t_ref[...], u, 0.0), axis=1, keepdims=True)
        if ragged:
            u = jnp.where(col < vocab, u, -jnp.inf)
        m_old = m_vmem[...]
        m_new = jnp.maximum(m_old, u.max(axis=1, keepdims=True))  # column 0 is in block 0
        e = jnp.exp(u - m_new[:, :1])
        rescale = jnp.exp(m_old - m_new)
        s_vmem[...] = s_vmem[...] * rescale + jnp.sum(e, axis=1, keepdims=True)
        e_u = jnp.where(e > 0.0, e * u, 0.0)  # (masked columns: 0 * -inf)
        w_vmem[...] = w_vmem[...] * rescale + jnp.sum(e_u, axis=1, keepdims=True)
        m_vmem[...] = m_new

        @pl.when(j == grid[1] - 1)
        def _():
            s = s_vmem[...][:, :1]
            lse = m_vmem[...][:, :1] + chip.log(s)
            valid = t_ref[...] >= 0
            log_prob_ref[...] = jnp.where(valid, ut_vmem[...][:, :1] - lse, 0.0)
            entropy_ref[...] = jnp.where(valid, lse - w_vmem[...][:, :1] / s, 0.0)
            lse_ref[...] = lse

    logits = pl.BlockSpec(block, lambda i, j: (i, j))
    per_row = pl.BlockSpec((block[0], 1), lambda i, j: (i, 0))
    pltpu.emit_pipeline(
        body, grid=grid, in_specs=[logits, per_row], out_specs=[per_row] * 3,
        **pipeline_core_split(num_cores, parallel_dims=1),
    )(z_hbm, t_hbm, log_prob_hbm, entropy_hbm, lse_hbm)


def token_log_probs(logits, target, *, softcap: float, temperature: float,
                    config: LogitBlocksConfig, num_cores: int, interpret):
    """(log_prob, entropy, lse), each (R,) float32, for logits (R, V) and
    target (R,) int32 (-1: ignored)."""
    rows, vocab = logits.shape
    padded_rows, padded_cols, block = config.padded(rows, vocab)
    scratch = pltpu.VMEM((block[0], LANES), jnp.float32)
    outputs = pl.kernel(
        functools.partial(log_prob_kernel, vocab=vocab, softcap=softcap,
                          temperature=temperature, block=block, num_cores=num_cores),
        out_type=(jax.ShapeDtypeStruct((padded_rows, 1), jnp.float32),) * 3,
        mesh=tensorcore_mesh(num_cores),
        scratch_types=dict(m_vmem=scratch, s_vmem=scratch, w_vmem=scratch, ut_vmem=scratch),
        interpret=interpret,
    )(pad_to(logits, (padded_rows, padded_cols)), pad_to(target.reshape(rows, 1),
                                                         (padded_rows, 1)))
    return tuple(o[:rows, 0] for o in outputs)


KERNEL = KernelSpec(run=chip.widening_float16(token_log_probs),
                    default_config=LogitBlocksConfig.default)
