"""The layouts in which models hand tensors to ops, for tests that run every
op on them (tests/test_layouts.py).

A layout turns a test tensor into a `base` (what a model holds: a leaf that
may require grad) and a view of that base as the op receives it: a transposed
weight (`w.t()`), heads split off a projection (`x.view(B, L, H, E)
.transpose(1, 2)`), a slice of a wider tensor (a fused QKV projection's
part), a tensor broadcast along a dimension (`expand`). The view is taken
inside the function under test, so that a compiled graph holds the view ops
as a model's does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    applies: Callable[[torch.Tensor], bool]
    base: Callable[[torch.Tensor], torch.Tensor]  # t -> what the model holds
    view: Callable[[torch.Tensor, torch.Size], torch.Tensor]  # (base, t.shape) -> the op's input


def _first_wide_dim(shape) -> int | None:
    return next((d for d, size in enumerate(shape) if size > 1), None)


def _widened(t: torch.Tensor) -> torch.Tensor:
    """t with 3 more entries of random filler along its last dimension."""
    filler_shape = (*t.shape[:-1], 3)
    if t.dtype == torch.bool:
        filler = torch.rand(filler_shape) > 0.5
    elif t.dtype.is_floating_point:
        filler = torch.randn(filler_shape).to(t.dtype)
    else:
        filler = torch.randint(-5, 5, filler_shape).to(t.dtype)
    return torch.cat([t, filler.to(t.device)], dim=-1)


LAYOUTS = (
    Layout("contiguous", lambda t: True, lambda t: t.clone(), lambda b, shape: b),
    # A weight's transpose, an activation's .mT: the last two dimensions
    # swapped in memory.
    Layout("transposed", lambda t: t.dim() >= 2,
           lambda t: t.mT.contiguous(), lambda b, shape: b.mT),
    # Heads split off a projection: (B, L, H, E) stored, (B, H, L, E) seen.
    Layout("permuted", lambda t: t.dim() >= 3,
           lambda t: t.transpose(-3, -2).contiguous(), lambda b, shape: b.transpose(-3, -2)),
    # A part of a wider tensor: rows that do not start where the next begins.
    Layout("sliced", lambda t: t.dim() >= 1 and t.numel() > 0,
           _widened, lambda b, shape: b[..., :shape[-1]]),
    # One slice broadcast (stride 0) along the first dimension wider than 1.
    Layout("expanded", lambda t: _first_wide_dim(t.shape) is not None,
           lambda t: t.narrow(_first_wide_dim(t.shape), 0, 1).clone(),
           lambda b, shape: b.expand(shape)),
)


def rebased(args, kwargs, layout: Layout):
    """(bases, rebuild): the bases of the tensors in `args` and `kwargs`
    under `layout` (tensors it does not apply to kept as they are, but
    cloned), leaves requiring grad where the tensor did; `rebuild(bases)`
    gives (args, kwargs) with each tensor replaced by its base's view."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    bases, views = [], []
    for t in tensors:
        applies = layout.applies(t)
        base = (layout.base if applies else torch.Tensor.clone)(t.detach())
        bases.append(base.requires_grad_(t.requires_grad))
        views.append((layout.view, t.shape) if applies else None)

    def rebuild(bases):
        made = iter(bases)
        seen = iter(views)

        def swap(a):
            if not isinstance(a, torch.Tensor):
                return a
            base, how = next(made), next(seen)
            return base if how is None else how[0](base, how[1])

        new_args = tuple(swap(a) for a in args)
        return new_args, {name: swap(a) for name, a in kwargs.items()}

    return bases, rebuild
