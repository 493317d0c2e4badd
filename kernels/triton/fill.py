"""Fill a new tensor with a constant in Triton: one program per block,
the value passed at run time (no recompilation per value)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch_pallas.kernels.triton import (
    BlockConfig,
    direct,
    interpreter_safe_dtype,
)
from torch_pallas.kernels.spec import KernelSpec


@triton.jit
def fill_kernel(o_ptr, value, n, BLOCK: tl.constexpr, NEGATE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    values = tl.full((BLOCK,), value, o_ptr.dtype.element_ty)
    if NEGATE:  # -0.0: Triton makes any zero scalar +0.0
        # times -1, not `-values`: Triton before 3.8 negates as 0 - x,
        # which gives +0.0 for +0.0 (x * -1 is exact, signed zeros too)
        values = values * -1.0
    tl.store(o_ptr + offs, values, mask=offs < n)


def fill(shape, value, dtype, *, config: BlockConfig, device, wrap=direct):
    """A new tensor of `shape` and `dtype` (a name) on `device` holding `value`."""
    dtype = getattr(torch, dtype)
    out = torch.empty(shape, dtype=interpreter_safe_dtype(dtype), device=device)
    n = out.numel()
    negative_zero = isinstance(value, float) and value == 0 and math.copysign(1.0, value) < 0
    wrap(fill_kernel)[(triton.cdiv(n, config.block),)](
        out, 0.0 if negative_zero else value, n, BLOCK=config.block, NEGATE=negative_zero
    )
    return out.to(dtype)


KERNEL = KernelSpec(run=fill, default_config=BlockConfig.default)
