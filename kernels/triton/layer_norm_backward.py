"""LayerNorm's backward in Triton, from the forward's mean and rstd: with
x_hat = (x - mean) * rstd and g = dy * w,

    dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))     per row
    dw = sum over rows of dy * x_hat,   db = sum over rows of dy

in float32; each program a run of rows as rms_norm_backward.py's, its
shares of dw and db summed afterwards."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.triton import direct, interpreter_safe_dtype, interpreting
from torch_pallas.kernels.triton.rms_norm import RowConfig, rows_of, too_wide
from torch_pallas.kernels.triton.rms_norm_backward import PROGRAMS


@triton.jit
def layer_norm_backward_kernel(dy_ptr, x_ptr, mean_ptr, rstd_ptr, w_ptr, dx_ptr, dw_ptr, db_ptr,
                               rows, n, rows_per_program, dy_row_stride, x_row_stride,
                               dx_row_stride, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    first = pid * rows_per_program
    count = tl.minimum(rows_per_program, rows - first)
    dy_row = dy_ptr + first.to(tl.int64) * dy_row_stride
    x_row = x_ptr + first.to(tl.int64) * x_row_stride
    dx_row = dx_ptr + first.to(tl.int64) * dx_row_stride
    mean_row = mean_ptr + first
    rstd_row = rstd_ptr + first
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for _ in range(0, count):
        dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_row)
        x_hat = tl.where(mask, (x - tl.load(mean_row)) * rstd, 0.0)
        g = dy * w
        mean_g = tl.sum(g, axis=0) / n
        mean_gx = tl.sum(g * x_hat, axis=0) / n
        dx = rstd * (g - mean_g - x_hat * mean_gx)
        tl.store(dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        db += dy
        dy_row += dy_row_stride
        x_row += x_row_stride
        dx_row += dx_row_stride
        mean_row += 1
        rstd_row += 1
    tl.store(dw_ptr + pid.to(tl.int64) * n + cols, dw, mask=mask)
    tl.store(db_ptr + pid.to(tl.int64) * n + cols, db, mask=mask)


def layer_norm_backward(grad_out, x, mean, rstd, weight, *, config: RowConfig, wrap=direct):
    """(dx, dw, db): dx in x's dtype, dw and db float32, for x and grad_out
    (R, N), mean and rstd (R,) float32, weight (N,)."""
    x, grad_out = rows_of(x), rows_of(grad_out)
    rows, n = x.shape
    programs = min(rows, 4 if interpreting() else PROGRAMS)
    rows_per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, rows_per_program)
    dx = torch.empty((rows, n), dtype=interpreter_safe_dtype(x.dtype), device=x.device)
    dw = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    db = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    block_n = triton.next_power_of_2(n)
    wrap(layer_norm_backward_kernel)[(programs,)](
        grad_out, x, mean.contiguous(), rstd.contiguous(), weight.contiguous(), dx, dw, db,
        rows, n, rows_per_program, grad_out.stride(0), x.stride(0), dx.stride(0),
        BLOCK_N=block_n, num_warps=config.num_warps(block_n),
    )
    return dx.to(x.dtype), dw.sum(0), db.sum(0)


KERNEL = KernelSpec(run=layer_norm_backward, default_config=RowConfig.default,
                    unsupported=too_wide)
