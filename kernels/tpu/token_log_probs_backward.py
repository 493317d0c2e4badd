"""token_log_probs' backward on the TensorCores: dz for one chunk of rows
of logits z (R, V), from the forward's log-sum-exp and E (each row's
p-weighted mean of the tempered logits) and the upstream gradients of each
row's log-probability and entropy (0 on an ignored row), elementwise
(kernels/cross_entropy.py's `log_prob_gradient`) over linear_cross_entropy's
(row block, column block) tiles, the row blocks PARALLEL across the
TensorCores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels.cross_entropy import log_prob_gradient, tempered
from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.shapes import cdiv
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu import chip
from torch_pallas.kernels.tpu.cores import pipeline_core_split, tensorcore_mesh
from torch_pallas.kernels.tpu.linear_cross_entropy import LogitBlocksConfig, column_index


def log_prob_gradient_kernel(z_hbm, t_hbm, lse_hbm, expected_hbm, grad_log_prob_hbm,
                             grad_entropy_hbm, dz_hbm, *, softcap: float, temperature: float,
                             block, num_cores: int):
    """z_hbm (Rp, Cp); t_hbm (Rp, 1) int32; the per-row inputs (Rp, 1)
    float32; output dz (Rp, Cp) in z's dtype."""
    rows, cols = z_hbm.shape

    def body(z_ref, t_ref, lse_ref, expected_ref, a_ref, b_ref, dz_ref):
        u = tempered(z_ref[...].astype(jnp.float32), softcap, temperature)
        col = column_index(u.shape, pl.program_id(1), block[1])
        dz = log_prob_gradient(u, lse_ref[...], expected_ref[...], col == t_ref[...], a_ref[...],
                               b_ref[...], softcap=softcap, temperature=temperature)
        dz_ref[...] = dz.astype(dz_ref.dtype)

    logits = pl.BlockSpec(block, lambda i, j: (i, j))
    per_row = pl.BlockSpec((block[0], 1), lambda i, j: (i, 0))
    pltpu.emit_pipeline(
        body, grid=(rows // block[0], cdiv(cols, block[1])),
        in_specs=[logits] + [per_row] * 5, out_specs=logits,
        **pipeline_core_split(num_cores, parallel_dims=1),
    )(z_hbm, t_hbm, lse_hbm, expected_hbm, grad_log_prob_hbm, grad_entropy_hbm, dz_hbm)


def token_log_probs_backward(logits, target, lse, expected, grad_log_prob, grad_entropy, *,
                             softcap: float, temperature: float, config: LogitBlocksConfig,
                             num_cores: int, interpret):
    """dz (R, V) in the logits' dtype, for logits (R, V), target (R,) int32
    and the per-row float32 vectors (R,)."""
    rows, vocab = logits.shape
    padded_rows, padded_cols, block = config.padded(rows, vocab)

    def per_row(v):
        return pad_to(v.reshape(rows, 1), (padded_rows, 1))

    dz = pl.kernel(
        functools.partial(log_prob_gradient_kernel, softcap=softcap, temperature=temperature,
                          block=block, num_cores=num_cores),
        out_type=jax.ShapeDtypeStruct((padded_rows, padded_cols), logits.dtype),
        mesh=tensorcore_mesh(num_cores),
        interpret=interpret,
    )(pad_to(logits, (padded_rows, padded_cols)),
      *(per_row(v) for v in (target, lse, expected, grad_log_prob, grad_entropy)))
    return dz[:rows, :vocab]


KERNEL = KernelSpec(run=chip.widening_float16(token_log_probs_backward),
                    default_config=LogitBlocksConfig.default)
