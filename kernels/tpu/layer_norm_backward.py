"""LayerNorm's backward on the TensorCores, from the forward's mean and
rstd. With x_hat = (x - mean) * rstd and g = dy * w, in float32:

    dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))     per row
    dw = sum over rows of dy * x_hat,   db = sum over rows of dy

Blocks of whole rows as the forward's; each block writes dx and its shares
of dw and db (in the first row of its own (8, N) blocks, as
rms_norm_backward.py's), which one sum outside the kernel adds up.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu import chip
from torch_pallas.kernels.tpu.cores import pipeline_core_split, tensorcore_mesh
from torch_pallas.kernels.tpu.rms_norm import RowsConfig, row_blocks, select_rows_config
from torch_pallas.kernels.tpu.rms_norm_backward import SUBLANES


def layer_norm_backward_kernel(dy_hbm, x_hbm, mean_hbm, rstd_hbm, w_hbm, dx_hbm, dw_hbm, db_hbm,
                               *, n: int, block, num_cores):
    def body(dy_vmem, x_vmem, mean_vmem, rstd_vmem, w_vmem, dx_vmem, dw_vmem, db_vmem):
        dy = dy_vmem[...].astype(jnp.float32)
        rstd = rstd_vmem[...]
        inside = jax.lax.broadcasted_iota(jnp.int32, dy.shape, 1) < n
        x_hat = jnp.where(inside, (x_vmem[...].astype(jnp.float32) - mean_vmem[...]) * rstd, 0.0)
        g = dy * w_vmem[...].astype(jnp.float32)
        mean_g = jnp.sum(g, axis=1, keepdims=True) / n
        mean_gx = jnp.sum(g * x_hat, axis=1, keepdims=True) / n
        dx_vmem[...] = (rstd * (g - mean_g - x_hat * mean_gx)).astype(dx_vmem.dtype)
        first = jax.lax.broadcasted_iota(jnp.int32, dw_vmem.shape, 0) == 0
        dw_vmem[...] = jnp.where(first, jnp.sum(dy * x_hat, axis=0, keepdims=True), 0.0)
        db_vmem[...] = jnp.where(first, jnp.sum(dy, axis=0, keepdims=True), 0.0)

    rows, cols = x_hbm.shape
    row_block = pl.BlockSpec(block, lambda i, j: (i, 0))
    stats = pl.BlockSpec((block[0], 1), lambda i, j: (i, 0))
    param = pl.BlockSpec((1, cols), lambda i, j: (0, 0))
    share = pl.BlockSpec((SUBLANES, cols), lambda i, j: (i, 0))
    pltpu.emit_pipeline(
        body,
        grid=(rows // block[0], 1),
        in_specs=[row_block, row_block, stats, stats, param],
        out_specs=[row_block, share, share],
        **pipeline_core_split(num_cores, parallel_dims=1),
    )(dy_hbm, x_hbm, mean_hbm, rstd_hbm, w_hbm, dx_hbm, dw_hbm, db_hbm)


def layer_norm_backward(grad_out, x, mean, rstd, weight, *, config: RowsConfig, num_cores: int,
                        interpret):
    """(dx, dw, db): dx in x's dtype, dw and db float32 (the op casts them
    to the parameters' dtypes), for x and grad_out (R, N), mean and rstd
    (R,) float32, weight (N,)."""
    rows, n = x.shape
    padded_rows, padded_cols, block_rows = row_blocks(rows, n, config)
    blocks = padded_rows // block_rows
    stats = [pad_to(s.reshape(rows, 1), (padded_rows, 1)) for s in (mean, rstd)]
    share = jax.ShapeDtypeStruct((blocks * SUBLANES, padded_cols), jnp.float32)
    dx, dw, db = pl.kernel(
        functools.partial(layer_norm_backward_kernel, n=n, block=(block_rows, padded_cols),
                          num_cores=num_cores),
        out_type=(jax.ShapeDtypeStruct((padded_rows, padded_cols), x.dtype), share, share),
        mesh=tensorcore_mesh(num_cores),
        interpret=interpret,
    )(pad_to(grad_out, (padded_rows, padded_cols)), pad_to(x, (padded_rows, padded_cols)),
      *stats, pad_to(weight.reshape(1, n), (1, padded_cols)))
    return dx[:rows, :n], dw[:, :n].sum(axis=0), db[:, :n].sum(axis=0)


KERNEL = KernelSpec(run=chip.widening_float16(layer_norm_backward), default_config=RowsConfig.default,
                    select_config=select_rows_config)
