"""RMSNorm's backward in Triton, from the forward's rstd: with
x_hat = x * rstd and g = dy * w (dy without a weight, dy * (1 + w) in the
GEMMA casting),

    dx = rstd * (g - x_hat * mean(g * x_hat))      per row
    dw = sum over rows of dy * x_hat               (x_hat rounded to x's dtype
                                                    in the LLAMA casting)

in float32. Each program takes a run of consecutive rows, one row at a time
in registers, writes their dx and keeps its share of dw in registers; the
shares (one row per program) are summed afterwards, in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch_pallas.kernels.rms_norm_casting import Casting
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.triton import direct, interpreter_safe_dtype, interpreting
from torch_pallas.kernels.triton.rms_norm import (RowConfig, casting_constexprs, rounded,
                                                  rows_of, too_wide, weight_factor)

# Programs for the backward: enough to fill a GPU, each a run of rows long
# enough that its share of dw is worth its write.
PROGRAMS = 256


@triton.jit
def rms_norm_backward_kernel(dy_ptr, x_ptr, rstd_ptr, w_ptr, dx_ptr, dw_ptr, rows, n,
                             rows_per_program, dy_row_stride, x_row_stride, dx_row_stride,
                             BLOCK_N: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                             ROUND_NORMALIZED: tl.constexpr, OFFSET_WEIGHT: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    first = pid * rows_per_program
    count = tl.minimum(rows_per_program, rows - first)
    dy_row = dy_ptr + first.to(tl.int64) * dy_row_stride
    x_row = x_ptr + first.to(tl.int64) * x_row_stride
    dx_row = dx_ptr + first.to(tl.int64) * dx_row_stride
    rstd_row = rstd_ptr + first
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_WEIGHT:
        w = weight_factor(tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32),
                          OFFSET_WEIGHT)
    for _ in range(0, count):
        dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
        x_hat = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(rstd_row)
        if HAS_WEIGHT:
            g = dy * w
            if ROUND_NORMALIZED:
                dw += dy * rounded(x_hat, x_ptr.dtype.element_ty)
            else:
                dw += dy * x_hat
        else:
            g = dy
        mean = tl.sum(g * x_hat, axis=0) / n
        dx = tl.load(rstd_row) * (g - x_hat * mean)
        tl.store(dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dy_row += dy_row_stride
        x_row += x_row_stride
        dx_row += dx_row_stride
        rstd_row += 1
    if HAS_WEIGHT:
        tl.store(dw_ptr + pid.to(tl.int64) * n + cols, dw, mask=mask)


def rms_norm_backward(grad_out, x, rstd, weight=None, *, casting: Casting = Casting.NONE,
                      config: RowConfig, wrap=direct):
    """(dx, dw): dx in x's dtype, dw in the weight's (empty float32 without
    a weight), for x (R, N), grad_out (R, N) (in the forward output's
    dtype), rstd (R,) float32."""
    x, grad_out = rows_of(x), rows_of(grad_out)
    rows, n = x.shape
    programs = min(rows, 4 if interpreting() else PROGRAMS)
    rows_per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, rows_per_program)
    dx = torch.empty((rows, n), dtype=interpreter_safe_dtype(x.dtype), device=x.device)
    shares = torch.empty((programs if weight is not None else 0, n), dtype=torch.float32,
                         device=x.device)
    block_n = triton.next_power_of_2(n)
    wrap(rms_norm_backward_kernel)[(programs,)](
        grad_out, x, rstd.contiguous(), x if weight is None else weight.contiguous(), dx, shares,
        rows, n, rows_per_program, grad_out.stride(0), x.stride(0), dx.stride(0),
        BLOCK_N=block_n, HAS_WEIGHT=weight is not None, **casting_constexprs(casting),
        num_warps=config.num_warps(block_n),
    )
    if weight is None:
        return dx.to(x.dtype), shares.new_empty((0,))
    return dx.to(x.dtype), shares.sum(0).to(weight.dtype)


KERNEL = KernelSpec(run=rms_norm_backward, default_config=RowConfig.default, unsupported=too_wide)
