"""Sharding strategies from dimension labels, the form every Pallas op's
rule takes here.

A rule names each dimension of each tensor argument and result with a
label (the einsum habit: matmul's operands are `(..., "m", "k")` and
`(..., "k", "n")`, its result `(..., "m", "n")`); `None` marks a dimension
that is never split (a norm's normalized dimension, a broadcast size-1
dimension). Splitting one label across a mesh dimension splits every
tensor that has it, along its position there; the tensors without it stay
whole (Replicate). A result that lacks a split label is Partial (summed
over the ranks) where the op sums over that label (matmul's "k", a norm's
weight gradient over the rows), and that label cannot be split otherwise.
Replicating everything is always a strategy, so a placement no label
allows is redistributed by DTensor, never refused.

`strategies` returns the list of (result placements, argument placements)
that `torch.distributed.tensor.experimental.register_sharding` takes, for
one mesh dimension; DTensor combines them over every mesh dimension.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch.distributed.tensor import Partial, Replicate, Shard

Labels = tuple  # one label (a hashable) or None per dimension


def strategies(results: Sequence[Labels], arguments: Sequence[Labels | None], *,
               summed: Iterable[int] = (), linear: Iterable[Iterable[int]] = ()) -> list:
    """The strategies of an op whose results and arguments have these
    labels (`None` for an argument that is not a tensor).

    summed: the results that are sums over every label they lack.
    linear: groups of arguments in which the op is linear as a whole
        (matmul in each operand, add in both): those arguments Partial and
        the others Replicate give Partial results.
    """
    summed = set(summed)
    whole = ([Replicate()] * len(results),
             [None if labels is None else Replicate() for labels in arguments])
    found = [whole]
    for label in _labels(arguments):
        placed = []
        for index, labels in enumerate(results):
            if label in labels:
                placed.append(Shard(labels.index(label)))
            elif index in summed:
                placed.append(Partial())
            else:
                break
        else:
            found.append((placed, [None if labels is None
                                   else Shard(labels.index(label)) if label in labels
                                   else Replicate() for labels in arguments]))
    for group in linear:
        group = set(group)
        found.append(([Partial()] * len(results),
                      [None if labels is None else Partial() if index in group else Replicate()
                       for index, labels in enumerate(arguments)]))
    return found


def _labels(arguments) -> list:
    """Every label of the arguments, once, in order."""
    seen = []
    for labels in arguments:
        for label in labels or ():
            if label is not None and label not in seen:
                seen.append(label)
    return seen


def leading(count: int) -> Labels:
    """Labels for `count` leading dimensions that any op of the family
    keeps as they are (rows, batch, heads, sequence)."""
    return tuple(f"dim{i}" for i in range(count))


def aligned(labels: Labels, shape: Sequence[int], full: Sequence[int]) -> Labels:
    """The labels of a tensor of `shape` broadcast against `full` (aligned
    from the right, as torch broadcasts): a dimension of size 1 where the
    full one is larger is never split."""
    offset = len(full) - len(shape)
    return tuple(None if size == 1 and full[offset + i] != 1 else labels[offset + i]
                 for i, size in enumerate(shape))
