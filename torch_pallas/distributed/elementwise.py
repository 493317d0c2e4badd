"""pallas::swiglu and pallas::rotary_embedding (and their backward ops)
under DTensor: split along any dimension their elementwise formulas keep.

swiglu's gate and up split alike, anywhere. Rotary embedding mixes the two
halves of the last dimension, so that one stays whole; the others (batch,
heads, sequence) split in q, k and the angles alike (cos and sin have no
head dimension: they stay whole when the heads split, and their gradients,
sums over the heads, are then Partial).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.experimental import register_sharding

from torch_pallas.distributed.labels import aligned, leading, strategies


@register_sharding(torch.ops.pallas.swiglu.default)
def swiglu(gate, up):
    labels = leading(gate.ndim)
    return strategies([labels], [labels, labels])


@register_sharding(torch.ops.pallas.swiglu_backward.default)
def swiglu_backward(grad_out, gate, up):
    labels = leading(gate.ndim)
    return strategies([labels, labels], [labels, labels, labels])


def _rotary_labels(x, y, cos, unsqueeze_dim):
    """(labels of x, of y, of cos and sin) for x and y (..., D) and the
    angles broadcast into them at unsqueeze_dim."""
    x_labels = leading(x.ndim - 1) + (None,)
    dim = unsqueeze_dim % (cos.ndim + 1)
    shape = (*cos.shape[:dim], 1, *cos.shape[dim:])
    angles = aligned(x_labels, shape, tuple(x.shape))
    return x_labels, x_labels, angles[:dim] + angles[dim + 1:]  # y: x's dims, its own heads


@register_sharding(torch.ops.pallas.rotary_embedding.default)
def rotary_embedding(q, k, cos, sin, unsqueeze_dim=1):
    q_labels, k_labels, angles = _rotary_labels(q, k, cos, unsqueeze_dim)
    return strategies([q_labels, k_labels], [q_labels, k_labels, angles, angles, None])


@register_sharding(torch.ops.pallas.rotary_embedding_backward.default)
def rotary_embedding_backward(grad_q, grad_k, cos, sin, unsqueeze_dim=1, q=None, k=None):
    q_labels, k_labels, angles = _rotary_labels(grad_q, grad_k, cos, unsqueeze_dim)
    wanted = q is not None  # the angles' gradients, else empty
    arguments = [q_labels, k_labels, angles, angles, None,
                 q_labels if wanted else None, k_labels if wanted else None]
    angle_grads = angles if wanted else (None,)
    return strategies([q_labels, k_labels, angle_grads, angle_grads], arguments, summed=[2, 3])
