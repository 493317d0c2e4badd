"""Attention dropout in JAX, for the TPU and Mosaic GPU kernels: the keep bit
of a block of scores from its rows' keys and its key indices, and the
probabilities dropped and rescaled. The hash is kernels/attention_shapes.py's
(the Triton kernels and the op layer compute the same one), here on int32
bits: wrapping products and logical shifts give uint32's results, and
int32 lowers everywhere (Mosaic TPU and GPU alike)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from torch_pallas.kernels.attention_shapes import (DROPOUT_BITS, DROPOUT_GOLDEN, DROPOUT_MIX,
                                                   dropout_scale, dropout_threshold)


def _int32(bits: int):
    """A uint32 constant as the int32 of the same bits."""
    return np.int32(bits - (1 << 32) if bits >= 1 << 31 else bits)


def _shift(x, n: int):
    return jax.lax.shift_right_logical(x, np.int32(n))


def mix(x):
    """lowbias32 on int32 bits."""
    x = x ^ _shift(x, 16)
    x = x * _int32(DROPOUT_MIX[0])
    x = x ^ _shift(x, 15)
    x = x * _int32(DROPOUT_MIX[1])
    return x ^ _shift(x, 16)


def keep(row_keys, cols, dropout_p: float):
    """Which scores are kept: `row_keys` (int32, the rows' keys) and `cols`
    (int32, global key indices) broadcast against each other."""
    bits = mix(row_keys + cols * _int32(DROPOUT_GOLDEN))
    return _shift(bits, 32 - DROPOUT_BITS) >= np.int32(dropout_threshold(dropout_p))


def factors(row_keys, cols, dropout_p: float):
    """Z, what dropout multiplies the probabilities by: 1 / (1 - p) where
    kept, 0 where dropped (float32)."""
    return jnp.where(keep(row_keys, cols, dropout_p), np.float32(dropout_scale(dropout_p)),
                     np.float32(0.0))


def block_factors(row_keys, k_start, shape, dropout_p: float):
    """Z of a block of scores of `shape` (rows, keys last) starting at key
    `k_start`, for its rows' keys (broadcasting against `shape`); None
    without dropout (`row_keys` None)."""
    if row_keys is None:
        return None
    lead = (1,) * (len(shape) - 1)
    cols = k_start + jax.lax.broadcasted_iota(jnp.int32, (*lead, shape[-1]), len(shape) - 1)
    return factors(row_keys, cols, dropout_p)
