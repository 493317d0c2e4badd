"""Output shapes of a custom op under torch.compile's symbolic sizes.

JAX cannot trace a Pallas kernel at symbolic sizes, so the op's function is
evaluated (`jax.eval_shape`) at the sizes' example values and again at
other sizes, and each output dimension is matched to the symbol it follows
(see `symbolic_output_shapes`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from torch_pallas.base import dtypes, jax_env, torch_compat
from torch_pallas.base.errors import add_note


@functools.lru_cache(maxsize=256)
def output_types(name: str, fn: Callable, avals: tuple, statics: tuple):
    """[(shape, torch dtype)] of the outputs of `fn` (a custom op's kernel
    entry, returning a tuple of arrays) called with arrays of `avals` and
    the keyword arguments `statics` (the backend's `interpret` among them,
    so the evaluation traces what the run traces), by jax.eval_shape."""
    jax = jax_env.jax()
    jax_env.simulate_tpu_on_cpu()
    structs = [jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype)) for shape, dtype in avals]
    try:
        result = jax.eval_shape(functools.partial(fn, **dict(statics)), *structs)
    except Exception as e:
        add_note(e, f"{name}: tracing the JAX function for inputs {list(avals)} "
                    f"and parameters {dict(statics)}")
        raise
    return [(tuple(leaf.shape), dtypes.TORCH_DTYPES[str(leaf.dtype)]) for leaf in result]


# The sizes a symbol takes in the probes of `_symbolic_output_shapes`, from
# its hint and a factor of its own: the first probe must trace; the others,
# which catch sizes rounded up (n + 1, small) or clamped (small, large), are
# skipped where the function refuses them (a kernel taking only multiples of
# its block refuses such sizes at run time too).
PROBE_SIZES = (
    lambda hint, factor: hint * factor,
    lambda hint, factor: hint * factor + 1,
    lambda hint, factor: factor,
    lambda hint, factor: hint * (factor + 1000),
)


def symbolic_output_shapes(name, fn, tensors, statics):
    """Output shapes for (possibly symbolic) fake inputs. JAX cannot trace a
    Pallas kernel at symbolic sizes, so the function is probed: its output
    shapes are evaluated at the size hints and again at other sizes for every
    symbol (PROBE_SIZES). An output dimension that equals one symbol at every
    probe is that symbol; one that never moves is a constant. Any other size
    (2n, n - 1, rounded up, clamped), or a first probe that does not trace,
    specialises the sizes: the graph is guarded on them."""
    concrete = torch_compat.size_hint

    statics_key = tuple(statics.items())
    dtypes_ = [dtypes.jax_name(t.dtype) for t in tensors]
    hints = [tuple(concrete(d) for d in t.shape) for t in tensors]
    base = output_types(name, fn, tuple(zip(hints, dtypes_)), statics_key)
    symbols: dict[str, tuple[torch.SymInt, int, int]] = {}  # expr -> (sym, hint, factor)
    for t in tensors:
        for d in t.shape:
            if isinstance(d, torch.SymInt) and str(d) not in symbols:
                symbols[str(d)] = (d, concrete(d), len(symbols) + 2)
    if not symbols:
        return base

    def specialised():
        for sym, _, _ in symbols.values():
            int(sym)  # guards the compiled graph on this size
        return base

    def probe(size):
        shapes = [
            tuple(size(*symbols[str(d)][1:]) if isinstance(d, torch.SymInt) else h
                  for d, h in zip(t.shape, hint))
            for t, hint in zip(tensors, hints)
        ]
        return output_types(name, fn, tuple(zip(shapes, dtypes_)), statics_key)

    sizes, outs = [], []  # the probes that traced, and their output types
    for i, size in enumerate(PROBE_SIZES):
        try:
            outs.append(probe(size))
            sizes.append(size)
        except Exception:  # sizes the function refuses
            if i == 0:
                return specialised()
    ranks = [len(shape) for shape, _ in base]
    if any([len(shape) for shape, _ in out] != ranks for out in outs):
        return specialised()
    # Each symbol's hint and the sizes it took in those probes.
    taken = [(sym, hint, [size(hint, factor) for size in sizes])
             for sym, hint, factor in symbols.values()]
    result = []
    for i, (shape, dtype) in enumerate(base):
        dims = []
        for j, d in enumerate(shape):
            moved = [out[i][0][j] for out in outs]
            follows = [sym for sym, hint, values in taken if d == hint and moved == values]
            if follows:
                dims.append(follows[0])
            elif all(m == d for m in moved):
                dims.append(d)
            else:
                return specialised()
        result.append((tuple(dims), dtype))
    return result
