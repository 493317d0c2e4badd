"""Drop-ins for `torch.nn.functional`, on the Pallas kernels: same
signatures, same results, so a model swaps one import."""

from __future__ import annotations

import torch

from torch_pallas.ops.attention import attention, check_arguments
from torch_pallas.ops.matmul import linear

__all__ = ["linear", "scaled_dot_product_attention"]

SDPA = "torch_pallas.nn.functional.scaled_dot_product_attention"


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """`torch.nn.functional.scaled_dot_product_attention` on
    `torch.ops.pallas.attention` (FlashAttention-style Pallas kernels,
    float32 softmax statistics, differentiable, SDPA's dropout when
    `dropout_p > 0`). Bad arguments raise naming this function, as torch
    would."""
    check_arguments(query, key, value, attn_mask, dropout_p, enable_gqa, op=SDPA)
    return attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                     enable_gqa=enable_gqa)
