"""Rotary position embeddings in Triton, in the rotate-half convention of
transformers' `apply_rotary_pos_emb`: with x = (x1, x2) the halves of a
head's D features and (c1, c2), (s1, s2) the halves of its token's cos and
sin,

    out = (x1 * c1 - x2 * s1,  x2 * c2 + x1 * s2)

in float32, rounded once; with `transpose`, the backward's transposed
rotation dx = (g1 * c1 + g2 * s2,  g2 * c2 - g1 * s1).

For q (N1, Hq, N2, D), k (N1, Hk, N2, D) and cos, sin (N1, N2, D): one
program per token, which loads the token's angles once and rotates all its
heads, q's then k's, `block_heads` heads at a time, each as two
(heads, D/2) tiles: the halves never need joining.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.triton import direct, interpreter_safe_dtype


@dataclasses.dataclass(frozen=True)
class RotaryConfig:
    block_heads: int = 8  # heads per step (a power of two)
    num_warps: int = 4

    @classmethod
    def default(cls, backend: str) -> "RotaryConfig":
        return cls()


@triton.jit
def rotate_heads(x_ptr, o_ptr, heads, first_head, head_stride, half, cols, c1, c2, s1, s2,
                 TRANSPOSE: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotates the `heads` heads starting at `first_head` (an element offset),
    `head_stride` elements apart."""
    for start in range(0, heads, BLOCK_H):
        rows = start + tl.arange(0, BLOCK_H)
        offs = first_head + rows[:, None].to(tl.int64) * head_stride + cols[None, :]
        mask = (rows[:, None] < heads) & (cols[None, :] < half)
        x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + offs + half, mask=mask, other=0.0).to(tl.float32)
        if TRANSPOSE:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        tl.store(o_ptr + offs, y1.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(o_ptr + offs + half, y2.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rotary_embedding_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, n2, q_heads,
                            k_heads, half, TRANSPOSE: tl.constexpr, BLOCK_H: tl.constexpr,
                            BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)  # n1 * N2 + j
    n1 = token // n2
    j = token % n2
    d = 2 * half
    cols = tl.arange(0, BLOCK_HALF)
    mask = cols < half
    angles = token * d + cols
    c1 = tl.load(cos_ptr + angles, mask=mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + angles + half, mask=mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + angles, mask=mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + angles + half, mask=mask, other=0.0).to(tl.float32)[None, :]
    head_stride = n2 * d
    rotate_heads(q_ptr, qo_ptr, q_heads, (n1 * q_heads * n2 + j) * d, head_stride, half, cols,
                 c1, c2, s1, s2, TRANSPOSE, BLOCK_H)
    rotate_heads(k_ptr, ko_ptr, k_heads, (n1 * k_heads * n2 + j) * d, head_stride, half, cols,
                 c1, c2, s1, s2, TRANSPOSE, BLOCK_H)


def rotary_embedding(q, k, cos, sin, *, config: RotaryConfig, wrap=direct,
                     transpose: bool = False):
    """(q_embed, k_embed) for q (N1, Hq, N2, D), k (N1, Hk, N2, D) and the
    angles cos, sin (N1, N2, D), in the dtype q and cos promote to; with
    `transpose`, the backward's rotation of the gradients q and k."""
    q, k, cos, sin = (t.contiguous() for t in (q, k, cos, sin))
    n1, q_heads, n2, d = q.shape
    k_heads = k.shape[1]
    dtype = torch.promote_types(q.dtype, cos.dtype)
    qo, ko = (torch.empty(x.shape, dtype=interpreter_safe_dtype(dtype), device=x.device)
              for x in (q, k))
    block_heads = min(config.block_heads, triton.next_power_of_2(max(q_heads, k_heads)))
    wrap(rotary_embedding_kernel)[(n1 * n2,)](
        q, k, cos, sin, qo, ko, n2, q_heads, k_heads, d // 2, TRANSPOSE=transpose,
        BLOCK_H=block_heads, BLOCK_HALF=triton.next_power_of_2(d // 2),
        num_warps=config.num_warps)
    return qo.to(dtype), ko.to(dtype)


KERNEL = KernelSpec(run=rotary_embedding, default_config=RotaryConfig.default)
