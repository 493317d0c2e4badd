"""pallas::attention under DTensor: as torch's strategies for SDPA's
kernels, the batch and the heads split (q, k, v, the mask's matching
dimensions and the results alike); the sequences and the head size stay
whole (a row's softmax needs every key).

Sinks (one logit per query head) split with the heads; packed sequences'
cu_seq stay whole (every rank holds the one batch entry's rows; the heads
split).

The heads split only where the key/value heads divide evenly over the
mesh, so that each rank's query heads keep their own key/value heads
(grouped-query attention). With dropout (a seed) everything stays whole:
the keep mask is hashed from (batch, head, row, column) within a call, so
two ranks computing different heads at the same local indices would drop
the same entries.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor.experimental import register_sharding

from torch_pallas.distributed.labels import aligned, strategies


def _labels(q, k, mask, seed):
    """(q's labels, k's and v's, the mask's, the seed's) for q (B, H, L, E)."""
    heads_split = k.shape[1] % math.prod(k.mesh.shape) == 0
    q_labels = ("batch", "heads" if heads_split else None, None, None)
    mask_labels = None
    if mask is not None:
        full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        mask_labels = aligned(q_labels[:2] + (None, None), mask.shape, full)
    if seed is not None:  # dropout: nothing splits
        q_labels = (None,) * 4
        mask_labels = None if mask is None else (None,) * mask.ndim
    return q_labels, q_labels, mask_labels, None if seed is None else ()


def _extras(labels, sinks, cu_seq_q, cu_seq_k):
    """Labels of the sinks (one per query head: split with the heads) and
    of cu_seq (whole: packed sequences share the one batch entry's rows)."""
    whole = (None,)
    return ([None, None, None, None if sinks is None else labels[1:2],
             None if cu_seq_q is None else whole, None if cu_seq_k is None else whole])


@register_sharding(torch.ops.pallas.attention_forward.default)
def attention_forward(q, k, v, mask, scale, is_causal, dropout_p=0.0, seed=None,
                      window_left=-1, window_right=-1, softcap=0.0, sinks=None, cu_seq_q=None,
                      cu_seq_k=None, max_q=0, max_k=0):
    labels, kv, mask_labels, seed_labels = _labels(q, k, mask, seed)
    extras = _extras(labels, sinks, cu_seq_q, cu_seq_k) + [None, None]
    return strategies([labels, labels[:3]],
                      [labels, kv, kv, mask_labels, None, None, None, seed_labels, *extras])


@register_sharding(torch.ops.pallas.attention_backward.default)
def attention_backward(q, k, v, out, grad_out, lse, mask, scale, is_causal, dropout_p=0.0,
                       seed=None, window_left=-1, window_right=-1, softcap=0.0, cu_seq_q=None,
                       cu_seq_k=None):
    labels, kv, mask_labels, seed_labels = _labels(q, k, mask, seed)
    extras = _extras(labels, None, cu_seq_q, cu_seq_k)
    del extras[3]  # the backward takes no sinks
    return strategies([labels, kv, kv],
                      [labels, kv, kv, labels, labels, labels[:3], mask_labels, None, None,
                       None, seed_labels, *extras])
