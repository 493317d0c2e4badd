"""Gradients of a custom op from JAX's autodiff of its function.

A custom op without a `backward=` is differentiated as JAX differentiates
its function: `jax.vjp`, which applies the kernels' own `custom_vjp` rules
(a flash attention's forward keeps its log-sum-exp, its backward kernels
use it). The torch side (torch_pallas/custom_ops/__init__.py) runs two kernels built
here:

- `forward_entry`: the function's outputs and, after them, the residuals
  JAX's vjp keeps (the arrays its backward reads). Residuals that are the
  function's own inputs or outputs are not returned again: torch saves
  those tensors and hands them back.
- `backward_entry`: given the inputs, the outputs, the residuals and the
  outputs' cotangents, the cotangents of the differentiable inputs (the
  floating ones) that torch asked for, from the same vjp, without running
  the forward again.

`jax.vjp` returns its backward as a pytree (a `Partial`) whose leaves are
the residuals: the forward flattens it; the backward rebuilds its structure
by tracing the forward abstractly (`jax.eval_shape`: nothing of it is
compiled or run) and puts the saved residuals in as the leaves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from torch_pallas.base import jax_env


class Residuals:
    """Where each leaf of a vjp's pytree comes from: ("input", i),
    ("output", j), ("residual", r) (the r-th array the forward returns after
    its outputs) or ("constant", value)."""

    def __init__(self, treedef, sources, computed):
        self.treedef = treedef
        self.sources = sources
        self.computed = computed  # the arrays the forward returns after its outputs


def _differentiable(arrays) -> list[int]:
    jnp = jax_env.jax().numpy
    return [i for i, a in enumerate(arrays) if jnp.issubdtype(a.dtype, jnp.inexact)]


def _vjp(entry: Callable, arrays, kwargs):
    """(outputs, Residuals) of `entry(*arrays, **kwargs)` differentiated with
    respect to its floating arrays."""
    jax = jax_env.jax()
    wrt = _differentiable(arrays)

    def primal(*diff):
        full = list(arrays)
        for i, d in zip(wrt, diff):
            full[i] = d
        return entry(*full, **kwargs)

    outputs, vjp_fn = jax.vjp(primal, *[arrays[i] for i in wrt])
    leaves, treedef = jax.tree_util.tree_flatten(vjp_fn)
    sources, computed = [], []
    for leaf in leaves:
        source = next((("input", i) for i, a in enumerate(arrays) if leaf is a), None)
        if source is None:
            source = next((("output", j) for j, o in enumerate(outputs) if leaf is o), None)
        if source is None and isinstance(leaf, jax.Array):  # tracers included
            source = ("residual", len(computed))
            computed.append(leaf)
        sources.append(source or ("constant", leaf))
    return outputs, Residuals(treedef, sources, computed)


@functools.lru_cache(maxsize=None)  # a stable identity per entry: the kernel cache keys on it
def forward_entry(entry: Callable) -> Callable:
    """`entry` (op_signature.Signature.entry) returning its outputs, then
    the residuals its vjp keeps."""

    @functools.wraps(entry)
    def forward(*arrays, **kwargs):
        outputs, residuals = _vjp(entry, arrays, kwargs)
        return (*outputs, *residuals.computed)

    return forward


@functools.lru_cache(maxsize=None)
def backward_entry(entry: Callable, inputs: int, outputs: int) -> Callable:
    """The vjp of `entry` (with `inputs` arrays and `outputs` outputs):
    `backward(*inputs, *outputs, *residuals, *cotangents, n_residuals,
    wanted, **kwargs)` -> the cotangents of the floating inputs for which
    `wanted` (one bool each) is true. `cotangents`: one per floating output
    (integer and boolean outputs have none)."""

    @functools.wraps(entry)
    def backward(*arrays, n_residuals: int, wanted: tuple[bool, ...], **kwargs):
        jax = jax_env.jax()
        jnp = jax.numpy
        primals = arrays[:inputs]
        results = arrays[inputs:inputs + outputs]
        saved = arrays[inputs + outputs:inputs + outputs + n_residuals]
        given = iter(arrays[inputs + outputs + n_residuals:])
        found = []

        def trace(*abstract):
            outs, residuals = _vjp(entry, abstract, kwargs)
            found.append(residuals)
            return outs

        jax.eval_shape(trace, *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in primals])
        (residuals,) = found
        if len(residuals.computed) != n_residuals:
            raise RuntimeError(
                f"the JAX function traced to {len(residuals.computed)} residuals for its "
                f"backward, {n_residuals} in its forward: it must trace the same way each time"
            )
        by_kind = {"input": primals, "output": results, "residual": saved}
        leaves = [value if kind == "constant" else by_kind[kind][value]
                  for kind, value in residuals.sources]
        vjp_fn = jax.tree_util.tree_unflatten(residuals.treedef, leaves)
        cotangents = tuple(
            next(given) if jnp.issubdtype(o.dtype, jnp.inexact)
            else np.zeros(o.shape, jax.dtypes.float0)
            for o in results
        )
        # The kernels' backward rules are traced here: as the backend needs them.
        with jax_env.forced_interpret(kwargs.get("interpret")):
            grads = vjp_fn(cotangents)
        return tuple(g for g, w in zip(grads, wanted) if w)

    return backward
