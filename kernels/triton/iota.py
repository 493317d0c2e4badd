"""[0, 1, ..., n-1] in Triton: one program per block, counting in int32 and
converting to the output dtype."""

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


@triton.jit
def iota_kernel(o_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(o_ptr + offs, offs.to(o_ptr.dtype.element_ty), mask=offs < n)


def iota(n, dtype, *, config: BlockConfig, device, wrap=direct):
    """[0, 1, ..., n-1] as a new 1-D tensor of `dtype` (a name) on `device`."""
    dtype = getattr(torch, dtype)
    out = torch.empty((n,), dtype=interpreter_safe_dtype(dtype), device=device)
    wrap(iota_kernel)[(triton.cdiv(n, config.block),)](out, n, BLOCK=config.block)
    return out.to(dtype)


KERNEL = KernelSpec(run=iota, default_config=BlockConfig.default)
