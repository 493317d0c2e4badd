"""linear_cross_entropy's loss in Triton: for one chunk of rows of logits z
(R, V) and their targets, each row's loss and log-sum-exp in float32
(kernels/cross_entropy.py has the formulas). One program per row walks the
row in blocks of BLOCK_V columns with the online maximum and rescaled sum of
exponentials (Milakov & Gimelshein 2018), so a vocabulary of any size fits;
a target of -1 marks an ignored row (loss 0).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.triton import direct


@dataclasses.dataclass(frozen=True)
class VocabBlockConfig:
    """Columns per step of the row-wise loss kernels (forward and backward)."""

    block_v: int = 4096
    num_warps: int = 8

    @classmethod
    def default(cls, backend: str) -> "VocabBlockConfig":
        return cls()

    def block(self, vocab: int) -> int:
        return min(self.block_v, triton.next_power_of_2(vocab))


@triton.jit
def capped(z, softcap, HAS_SOFTCAP: tl.constexpr):
    if HAS_SOFTCAP:
        # tanh(u) = 1 - 2 / (exp(2u) + 1): exact at both ends, as tl has no tanh
        z = softcap * (1.0 - 2.0 / (tl.exp(2.0 * z / softcap) + 1.0))
    return z


@triton.jit
def loss_kernel(z_ptr, t_ptr, loss_ptr, lse_ptr, vocab, z_row_stride, smoothing, softcap,
                BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SMOOTHING: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(t_ptr + row)
    m = -float("inf")
    s = 0.0
    target_logit = 0.0
    logit_sum = 0.0
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < vocab
        z = tl.load(z_ptr + row * z_row_stride + cols, mask=valid, other=0.0).to(tl.float32)
        z = capped(z, softcap, HAS_SOFTCAP)
        target_logit += tl.sum(tl.where(cols == target, z, 0.0), axis=0)
        if SMOOTHING:
            logit_sum += tl.sum(tl.where(valid, z, 0.0), axis=0)
        z = tl.where(valid, z, -float("inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    loss = lse - (1.0 - smoothing) * target_logit
    if SMOOTHING:
        loss -= smoothing * logit_sum / vocab
    tl.store(loss_ptr + row, tl.where(target >= 0, loss, 0.0))
    tl.store(lse_ptr + row, lse)


def linear_cross_entropy(logits, target, *, smoothing: float, softcap: float,
                         config: VocabBlockConfig, wrap=direct):
    """(loss, lse), each (R,) float32, for logits (R, V) and target (R,)
    int32 (-1: ignored)."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    rows, vocab = logits.shape
    loss = torch.empty((rows,), dtype=torch.float32, device=logits.device)
    lse = torch.empty((rows,), dtype=torch.float32, device=logits.device)
    wrap(loss_kernel)[(rows,)](
        logits, target.contiguous(), loss, lse, vocab, logits.stride(0), smoothing, softcap or 1.0,
        BLOCK_V=config.block(vocab), HAS_SOFTCAP=bool(softcap), SMOOTHING=bool(smoothing),
        num_warps=config.num_warps,
    )
    return loss, lse


KERNEL = KernelSpec(run=linear_cross_entropy, default_config=VocabBlockConfig.default)
