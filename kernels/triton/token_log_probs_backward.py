"""token_log_probs' backward in Triton: dz for one chunk of rows of logits
z (R, V), from the forward's log-sum-exp and E (each row's p-weighted mean
of the tempered logits) and the upstream gradients of each row's
log-probability and entropy (kernels/cross_entropy.py has the formula),
elementwise: a program per (row, block of BLOCK_V columns), in float32,
rounded once to z's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.triton import direct, interpreter_safe_dtype
from torch_pallas.kernels.triton.linear_cross_entropy import VocabBlockConfig, capped


@triton.jit
def log_prob_gradient_kernel(z_ptr, t_ptr, lse_ptr, expected_ptr, grad_log_prob_ptr,
                             grad_entropy_ptr, dz_ptr, vocab, z_row_stride, softcap,
                             temperature, BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = cols < vocab
    z = tl.load(z_ptr + row * z_row_stride + cols, mask=valid, other=0.0).to(tl.float32)
    capped_z = capped(z, softcap, HAS_SOFTCAP)
    u = capped_z / temperature
    p = tl.exp(u - tl.load(lse_ptr + row))
    is_target = cols == tl.load(t_ptr + row)
    grad = tl.load(grad_log_prob_ptr + row) * (tl.where(is_target, 1.0, 0.0) - p)
    grad += tl.load(grad_entropy_ptr + row) * p * (tl.load(expected_ptr + row) - u)
    grad /= temperature
    if HAS_SOFTCAP:
        grad *= 1.0 - (capped_z / softcap) * (capped_z / softcap)
    tl.store(dz_ptr + row * vocab + cols, grad.to(dz_ptr.dtype.element_ty), mask=valid)


def token_log_probs_backward(logits, target, lse, expected, grad_log_prob, grad_entropy, *,
                             softcap: float, temperature: float, config: VocabBlockConfig,
                             wrap=direct):
    """dz (R, V) in the logits' dtype, for logits (R, V), target (R,) int32
    and the per-row float32 vectors (R,)."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows, vocab = logits.shape
    dz = torch.empty((rows, vocab), dtype=interpreter_safe_dtype(logits.dtype),
                     device=logits.device)
    block = config.block(vocab)
    wrap(log_prob_gradient_kernel)[(rows, triton.cdiv(vocab, block))](
        logits, target.contiguous(), lse.contiguous(), expected.contiguous(),
        grad_log_prob.contiguous(), grad_entropy.contiguous(), dz, vocab, logits.stride(0),
        softcap or 1.0, temperature, BLOCK_V=block, HAS_SOFTCAP=bool(softcap),
        num_warps=config.num_warps,
    )
    return dz.to(logits.dtype)


KERNEL = KernelSpec(run=token_log_probs_backward, default_config=VocabBlockConfig.default)
