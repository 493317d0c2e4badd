"""pallas::grouped_mm and its backward op under DTensor: the splits that
each form of the op (ops/grouped_mm.py) computes exactly on local shards.

Each form names its dimensions (`FORMS`); `offs`, when the form has it,
holds global group ends over one of them (`sliced`) and is never split:

- ROWS, 2-D x 3-D: mat_a (rows, k), mat_b (groups, k, n), offs over the
  rows. Splits: n (mat_b Shard(2), bias Shard(1) -> out Shard(1), tensor
  parallel by columns) and k (mat_a Shard(1), mat_b Shard(1) -> out
  Partial).
- BATCHED, 3-D x 3-D: mat_a (groups, m, k), mat_b (groups, k, n), no offs.
  Splits: groups (both Shard(0), bias Shard(0) -> out Shard(0): expert
  parallelism), m (mat_a Shard(1) -> out Shard(1)), n, and k (-> Partial).
- CONTRACTION, 2-D x 2-D: mat_a (m, k), mat_b (k, n), offs over k, out
  (groups, m, n). Splits: m (mat_a Shard(0) -> out Shard(1)) and n (mat_b
  Shard(1), bias Shard(1) -> out Shard(2)).
- COLUMNS, 3-D x 2-D: mat_a (groups, m, k), mat_b (k, n), offs over n.
  Splits: m (mat_a Shard(1) -> out Shard(0)) and k (-> Partial).

Not expressible, so DTensor gathers instead: any split of the groups or of
the dimension offs slices where the form has offs. A rank's shard of offs
(its groups' ends) does not say where its first group starts, and a
rank's shard of the sliced dimension (rows of mat_a, say) starts at a
global row the global ends in offs do not count from; a rule sees only
placements, never a shift it could apply to offs. Expert parallelism over
a ROWS call is the caller's (its own token exchange, each rank's offs
built for its local rows and experts), as in torch's and transformers'
own expert-parallel paths.

A k split gives a Partial product; a bias, added once to the sum, is then
Partial too (DTensor hands one rank the bias and the others zeros, no
communication). The product is linear in each operand: mat_a or mat_b
Partial (the bias Partial with it) and the rest whole gives a Partial
product, as for torch's mm.

The backward op's splits are the forward's: the same labels give dA
mat_a's placement, dB mat_b's and dbias bias's; a result without the
split label is Partial where it sums over it (dA over n, dB and dbias
over the rows or m) and whole where none of its inputs has it (dbias
under a k split). The incoming gradient Partial gives Partial gradients.
(labels.py's `strategies` has no whole result beside a split, nor a
Partial bias beside a Partial product: the placements are built here.)

The backward op's has_bias and output_mask decide the shapes of its
results (an empty tensor where a gradient is not asked for), but DTensor
caches a rule's decision, and the results' shapes, on the arguments from
the first integer one (`register_sharding`'s default), and this op has
none: a call asking for dA after one that did not would get dA's cached
empty shape. Its decisions are keyed on them too (`static_argnum=4`),
through base/torch_compat.py (torch's private record beside the rule;
where a torch lacks it, the backward op gets no rule and DTensor refuses
it by name rather than reuse another call's shapes).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from torch_pallas.base import torch_compat
from torch_pallas.ops.grouped_mm import Form


class Labels(NamedTuple):
    """Each tensor's dimension labels in one form; `sliced` is the label
    offs holds ends over (None: no offs)."""

    mat_a: tuple
    mat_b: tuple
    bias: tuple | None
    out: tuple
    sliced: str | None


FORMS = {
    Form.ROWS: Labels(("rows", "k"), ("groups", "k", "n"), ("groups", "n"), ("rows", "n"),
                      "rows"),
    Form.BATCHED: Labels(("groups", "m", "k"), ("groups", "k", "n"), ("groups", "n"),
                         ("groups", "m", "n"), None),
    Form.CONTRACTION: Labels(("m", "k"), ("k", "n"), ("groups", "n"), ("groups", "m", "n"),
                             "k"),
    Form.COLUMNS: Labels(("groups", "m", "k"), ("k", "n"), None, ("m", "n"), "n"),
}


def _labels(mat_a, mat_b) -> Labels:
    """The form's labels; for operands of no form (the op refuses them by
    name when it runs), every dimension whole."""
    form = {(2, 3): Form.ROWS, (3, 3): Form.BATCHED, (2, 2): Form.CONTRACTION,
            (3, 2): Form.COLUMNS}.get((mat_a.ndim, mat_b.ndim))
    if form is None:
        return Labels((None,) * mat_a.ndim, (None,) * mat_b.ndim, (None, None),
                      (None,), None)
    return FORMS[form]


def _splittable(labels: Labels) -> list[str]:
    """The labels a shard computes exactly: all but the groups and the
    dimension offs slices, where the form has offs."""
    tied = () if labels.sliced is None else ("groups", labels.sliced)
    found = []
    for names in (labels.mat_a, labels.mat_b):
        found += [name for name in names if name not in tied and name not in found]
    return found


def _placed(names: tuple | None, label: str, otherwise=Replicate()):
    """Shard along `label` where the tensor has it, else `otherwise`."""
    if names is None:
        return None
    return Shard(names.index(label)) if label in names else otherwise


def _whole(tensor) -> Replicate | None:
    return None if tensor is None else Replicate()


def _partial(tensor) -> Partial | None:
    return None if tensor is None else Partial()


@register_sharding(torch.ops.pallas.grouped_mm.default)
def grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    labels = _labels(mat_a, mat_b)
    bias_names = None if bias is None else labels.bias or ()  # () where the op refuses one
    offs_whole = _whole(offs)
    found = [([Replicate()], [Replicate(), Replicate(), offs_whole, _whole(bias), None])]
    for label in _splittable(labels):
        out = _placed(labels.out, label, Partial())  # absent from out: contracted (k)
        bias_placement = _placed(bias_names, label, out if isinstance(out, Partial)
                                 else Replicate())  # added once to a Partial sum
        found.append(([out], [_placed(labels.mat_a, label), _placed(labels.mat_b, label),
                              offs_whole, bias_placement, None]))
    # linear in each operand (affine with the bias, which is then Partial too)
    found.append(([Partial()], [Partial(), Replicate(), offs_whole, _partial(bias), None]))
    found.append(([Partial()], [Replicate(), Partial(), offs_whole, _partial(bias), None]))
    return found


def _gradient(names: tuple | None, label: str, inputs: tuple):
    """A gradient's placement when `label` splits: along it where the
    gradient has it; Partial where one of the `inputs` it is computed
    from has it (a sum over it); whole otherwise. (Where the op returns an
    empty tensor instead, a gradient not asked for, DTensor wraps it with
    this placement unchecked and autograd drops it.)"""
    if names is None:  # no bias in this form: dbias is always empty
        return Replicate()
    if label in names:
        return Shard(names.index(label))
    return Partial() if any(label in names_ for names_ in inputs) else Replicate()


def grouped_mm_backward(grad_out, mat_a, mat_b, offs, has_bias, output_mask):
    labels = _labels(mat_a, mat_b)
    offs_whole = _whole(offs)
    found = [([Replicate()] * 3, [Replicate(), Replicate(), Replicate(), offs_whole, None, None])]
    for label in _splittable(labels):
        results = [_gradient(labels.mat_a, label, (labels.out, labels.mat_b)),
                   _gradient(labels.mat_b, label, (labels.out, labels.mat_a)),
                   _gradient(labels.bias, label, (labels.out,))]
        found.append((results, [_placed(labels.out, label), _placed(labels.mat_a, label),
                                _placed(labels.mat_b, label), offs_whole, None, None]))
    # linear in the incoming gradient; dB linear in mat_a, dA in mat_b
    found.append(([Partial()] * 3, [Partial(), Replicate(), Replicate(), offs_whole, None, None]))
    found.append(([Replicate(), Partial(), Replicate()],
                  [Replicate(), Partial(), Replicate(), offs_whole, None, None]))
    found.append(([Partial(), Replicate(), Replicate()],
                  [Replicate(), Replicate(), Partial(), offs_whole, None, None]))
    return found


HAS_BIAS = 4  # grouped_mm_backward's first argument that is not a tensor
# Keyed on has_bias and output_mask too (the module's docstring), through
# torch's private record of the keys (base/torch_compat.py); without it the
# backward op has no rule and DTensor refuses it by name.
torch_compat.register_sharding_keyed(torch.ops.pallas.grouped_mm_backward.default,
                                     grouped_mm_backward, HAS_BIAS)
