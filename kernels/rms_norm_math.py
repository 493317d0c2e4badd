"""RMSNorm's formulas for the JAX kernel families (the TPU and Mosaic GPU
kernels of rms_norm and its backward), on float32 arrays of any layout:
elementwise, or on a row's sum, so a kernel applies them to whatever tile
it holds. The casting modes are rms_norm_casting.py's.

The statistics follow torch's order of operations (LlamaRMSNorm's
`h.pow(2).mean(-1)`, `+ eps`, `torch.rsqrt`): the sum of squares, divided
by N, plus eps, then the inverse square root as torch's CPU kernel computes
it, 1 / sqrt(v) with both steps rounded (bit-equal to torch.rsqrt on 10^5
values). On the CPU backends (interpreters and simulators, whose bodies XLA
compiles) the divisor and the root pass through barriers: XLA would turn
the division by N into a product with 1/N (other bits for 0.4% of values
at N = 257, 57% at N = 1000) and 1 / sqrt(v) into its own rsqrt (other
bits for 31%). With the barriers 80-86% of the float32 normalized values
equal LlamaRMSNorm's, 59-67% without (jax 0.10.2, widths 64, 257, 4096);
the rest differ by the sum's order, the kernel's own, where torch's CPU
kernel adds 8-lane vectors in a cascade. On hardware the kernels keep the
hardware's rsqrt.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from torch_pallas.kernels.rms_norm_casting import Casting


def inverse_rms(sum_of_squares, n: int, eps: float, *, on_cpu: bool):
    """rstd = 1 / sqrt(sum_of_squares / n + eps), float32, in torch's order."""
    if not on_cpu:
        return jax.lax.rsqrt(sum_of_squares / n + eps)
    divisor = jax.lax.optimization_barrier(jnp.full(sum_of_squares.shape, n, jnp.float32))
    root = jax.lax.optimization_barrier(jnp.sqrt(sum_of_squares / divisor + eps))
    return 1.0 / root


def weight_factor(weight, casting: Casting):
    """What the normalized values are multiplied by: the weight (float32),
    or 1 + weight (GEMMA), rounded to float32 as Gemma's `1.0 + w.float()`."""
    return 1.0 + weight if casting.offsets_weight else weight


def rounded(x_hat, casting: Casting, x_dtype):
    """The normalized values the weight multiplies (and dw sums): rounded to
    x's dtype and back for LLAMA (`n.to(input_dtype)`), else as they are."""
    if casting.rounds_normalized:
        return x_hat.astype(x_dtype).astype(jnp.float32)
    return x_hat


def output(x_hat, weight, casting: Casting, x_dtype):
    """The float32 value the output is rounded from, once: x_hat times the
    weight's factor (the product of two values exact in float32 for LLAMA's
    16-bit operands, so its one rounding is torch's elementwise product's)."""
    y = rounded(x_hat, casting, x_dtype)
    return y if weight is None else y * weight_factor(weight, casting)


def output_dtype(x, weight, casting: Casting):
    """The output's dtype for arrays x and weight (or None)."""
    return casting.output_dtype(x.dtype, None if weight is None else weight.dtype,
                                jnp.promote_types)
