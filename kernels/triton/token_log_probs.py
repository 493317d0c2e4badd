"""token_log_probs in Triton: for one chunk of rows of logits z (R, V) and
their targets, each row's log-probability of its target at temperature T,
the entropy of its distribution and its log-sum-exp, in float32
(kernels/cross_entropy.py has the formulas). One program per row walks the
row in blocks of BLOCK_V columns, as linear_cross_entropy's loss kernel
does, carrying the online maximum and the rescaled sums of exp(u - m) and
exp(u - m) * u; a target of -1 marks an ignored row (0 for both outputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.triton import direct
from torch_pallas.kernels.triton.linear_cross_entropy import VocabBlockConfig, capped


@triton.jit
def log_prob_kernel(z_ptr, t_ptr, log_prob_ptr, entropy_ptr, lse_ptr, vocab, z_row_stride,
                    softcap, inverse_temperature, BLOCK_V: tl.constexpr,
                    HAS_SOFTCAP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(t_ptr + row)
    m = -float("inf")
    s = 0.0
    w = 0.0
    target_logit = 0.0
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < vocab
        z = tl.load(z_ptr + row * z_row_stride + cols, mask=valid, other=0.0).to(tl.float32)
        u = capped(z, softcap, HAS_SOFTCAP) * inverse_temperature
        target_logit += tl.sum(tl.where(cols == target, u, 0.0), axis=0)
        masked = tl.where(valid, u, -float("inf"))
        m_new = tl.maximum(m, tl.max(masked, axis=0))
        rescale = tl.exp(m - m_new)
        e = tl.exp(masked - m_new)  # 0 past the vocabulary, where u is 0
        s = s * rescale + tl.sum(e, axis=0)
        w = w * rescale + tl.sum(e * u, axis=0)
        m = m_new
    lse = m + tl.log(s)
    ignored = target < 0
    tl.store(log_prob_ptr + row, tl.where(ignored, 0.0, target_logit - lse))
    tl.store(entropy_ptr + row, tl.where(ignored, 0.0, lse - w / s))
    tl.store(lse_ptr + row, lse)


def token_log_probs(logits, target, *, softcap: float, temperature: float,
                    config: VocabBlockConfig, wrap=direct):
    """(log_prob, entropy, lse), each (R,) float32, for logits (R, V) and
    target (R,) int32 (-1: ignored)."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows, vocab = logits.shape
    log_prob, entropy, lse = (torch.empty((rows,), dtype=torch.float32, device=logits.device)
                              for _ in range(3))
    wrap(log_prob_kernel)[(rows,)](
        logits, target.contiguous(), log_prob, entropy, lse, vocab, logits.stride(0),
        softcap or 1.0, 1.0 / temperature, BLOCK_V=config.block(vocab),
        HAS_SOFTCAP=bool(softcap), num_warps=config.num_warps,
    )
    return log_prob, entropy, lse


KERNEL = KernelSpec(run=token_log_probs, default_config=VocabBlockConfig.default)
