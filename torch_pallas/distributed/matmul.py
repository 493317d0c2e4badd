"""pallas::matmul and pallas::add under DTensor.

matmul follows torch.matmul's shapes (ops/matmul.py): the rows of a, the
columns of b and the batch dimensions both share split as aten.mm/bmm's
strategies split them; the contracted dimension split in both gives a
Partial product; a Partial operand beside a whole one gives a Partial
product (the product is linear in each). add splits along any dimension
of its broadcast shape, and two Partial operands add to a Partial sum.
"""

from __future__ import annotations

import torch

from torch_pallas.distributed.labels import aligned, leading, strategies
from torch.distributed.tensor.experimental import register_sharding


@register_sharding(torch.ops.pallas.matmul.default)
def matmul(a, b):
    a_mat = tuple(a.shape) if a.ndim > 1 else (1, *a.shape)
    b_mat = tuple(b.shape) if b.ndim > 1 else (*b.shape, 1)
    batch = tuple(torch.broadcast_shapes(a_mat[:-2], b_mat[:-2]))
    batch_labels = leading(len(batch))
    a_labels = aligned(batch_labels, a_mat[:-2], batch) + ("m", "k")
    b_labels = aligned(batch_labels, b_mat[:-2], batch) + ("k", "n")
    out = batch_labels + (("m",) if a.ndim > 1 else ()) + (("n",) if b.ndim > 1 else ())
    return strategies(
        [out],
        [a_labels if a.ndim > 1 else ("k",), b_labels if b.ndim > 1 else ("k",)],
        summed=[0], linear=[[0], [1]])


@register_sharding(torch.ops.pallas.add.default)
def add(x, y):
    shape = tuple(torch.broadcast_shapes(x.shape, y.shape))
    labels = leading(len(shape))
    return strategies([labels], [aligned(labels, x.shape, shape), aligned(labels, y.shape, shape)],
                      linear=[[0, 1]])
