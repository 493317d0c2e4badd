"""The JAX-side form of linear_cross_entropy: a language model's head and
its cross-entropy loss on JAX arrays without the (tokens x vocabulary)
logits, as the torch op computes it (ops/linear_cross_entropy.py): the rows
in chunks, each chunk's logits from the matmul kernel, reduced by the loss
kernel to each row's loss and log-sum-exp; the gradient recomputes a
chunk's logits from the saved log-sum-exp and turns them into d_input,
d_weight and d_bias through the backward kernel and two products
(`jax.custom_vjp`).
"""

from __future__ import annotations

import functools

import numpy as np

from torch_pallas.base import jax_env
from torch_pallas.jax import calls
from torch_pallas.jax.ops import FLOATS
from torch_pallas.ops import linear_cross_entropy as lce_op

jax = jax_env.jax()
jnp = jax.numpy

REDUCTIONS = ("mean", "sum", "none")


def _chunks(rows: int, hidden: int, vocab: int):
    step = lce_op.chunk_rows(rows, hidden, vocab)
    return [(start, min(step, rows - start)) for start in range(0, rows, step)]


def _logits(x, weight, bias):
    """x @ weightᵀ (+ bias) in x's dtype, through the matmul kernel."""
    z = calls.run("matmul", x[None], weight[None], transpose_a=False, transpose_b=True)[0]
    return z if bias is None else z + bias.astype(z.dtype)


def _product(a, b, transpose_a=False):
    return calls.run("matmul", a[None], b[None], transpose_a=transpose_a, transpose_b=False)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _loss_rows(x, weight, bias, t32, smoothing: float, softcap: float):
    return _loss_rows_forward(x, weight, bias, t32, smoothing, softcap)[0]


def _loss_rows_forward(x, weight, bias, t32, smoothing, softcap):
    losses, lses = [], []
    for start, size in _chunks(x.shape[0], x.shape[1], weight.shape[0]):
        z = _logits(x[start:start + size], weight, bias)
        loss, lse = calls.run("linear_cross_entropy", z, t32[start:start + size],
                              smoothing=smoothing, softcap=softcap)
        losses.append(loss)
        lses.append(lse)
    loss = jnp.concatenate(losses) if losses else jnp.zeros((0,), jnp.float32)
    lse = jnp.concatenate(lses) if lses else jnp.zeros((0,), jnp.float32)
    return loss, (x, weight, bias, t32, lse)


def _loss_rows_backward(smoothing, softcap, saved, g):
    x, weight, bias, t32, lse = saved
    scale = jnp.where(t32 >= 0, g.astype(jnp.float32), 0.0)
    d_x, d_weight = [], jnp.zeros(weight.shape, jnp.float32)
    d_bias = jnp.zeros(weight.shape[:1], jnp.float32)
    for start, size in _chunks(x.shape[0], x.shape[1], weight.shape[0]):
        xc, rows = x[start:start + size], slice(start, start + size)
        dz = calls.run("linear_cross_entropy_backward", _logits(xc, weight, bias), t32[rows],
                       lse[rows], scale[rows], smoothing=smoothing, softcap=softcap)
        d_x.append(_product(dz, weight))
        d_weight = d_weight + _product(dz, xc, transpose_a=True).astype(jnp.float32)
        d_bias = d_bias + dz.astype(jnp.float32).sum(0)
    d_x = jnp.concatenate(d_x) if d_x else jnp.zeros(x.shape, x.dtype)
    return (d_x, d_weight.astype(weight.dtype),
            None if bias is None else d_bias.astype(bias.dtype), None)


_loss_rows.defvjp(_loss_rows_forward, _loss_rows_backward)


def linear_cross_entropy(input, weight, target, bias=None, *, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0,
                         softcap: float | None = None):
    """F.cross_entropy(z.float(), target, ...) of z = input @ weightᵀ + bias
    (softcap * tanh(z / softcap) with a softcap), never holding z whole:
    input (..., H), weight (V, H), target (...) integer classes or
    `ignore_index`; the loss float32 ("none": target's shape). Every row
    ignored gives torch's: nan for "mean", 0 for "sum". Differentiable in
    input, weight and bias. Under jax.jit the targets are traced and not
    checked against the vocabulary."""
    op = "torch_pallas.jax.linear_cross_entropy"
    for name, t in (("input", input), ("weight", weight)):
        if jnp.dtype(t.dtype).name not in FLOATS:
            raise TypeError(f"{op}: {name} has dtype {jnp.dtype(t.dtype).name}; expected one "
                            f"of {', '.join(FLOATS)}")
    if weight.dtype != input.dtype or (bias is not None and bias.dtype != input.dtype):
        raise TypeError(f"{op}: input, weight and bias must share a dtype")
    if weight.ndim != 2 or input.shape[-1] != weight.shape[1] or input.shape[:-1] != target.shape:
        raise ValueError(f"{op}: input (..., H), weight (V, H) and target (...); got "
                         f"{input.shape}, {weight.shape}, {target.shape}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"{op}: bias.shape={bias.shape} must be ({weight.shape[0]},)")
    if not jnp.issubdtype(target.dtype, jnp.integer):
        raise TypeError(f"{op}: target must hold integer classes, got "
                        f"{jnp.dtype(target.dtype).name}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction={reduction!r} must be one of {REDUCTIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing={label_smoothing} must be in [0, 1]")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{op}: softcap={softcap} must be > 0 (or None: off)")
    vocab = weight.shape[0]
    ignored = target == ignore_index
    if not isinstance(target, jax.core.Tracer):  # its values known: checked on the host
        values = np.asarray(target)
        bad = values[(values != ignore_index) & ((values < 0) | (values >= vocab))]
        if bad.size:
            raise IndexError(f"{op}: target holds {int(bad[0])}, not a class in [0, {vocab}) "
                             f"nor ignore_index={ignore_index}")
    t32 = jnp.where(ignored, -1, target).astype(jnp.int32).reshape(-1)
    loss = _loss_rows(input.reshape(-1, input.shape[-1]), weight, bias, t32,
                      float(label_smoothing), float(softcap or 0.0))
    if reduction == "none":
        return loss.reshape(target.shape)
    total = loss.sum()
    return total / (t32 >= 0).sum() if reduction == "mean" else total
