"""A kernel without a grid: one block, the whole arrays.

`pl.pallas_call` runs it on the hardware and the simulators. On JAX's
generic interpreter (`interpret=True`: the `interpret` backend) its body
runs on JAX refs (`jax.new_ref`) in the caller's trace, which is what that
interpreter does with a call without a grid, less the scaffolding it builds
for grid steps (a loop, dynamic slices of every operand). That scaffolding
made a (M x 512) @ (512 x 1376) matmul's build 2.3x as long: 58 ms against
25 (trace, lowering and XLA compile, medians over 30 new M, the 2-core AMD
EPYC, 2026-12-01); the compiled computation is the same XLA dot. A kernel
is built for every new shape on the CPU, so this is what a model whose
token count changes pays per size. A JAX without refs (or whose refs are
made otherwise) takes `pallas_call`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.experimental import pallas as pl

_REFS = hasattr(jax, "new_ref") and hasattr(jax, "empty_ref")


def call(kernel: Callable, out_shape: jax.ShapeDtypeStruct, *inputs, interpret):
    """`kernel(*input_refs, output_ref)` run once over whole arrays; returns
    the output."""
    if interpret is True and _REFS:
        try:
            out = jax.empty_ref(out_shape)
            refs = [jax.new_ref(x) for x in inputs]
        except TypeError:  # a JAX whose refs take other arguments
            pass
        else:
            kernel(*refs, out)
            return out[...]
    return pl.pallas_call(kernel, out_shape=out_shape, interpret=interpret)(*inputs)
