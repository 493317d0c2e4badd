"""linear_cross_entropy's backward on the TensorCores: dL/dz for one chunk
of rows of logits z (R, V), from the forward's log-sum-exp, each row's
gradient factor (the loss's gradient, over the valid rows' count for
"mean"; 0 for an ignored row) and the targets (kernels/cross_entropy.py):

    dz_j = scale * (exp(z_j - lse) - (1 - e) * [j == t] - e / V)

times the soft cap's derivative where there is one. Elementwise over
(row block, column block) tiles, `pltpu.emit_pipeline`'s row blocks
PARALLEL and split across the TensorCores; the tiles as the forward
(linear_cross_entropy.py) blocks them, the whole chunk on `interpret`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels.cross_entropy import capped, logit_gradient
from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.shapes import cdiv
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu import chip
from torch_pallas.kernels.tpu.cores import pipeline_core_split, tensorcore_mesh
from torch_pallas.kernels.tpu.linear_cross_entropy import LogitBlocksConfig, column_index


def logit_gradient_kernel(z_hbm, t_hbm, lse_hbm, scale_hbm, dz_hbm, *, vocab: int,
                          smoothing: float, softcap: float, block, num_cores: int):
    """z_hbm (Rp, Cp); t_hbm (Rp, 1) int32; lse_hbm, scale_hbm (Rp, 1)
    float32; output dz (Rp, Cp) in z's dtype."""
    rows, cols = z_hbm.shape

    def body(z_ref, t_ref, lse_ref, scale_ref, dz_ref):
        z = capped(z_ref[...].astype(jnp.float32), softcap)
        col = column_index(z.shape, pl.program_id(1), block[1])
        dz = logit_gradient(z, lse_ref[...], col == t_ref[...], scale_ref[...], vocab=vocab,
                            smoothing=smoothing, softcap=softcap)
        dz_ref[...] = dz.astype(dz_ref.dtype)

    logits = pl.BlockSpec(block, lambda i, j: (i, j))
    per_row = pl.BlockSpec((block[0], 1), lambda i, j: (i, 0))
    pltpu.emit_pipeline(
        body, grid=(rows // block[0], cdiv(cols, block[1])),
        in_specs=[logits, per_row, per_row, per_row], out_specs=logits,
        **pipeline_core_split(num_cores, parallel_dims=1),
    )(z_hbm, t_hbm, lse_hbm, scale_hbm, dz_hbm)


def linear_cross_entropy_backward(logits, target, lse, scale, *, smoothing: float,
                                  softcap: float, config: LogitBlocksConfig, num_cores: int,
                                  interpret):
    """dL/dz (R, V) in the logits' dtype, for logits (R, V), target (R,)
    int32, lse and scale (R,) float32."""
    rows, vocab = logits.shape
    padded_rows, padded_cols, block = config.padded(rows, vocab)

    def per_row(v):
        return pad_to(v.reshape(rows, 1), (padded_rows, 1))

    dz = pl.kernel(
        functools.partial(logit_gradient_kernel, vocab=vocab, smoothing=smoothing,
                          softcap=softcap, block=block, num_cores=num_cores),
        out_type=jax.ShapeDtypeStruct((padded_rows, padded_cols), logits.dtype),
        mesh=tensorcore_mesh(num_cores),
        interpret=interpret,
    )(pad_to(logits, (padded_rows, padded_cols)), per_row(target), per_row(lse), per_row(scale))
    return dz[:rows, :vocab]


KERNEL = KernelSpec(run=chip.widening_float16(linear_cross_entropy_backward), default_config=LogitBlocksConfig.default)
