"""RMSNorm's backward on the TensorCores, from the forward's saved 1/rms.

For a row x with x_hat = x * rstd, g = dy * w (dy where there is no weight;
dy * (1 + w) in the GEMMA casting):

    dx = rstd * (g - x_hat * mean(g * x_hat))
    dw = sum over rows of dy * x_hat      (x_hat rounded to x's dtype: LLAMA)

in float32 (kernels/rms_norm_casting.py: the roundings count as the
identity, as autograd's). `pltpu.emit_pipeline` walks blocks of whole rows
as the forward does; each block writes dx and its share of dw (in the first
row of its own (8, N) block, the rest zeros, so blocks split across the
TensorCores never write the same memory), which one sum outside the kernel
adds up.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels import rms_norm_math
from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.rms_norm_casting import Casting
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu import chip
from torch_pallas.kernels.tpu.cores import pipeline_core_split, tensorcore_mesh
from torch_pallas.kernels.tpu.rms_norm import RowsConfig, row_blocks, select_rows_config

SUBLANES = 8  # the rows of one share of dw: a whole (8, 128) tile row


def rms_norm_backward_kernel(*refs, n: int, casting: Casting, has_weight: bool, block, num_cores):
    if has_weight:
        dy_hbm, x_hbm, rstd_hbm, w_hbm, dx_hbm, dw_hbm = refs
    else:
        (dy_hbm, x_hbm, rstd_hbm, dx_hbm), w_hbm, dw_hbm = refs, None, None

    def body(dy_vmem, x_vmem, rstd_vmem, *rest):
        if has_weight:
            w_vmem, dx_vmem, dw_vmem = rest
        else:
            (dx_vmem,) = rest
        dy = dy_vmem[...].astype(jnp.float32)
        x_hat = x_vmem[...].astype(jnp.float32) * rstd_vmem[...]
        g = dy
        if has_weight:
            g = dy * rms_norm_math.weight_factor(w_vmem[...].astype(jnp.float32), casting)
        mean = jnp.sum(g * x_hat, axis=1, keepdims=True) / n
        dx_vmem[...] = (rstd_vmem[...] * (g - x_hat * mean)).astype(dx_vmem.dtype)
        if has_weight:
            share = jnp.sum(dy * rms_norm_math.rounded(x_hat, casting, x_vmem.dtype), axis=0,
                            keepdims=True)
            first = jax.lax.broadcasted_iota(jnp.int32, dw_vmem.shape, 0) == 0
            dw_vmem[...] = jnp.where(first, share, 0.0)

    rows, cols = x_hbm.shape
    row_block = pl.BlockSpec(block, lambda i, j: (i, 0))
    stats = pl.BlockSpec((block[0], 1), lambda i, j: (i, 0))
    weight = pl.BlockSpec((1, cols), lambda i, j: (0, 0))
    share = pl.BlockSpec((SUBLANES, cols), lambda i, j: (i, 0))
    pltpu.emit_pipeline(
        body,
        grid=(rows // block[0], 1),
        in_specs=[row_block, row_block, stats, *([weight] if has_weight else [])],
        out_specs=[row_block, *([share] if has_weight else [])],
        **pipeline_core_split(num_cores, parallel_dims=1),
    )(dy_hbm, x_hbm, rstd_hbm, *([w_hbm] if has_weight else []), dx_hbm,
      *([dw_hbm] if has_weight else []))


def rms_norm_backward(grad_out, x, rstd, weight=None, *, casting: Casting = Casting.NONE,
                      config: RowsConfig, num_cores: int, interpret):
    """(dx, dw): dx in x's dtype, dw in the weight's (empty float32 without
    a weight), for x (R, N), grad_out (R, N) (in the forward output's
    dtype), rstd (R,) float32."""
    rows, n = x.shape
    padded_rows, padded_cols, block_rows = row_blocks(rows, n, config)
    blocks = padded_rows // block_rows
    inputs = [pad_to(grad_out, (padded_rows, padded_cols)), pad_to(x, (padded_rows, padded_cols)),
              pad_to(rstd.reshape(rows, 1), (padded_rows, 1))]
    out_type = [jax.ShapeDtypeStruct((padded_rows, padded_cols), x.dtype)]
    if weight is not None:
        inputs.append(pad_to(weight.reshape(1, n), (1, padded_cols)))
        out_type.append(jax.ShapeDtypeStruct((blocks * SUBLANES, padded_cols), jnp.float32))
    outs = pl.kernel(
        functools.partial(rms_norm_backward_kernel, n=n, casting=casting,
                          has_weight=weight is not None,
                          block=(block_rows, padded_cols), num_cores=num_cores),
        out_type=tuple(out_type),
        mesh=tensorcore_mesh(num_cores),
        interpret=interpret,
    )(*inputs)
    dx = outs[0][:rows, :n]
    if weight is None:
        return dx, jnp.zeros((0,), jnp.float32)
    return dx, outs[1][:, :n].sum(axis=0).astype(weight.dtype)


KERNEL = KernelSpec(run=chip.widening_float16(rms_norm_backward), default_config=RowsConfig.default,
                    select_config=select_rows_config)
