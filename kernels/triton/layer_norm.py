"""LayerNorm's forward in Triton: one program per row, the whole row in
registers, as `torch.nn.functional.layer_norm` computes it: the mean
(corrected: the row centred on its rough mean first, tpu/layer_norm.py
says why), the variance of the centred row, out = (x - mean) * rstd * weight + bias in
float32, rounded once to x's dtype; mean and rstd kept for the backward.
The op hands a missing weight as ones and a missing bias as zeros."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch_pallas.kernels import shapes
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.triton import direct, interpreter_safe_dtype
from torch_pallas.kernels.triton.rms_norm import RowConfig, rows_of, too_wide


@triton.jit
def layer_norm_kernel(x_ptr, w_ptr, b_ptr, o_ptr, mean_ptr, rstd_ptr, n, x_row_stride,
                      o_row_stride, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rough = tl.sum(x, axis=0) / n
    d = tl.where(mask, x - rough, 0.0)  # exact where x is near its mean
    shift = tl.sum(d, axis=0) / n  # the rough mean's error (corrected two-pass)
    centred = tl.where(mask, d - shift, 0.0)
    mean = rough + shift
    rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = centred * rstd * w + b
    tl.store(o_ptr + row * o_row_stride + cols, y.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


def layer_norm(x, weight, bias, *, eps: float, config: RowConfig, wrap=direct):
    """(out, mean, rstd) for x (..., N), weight and bias (N,): out in x's
    shape and dtype, mean and rstd (...) float32."""
    x, lead = shapes.rows(x)
    x = rows_of(x)
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=interpreter_safe_dtype(x.dtype), device=x.device)
    mean = torch.empty((rows,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    block_n = triton.next_power_of_2(n)
    wrap(layer_norm_kernel)[(rows,)](
        x, weight.contiguous(), bias.contiguous(), out, mean, rstd, n, x.stride(0), out.stride(0),
        eps, BLOCK_N=block_n, num_warps=config.num_warps(block_n),
    )
    return out.to(x.dtype).view(*lead, n), mean.view(lead), rstd.view(lead)


KERNEL = KernelSpec(run=layer_norm, default_config=RowConfig.default, unsupported=too_wide)
