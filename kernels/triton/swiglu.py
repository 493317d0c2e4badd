"""The SwiGLU gate, silu(gate) * up, fused in Triton: one program per block
of the flattened operands (of one shape), in float32, rounded once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.triton import BlockConfig, direct, interpreter_safe_dtype


@triton.jit
def swiglu_kernel(gate_ptr, up_ptr, o_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gate_ptr + offs, mask=mask).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(o_ptr + offs, out.to(o_ptr.dtype.element_ty), mask=mask)


def swiglu(gate, up, *, config: BlockConfig, wrap=direct):
    """silu(gate) * up, for gate and up of one shape and dtype."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty(gate.shape, dtype=interpreter_safe_dtype(gate.dtype), device=gate.device)
    n = gate.numel()
    wrap(swiglu_kernel)[(triton.cdiv(n, config.block),)](gate, up, out, n, BLOCK=config.block)
    return out.to(gate.dtype)


KERNEL = KernelSpec(run=swiglu, default_config=BlockConfig.default)
