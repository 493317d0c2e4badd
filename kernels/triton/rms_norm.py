"""RMSNorm's forward in Triton: one program per row, the whole row in
registers (BLOCK_N, the width rounded up to a power of two, masked):
rstd = 1 / sqrt(mean(x^2) + eps) and x * rstd * weight in float32, rounded
as the casting mode says (kernels/rms_norm_casting.py): once to the input's
dtype as `torch.nn.functional.rms_norm` (NONE), or as Llama's and Gemma's
modules. rstd is kept, one float32 per row, for the backward.

`tl.rsqrt` is torch's rsqrt on either side: 1 / sqrt in float32 under the
CPU interpreter (torch's CPU kernel), the hardware's approximation on a GPU
(torch's CUDA kernel, rsqrtf).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch_pallas.kernels import shapes
from torch_pallas.kernels.rms_norm_casting import Casting
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.triton import direct, interpreter_safe_dtype

MAX_WIDTH = 65536  # a row in one program's registers


@dataclasses.dataclass(frozen=True)
class RowConfig:
    """Warps per program by the row's width: enough threads that each holds
    a few dozen elements (the row-wise kernels: rms_norm and its backward)."""

    elements_per_warp: int = 1024
    max_warps: int = 16

    @classmethod
    def default(cls, backend: str) -> "RowConfig":
        return cls()

    def num_warps(self, block_n: int) -> int:
        return max(1, min(self.max_warps, triton.next_power_of_2(block_n // self.elements_per_warp)))


@triton.jit
def rounded(y, dtype: tl.constexpr):
    """float32 y rounded to `dtype` (to nearest, ties to even) and back.
    bfloat16 by its bits: Triton's CPU interpreter (3.8, 3.9) rounds
    float32 -> bfloat16 toward zero."""
    if dtype == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return y.to(dtype).to(tl.float32)


@triton.jit
def weight_factor(w, OFFSET_WEIGHT: tl.constexpr):
    """The weight (float32) as it multiplies: 1 + w in the GEMMA casting."""
    if OFFSET_WEIGHT:
        return 1.0 + w
    else:
        return w


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, o_ptr, rstd_ptr, n, x_row_stride, o_row_stride, eps,
                    BLOCK_N: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                    ROUND_NORMALIZED: tl.constexpr, OFFSET_WEIGHT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    y = x * rstd
    if ROUND_NORMALIZED:
        y = rounded(y, x_ptr.dtype.element_ty)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = y * weight_factor(w, OFFSET_WEIGHT)
    tl.store(o_ptr + row * o_row_stride + cols, y.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


def casting_constexprs(casting: Casting) -> dict:
    """The kernels' constexprs for a casting mode."""
    return {"ROUND_NORMALIZED": casting.rounds_normalized,
            "OFFSET_WEIGHT": casting.offsets_weight}


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """x (R, N) with unit stride along its rows (a copy only if it lacks it)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def too_wide(backend: str, avals, params) -> str | None:
    n = avals[0][0][-1]
    if n > MAX_WIDTH:
        return (f"backend {backend!r} keeps a row in registers, up to {MAX_WIDTH} elements; "
                f"this one has {n}")
    return None


def rms_norm(x, weight=None, *, eps: float, casting: Casting = Casting.NONE, config: RowConfig,
             wrap=direct):
    """(out, rstd) for x (..., N) and weight (N,) or None: out in x's shape
    and dtype (promote_types(x, weight) for a weighted LLAMA casting), rstd
    (...) float32."""
    x, lead = shapes.rows(x)
    x = rows_of(x)
    rows, n = x.shape
    out_dtype = casting.output_dtype(x.dtype, None if weight is None else weight.dtype,
                                     torch.promote_types)
    out = torch.empty((rows, n), dtype=interpreter_safe_dtype(out_dtype), device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    block_n = triton.next_power_of_2(n)
    wrap(rms_norm_kernel)[(rows,)](
        x, x if weight is None else weight.contiguous(), out, rstd, n, x.stride(0),
        out.stride(0), eps, BLOCK_N=block_n, HAS_WEIGHT=weight is not None,
        **casting_constexprs(casting), num_warps=config.num_warps(block_n),
    )
    return out.to(out_dtype).view(*lead, n), rstd.view(lead)


KERNEL = KernelSpec(run=rms_norm, default_config=RowConfig.default, unsupported=too_wide)
