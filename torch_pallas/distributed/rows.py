"""pallas::rms_norm and pallas::layer_norm under DTensor: their forward and
backward ops normalize the last dimension of x (..., N) (the composites
merge the normalized dimensions into it), so any leading dimension splits
(the batch, or the sequence under torch's SequenceParallel) and N stays
whole. The weight and bias stay whole; their gradients, sums over the
rows, are Partial where the rows split.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.experimental import register_sharding

from torch_pallas.distributed.labels import leading, strategies

WHOLE = (None,)  # a parameter (N,): never split


def _labels(x):
    """(x's labels, the row statistics' labels)."""
    rows = leading(x.ndim - 1)
    return rows + (None,), rows


# casting_mode changes no placement, only the rounding and ("llama") the
# output's dtype, which DTensor's metadata follows per mode (verified on
# torch 2.13, modes alternating on one mesh).
@register_sharding(torch.ops.pallas.rms_norm_forward.default)
def rms_norm_forward(x, weight, eps, casting_mode="none"):
    x_labels, stats = _labels(x)
    return strategies([x_labels, stats], [x_labels, None if weight is None else WHOLE, None])


@register_sharding(torch.ops.pallas.rms_norm_backward.default)
def rms_norm_backward(grad_out, x, rstd, weight, casting_mode="none"):
    x_labels, stats = _labels(x)
    return strategies([x_labels, WHOLE],
                      [x_labels, x_labels, stats, None if weight is None else WHOLE],
                      summed=[1])


@register_sharding(torch.ops.pallas.layer_norm_forward.default)
def layer_norm_forward(x, weight, bias, eps):
    x_labels, stats = _labels(x)
    return strategies([x_labels, stats, stats], [x_labels, WHOLE, WHOLE, None])


@register_sharding(torch.ops.pallas.layer_norm_backward.default)
def layer_norm_backward(grad_out, x, mean, rstd, weight):
    x_labels, stats = _labels(x)
    return strategies([x_labels, WHOLE, WHOLE], [x_labels, x_labels, stats, stats, WHOLE],
                      summed=[1, 2])
