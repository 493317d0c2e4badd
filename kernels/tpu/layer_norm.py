"""LayerNorm's forward on the TensorCores, as `torch.nn.functional.layer_norm`
computes it (Ba, Kiros & Hinton 2016, "Layer Normalization"): per row of
x (R, N), in float32,

    mean = sum(x) / N,  rstd = 1 / sqrt(sum((x - mean)^2) / N + eps)
    out  = (x - mean) * rstd * weight + bias      (rounded once to x's dtype)

the row centred on its rough mean (x - sum(x)/N, exact where x lies near
its mean), then on the mean that corrects (the corrected two-pass
algorithm: Chan, Golub & LeVeque 1983), so that rows far from zero keep
their precision; the variance from the centred row, not E[x^2] - mean^2,
which cancels. mean and rstd are
kept for the backward. Blocks of whole rows as rms_norm.py's; the padded
columns are masked out of the variance (they are zeros, not the mean).
The op hands a missing weight as ones and a missing bias as zeros.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels import shapes
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu import chip
from torch_pallas.kernels.tpu.cores import pipeline_core_split, tensorcore_mesh
from torch_pallas.kernels.tpu.rms_norm import RowsConfig, row_blocks, select_rows_config


def layer_norm_kernel(x_hbm, w_hbm, b_hbm, o_hbm, mean_hbm, rstd_hbm, *, n: int, eps: float,
                      block, num_cores):
    def body(x_vmem, w_vmem, b_vmem, o_vmem, mean_vmem, rstd_vmem):
        x = x_vmem[...].astype(jnp.float32)
        rough = jnp.sum(x, axis=1, keepdims=True) / n
        inside = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) < n
        d = jnp.where(inside, x - rough, 0.0)  # exact where x is near its mean
        shift = jnp.sum(d, axis=1, keepdims=True) / n  # the rough mean's error
        centred = jnp.where(inside, d - shift, 0.0)
        mean = rough + shift
        rstd = jax.lax.rsqrt(jnp.sum(centred * centred, axis=1, keepdims=True) / n + eps)
        y = centred * rstd * w_vmem[...].astype(jnp.float32) + b_vmem[...].astype(jnp.float32)
        o_vmem[...] = y.astype(o_vmem.dtype)
        mean_vmem[...] = mean
        rstd_vmem[...] = rstd

    rows, cols = x_hbm.shape
    row_block = pl.BlockSpec(block, lambda i, j: (i, 0))
    param = pl.BlockSpec((1, cols), lambda i, j: (0, 0))
    stats = pl.BlockSpec((block[0], 1), lambda i, j: (i, 0))
    pltpu.emit_pipeline(
        body,
        grid=(rows // block[0], 1),
        in_specs=[row_block, param, param],
        out_specs=[row_block, stats, stats],
        **pipeline_core_split(num_cores, parallel_dims=1),
    )(x_hbm, w_hbm, b_hbm, o_hbm, mean_hbm, rstd_hbm)


def layer_norm(x, weight, bias, *, eps: float, config: RowsConfig, num_cores: int, interpret):
    """(out, mean, rstd) for x (..., N), weight and bias (N,): out in x's
    shape and dtype, mean and rstd (...) float32."""
    x, lead = shapes.rows(x)
    rows, n = x.shape
    padded_rows, padded_cols, block_rows = row_blocks(rows, n, config)
    params = [pad_to(p.reshape(1, n), (1, padded_cols)) for p in (weight, bias)]
    stats = jax.ShapeDtypeStruct((padded_rows, 1), jnp.float32)
    out, mean, rstd = pl.kernel(
        functools.partial(layer_norm_kernel, n=n, eps=eps, block=(block_rows, padded_cols),
                          num_cores=num_cores),
        out_type=(jax.ShapeDtypeStruct((padded_rows, padded_cols), x.dtype), stats, stats),
        mesh=tensorcore_mesh(num_cores),
        interpret=interpret,
    )(pad_to(x, (padded_rows, padded_cols)), *params)
    return out[:rows, :n].reshape(*lead, n), mean[:rows, 0].reshape(lead), \
        rstd[:rows, 0].reshape(lead)


KERNEL = KernelSpec(run=chip.widening_float16(layer_norm), default_config=RowsConfig.default,
                    select_config=select_rows_config)
