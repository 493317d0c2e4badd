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


def _floating(outputs):
    outs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    return [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]


def compiled_matches_eager(op, args, kwargs, *, dynamic: bool, what: str) -> None:
    """`op(*args, **kwargs)` on every layout, compiled with fullgraph=True
    (`dynamic` shapes or static) against eager: the outputs, and the
    gradients of every input that requires grad under a loss weighting each
    floating output with fresh random numbers. One compiled function calls
    the op on every layout at once: one compilation, not one per layout."""
    cases = [(layout.name, *rebased(args, kwargs, layout)) for layout in LAYOUTS]

    def calls(*all_bases):
        outputs, start = [], 0
        for _, bases, rebuild in cases:
            call_args, call_kwargs = rebuild(all_bases[start:start + len(bases)])
            outputs.append(op(*call_args, **call_kwargs))
            start += len(bases)
        return outputs

    eager_bases = [b for _, bases, _ in cases for b in bases]
    layout_of = [name for name, bases, _ in cases for _ in bases]
    # Each base's counterpart in the contiguous case (the first): same
    # argument, one element per element of the view.
    counterpart = [i for _, bases, _ in cases for i in range(len(bases))]
    compiled_bases = [b.detach().clone().requires_grad_(b.requires_grad) for b in eager_bases]
    expected = calls(*eager_bases)
    torch._dynamo.reset()
    got = torch.compile(calls, fullgraph=True, dynamic=dynamic)(*compiled_bases)
    for (layout, _, _), g, e in zip(cases, got, expected):
        torch.testing.assert_close(g, e, msg=lambda m: f"{what}, {layout}: {m}")

    weights = [torch.randn(o.shape) for outs in expected for o in _floating(outs)]
    leaves = [(name, e, c, eager_bases[k]) for name, e, c, k in
              zip(layout_of, eager_bases, compiled_bases, counterpart) if e.requires_grad]
    if not leaves or not weights:
        return
    for outputs in (expected, got):
        floating = [o for outs in outputs for o in _floating(outs)]
        sum((o.float() * w).sum() for o, w in zip(floating, weights)).backward()
    for layout, e, c, whole in leaves:
        # Relative to the size of what the gradient sums: a compiled graph
        # may round a sum of nearly cancelling 16-bit terms once where eager
        # rounds each, and an expanded base's gradient sums the view's
        # (whose terms, an op's gradients along a softmax, may cancel
        # exactly: then both are rounding noise).
        tolerance = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3}.get(e.grad.dtype, 1.3e-6)
        terms = whole.grad.abs().max().item() * whole.numel() / e.numel()
        size = max(e.grad.abs().max().item(), terms)
        torch.testing.assert_close(c.grad, e.grad, rtol=tolerance, atol=tolerance * size,
                                   msg=lambda m: f"{what}, {layout} gradient: {m}")
