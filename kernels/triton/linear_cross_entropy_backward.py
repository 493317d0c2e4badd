"""linear_cross_entropy's backward in Triton: dL/dz for one chunk of rows
of logits z (R, V) from the forward's log-sum-exp and each row's gradient
factor (kernels/cross_entropy.py has the formula), elementwise: a program
per (row, block of BLOCK_V columns), in float32, rounded once to z's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.triton import direct, interpreter_safe_dtype
from torch_pallas.kernels.triton.linear_cross_entropy import VocabBlockConfig, capped


@triton.jit
def logit_gradient_kernel(z_ptr, t_ptr, lse_ptr, scale_ptr, dz_ptr, vocab, z_row_stride,
                          smoothing, softcap, BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = cols < vocab
    z = tl.load(z_ptr + row * z_row_stride + cols, mask=valid, other=0.0).to(tl.float32)
    z = capped(z, softcap, HAS_SOFTCAP)
    grad = tl.exp(z - tl.load(lse_ptr + row)) - smoothing / vocab
    grad -= tl.where(cols == tl.load(t_ptr + row), 1.0 - smoothing, 0.0)
    if HAS_SOFTCAP:
        grad *= 1.0 - (z / softcap) * (z / softcap)
    grad *= tl.load(scale_ptr + row)
    tl.store(dz_ptr + row * vocab + cols, grad.to(dz_ptr.dtype.element_ty), mask=valid)


def linear_cross_entropy_backward(logits, target, lse, scale, *, smoothing: float,
                                  softcap: float, config: VocabBlockConfig, wrap=direct):
    """dL/dz (R, V) in the logits' dtype, for logits (R, V), target (R,)
    int32, lse and scale (R,) float32."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows, vocab = logits.shape
    dz = torch.empty((rows, vocab), dtype=interpreter_safe_dtype(logits.dtype),
                     device=logits.device)
    block = config.block(vocab)
    wrap(logit_gradient_kernel)[(rows, triton.cdiv(vocab, block))](
        logits, target.contiguous(), lse.contiguous(), scale.contiguous(), dz, vocab,
        logits.stride(0), smoothing, softcap or 1.0, BLOCK_V=block, HAS_SOFTCAP=bool(softcap),
        num_warps=config.num_warps,
    )
    return dz.to(logits.dtype)


KERNEL = KernelSpec(run=linear_cross_entropy_backward, default_config=VocabBlockConfig.default)
