"""The SwiGLU gate's backward in Triton, fused: with s = sigmoid(gate),
d_up = dy * gate * s and d_gate = dy * up * s * (1 + gate * (1 - s)), from
one pass over dy, gate and up, in float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.triton import BlockConfig, direct, interpreter_safe_dtype


@triton.jit
def swiglu_backward_kernel(dy_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask).to(tl.float32)
    gate = tl.load(gate_ptr + offs, mask=mask).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask).to(tl.float32)
    s = tl.sigmoid(gate)
    tl.store(dup_ptr + offs, (dy * gate * s).to(dup_ptr.dtype.element_ty), mask=mask)
    tl.store(dgate_ptr + offs, (dy * up * s * (1.0 + gate * (1.0 - s))).to(dgate_ptr.dtype.element_ty),
             mask=mask)


def swiglu_backward(grad_out, gate, up, *, config: BlockConfig, wrap=direct):
    """(d_gate, d_up), each of gate's shape and dtype."""
    grad_out, gate, up = grad_out.contiguous(), gate.contiguous(), up.contiguous()
    dtype = interpreter_safe_dtype(gate.dtype)
    dgate = torch.empty(gate.shape, dtype=dtype, device=gate.device)
    dup = torch.empty(gate.shape, dtype=dtype, device=gate.device)
    n = gate.numel()
    wrap(swiglu_backward_kernel)[(triton.cdiv(n, config.block),)](
        grad_out, gate, up, dgate, dup, n, BLOCK=config.block)
    return dgate.to(gate.dtype), dup.to(gate.dtype)


KERNEL = KernelSpec(run=swiglu_backward, default_config=BlockConfig.default)
