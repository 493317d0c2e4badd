"""Elementwise addition with broadcasting in Triton: one program per block
of the flattened output; each operand is read through its own strides
(stride 0 along broadcast dimensions), so nothing is materialised.
Shapes are brought to 4 dimensions (leading 1s, or merged when the tensor
is contiguous)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch_pallas.kernels.triton import (
    BlockConfig,
    direct,
    interpreter_safe_dtype,
)
from torch_pallas.kernels.spec import KernelSpec

MAX_DIMS = 4


@triton.jit
def add_kernel(
    x_ptr, y_ptr, o_ptr, n,
    size1, size2, size3,
    x_stride0, x_stride1, x_stride2, x_stride3,
    y_stride0, y_stride1, y_stride2, y_stride3,
    BLOCK: tl.constexpr, IN_FLOAT32: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    i3 = offs % size3
    i2 = (offs // size3) % size2
    i1 = (offs // (size3 * size2)) % size1
    i0 = offs // (size3 * size2 * size1)
    x = tl.load(x_ptr + i0 * x_stride0 + i1 * x_stride1 + i2 * x_stride2 + i3 * x_stride3, mask=mask)
    y = tl.load(y_ptr + i0 * y_stride0 + i1 * y_stride1 + i2 * y_stride2 + i3 * y_stride3, mask=mask)
    if IN_FLOAT32:
        # One float32 addition rounded to 16 bits is the correctly rounded
        # 16-bit sum (float32 has more than 2p + 2 bits), as torch computes it.
        out = (x.to(tl.float32) + y.to(tl.float32)).to(o_ptr.dtype.element_ty)
    else:
        out = x + y
    tl.store(o_ptr + offs, out, mask=mask)


def _four_dims(t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """`t` broadcast to `shape` as a 4-D view (stride 0 where broadcast);
    past 4 dimensions, flattened (a copy if its layout needs one)."""
    t = t.expand(shape)
    if t.dim() > MAX_DIMS:
        t = t.reshape(-1)
    return t.reshape((1,) * (MAX_DIMS - t.dim()) + tuple(t.shape))


def add(x, y, out_shape, *, config: BlockConfig, wrap=direct):
    """x + y, broadcast to `out_shape`, as a new contiguous tensor."""
    out = torch.empty(out_shape, dtype=interpreter_safe_dtype(x.dtype), device=x.device)
    n = out.numel()
    x4, y4 = _four_dims(x, out_shape), _four_dims(y, out_shape)
    _, size1, size2, size3 = x4.shape
    wrap(add_kernel)[(triton.cdiv(n, config.block),)](
        x4, y4, out, n, size1, size2, size3, *x4.stride(), *y4.stride(),
        BLOCK=config.block, IN_FLOAT32=x.dtype in (torch.float16, torch.bfloat16),
    )
    return out.to(x.dtype)


KERNEL = KernelSpec(run=add, default_config=BlockConfig.default)
