"""The zero padding that makes ragged shapes whole blocks, done once, outside
the kernels (JAX arrays)."""

from __future__ import annotations

import jax.numpy as jnp

from torch_pallas.kernels.shapes import cdiv, round_up


def pad_to(x: jnp.ndarray, shape: tuple[int, ...]) -> jnp.ndarray:
    """`x` zero-padded at the end of each dimension up to `shape`."""
    if tuple(x.shape) == tuple(shape):
        return x
    return jnp.pad(x, [(0, s - d) for d, s in zip(x.shape, shape)])


def as_rows(x: jnp.ndarray, cols: int, rows_multiple: int) -> jnp.ndarray:
    """The elements of `x`, flattened and zero-padded into a (rows, cols)
    matrix whose row count is a multiple of `rows_multiple`."""
    flat = x.reshape(-1)
    rows = round_up(cdiv(flat.size, cols), rows_multiple)
    return pad_to(flat, (rows * cols,)).reshape(rows, cols)
