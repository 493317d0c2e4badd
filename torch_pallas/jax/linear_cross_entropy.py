"""The JAX-side form of linear_cross_entropy: a language model's head and
its cross-entropy loss on JAX arrays without the (tokens x vocabulary)
logits, as the torch op computes it (ops/linear_cross_entropy.py): the rows
in chunks, each chunk's logits from the matmul kernel, reduced by the loss
kernel to each row's loss and log-sum-exp; the gradient recomputes a
chunk's logits from the saved log-sum-exp and turns them into d_input,
d_weight and d_bias through the backward kernel and two products
(`jax.custom_vjp`); for "mean" and "sum", as the torch op does, the
forward computes the gradients itself from each chunk's logits (no
recomputation) and the gradient scales them.
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


def _split(a, step: int):
    """a's rows as the whole chunks of `step` rows, stacked (n, step, ...),
    and the rest (fewer than `step` rows)."""
    whole = a.shape[0] // step * step
    return a[:whole].reshape(-1, step, *a.shape[1:]), a[whole:]


def _logits(x, weight, bias):
    """x @ weightᵀ (+ bias) in x's dtype, through the matmul kernel."""
    z = calls.run("matmul", x[None], weight[None], transpose_a=False, transpose_b=True)[0]
    return z if bias is None else z + bias.astype(z.dtype)


def _product(a, b, transpose_a=False):
    return calls.run("matmul", a[None], b[None], transpose_a=transpose_a, transpose_b=False)[0]


def _over_chunks(chunk, carry, rows: int, step: int, *arrays):
    """`chunk(carry, *rows of arrays) -> (carry, outputs)` over the arrays'
    rows in chunks of `step`: the whole chunks in a `lax.scan` (one chunk's
    logits alive at a time: an unrolled loop let XLA schedule every chunk's
    at once, 17.8 GB for 8192 tokens of a 128256-word vocabulary), then the
    rest; the outputs' rows joined in order."""
    whole, rest = zip(*(_split(a, step) for a in arrays))
    carry, outputs = jax.lax.scan(lambda c, xs: chunk(c, *xs), carry, whole)
    outputs = [o.reshape(-1, *o.shape[2:]) for o in outputs]
    if rows % step:
        carry, last = chunk(carry, *rest)
        outputs = [jnp.concatenate([o, r]) for o, r in zip(outputs, last)]
    return carry, outputs


def _walk(x, weight, bias, t32, smoothing: float, softcap: float, *, lse=None, scale=None):
    """One walk over the rows' chunks, each chunk's logits computed once:
    without `lse` (the forward) each row's loss and log-sum-exp; with
    `scale` (each row's factor on its logits' gradient) the gradients, the
    backward kernel's and two products' (d_weight and d_bias summed in
    float32 across chunks). Returns (loss, lse, d_x, d_weight, d_bias),
    None for what was not computed."""
    rows, hidden = x.shape
    step = lce_op.chunk_rows(rows, hidden, weight.shape[0])
    params = {"smoothing": smoothing, "softcap": softcap}
    arrays = [x, t32] + ([] if lse is None else [lse]) + ([] if scale is None else [scale])

    def chunk(sums, xc, tc, *rest):
        rest = list(rest)
        lc = rest.pop(0) if lse is not None else None
        sc = rest.pop(0) if scale is not None else None
        z = _logits(xc, weight, bias)
        outputs = ()
        if lc is None:
            loss_c, lc = calls.run("linear_cross_entropy", z, tc, **params)
            outputs = (loss_c, lc)
        if sc is None:
            return sums, outputs
        dz = calls.run("linear_cross_entropy_backward", z, tc, lc, sc, **params)
        d_weight, d_bias = sums
        d_weight = d_weight + _product(dz, xc, transpose_a=True).astype(jnp.float32)
        d_bias = d_bias + dz.astype(jnp.float32).sum(0)
        return (d_weight, d_bias), outputs + (_product(dz, weight),)

    sums = None if scale is None else (jnp.zeros(weight.shape, jnp.float32),
                                       jnp.zeros(weight.shape[:1], jnp.float32))
    sums, outputs = _over_chunks(chunk, sums, rows, step, *arrays)
    if lse is None:
        loss, lse, *outputs = outputs
    else:
        loss = None
    d_x = outputs[0] if outputs else None
    d_weight, d_bias = (None, None) if sums is None else sums
    return loss, lse, d_x, d_weight, d_bias


def _gradients_in(dtypes, d_x, d_weight, d_bias):
    """The gradients in their arguments' dtypes (x, weight, bias: None
    without a bias)."""
    x_dtype, weight_dtype, bias_dtype = dtypes
    return (d_x.astype(x_dtype), d_weight.astype(weight_dtype),
            None if bias_dtype is None else d_bias.astype(bias_dtype))


# "none": each row's loss; its gradient (one factor per row) recomputes each
# chunk's logits from the saved log-sum-exp.

@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _loss_rows(x, weight, bias, t32, smoothing: float, softcap: float):
    return _walk(x, weight, bias, t32, smoothing, softcap)[0]


def _loss_rows_forward(x, weight, bias, t32, smoothing, softcap):
    loss, lse, *_ = _walk(x, weight, bias, t32, smoothing, softcap)
    return loss, (x, weight, bias, t32, lse)


def _loss_rows_backward(smoothing, softcap, saved, g):
    x, weight, bias, t32, lse = saved
    scale = jnp.where(t32 >= 0, g.astype(jnp.float32), 0.0)
    _, _, *grads = _walk(x, weight, bias, t32, smoothing, softcap, lse=lse, scale=scale)
    dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
    return (*_gradients_in(dtypes, *grads), None)


_loss_rows.defvjp(_loss_rows_forward, _loss_rows_backward)


# "mean" and "sum": one number, whose gradient is the loss's own gradient
# times a scalar; computed in the forward, as the torch op does (its
# `linear_cross_entropy_forward`), from each chunk's logits while they are
# there, so nothing is recomputed (3 products a chunk, not 4).

def _total(loss, t32, mean: bool):
    total = loss.sum()
    return total / (t32 >= 0).sum() if mean else total


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _loss_total(x, weight, bias, t32, mean: bool, smoothing: float, softcap: float):
    return _total(_walk(x, weight, bias, t32, smoothing, softcap)[0], t32, mean)


def _loss_total_forward(x, weight, bias, t32, mean, smoothing, softcap):
    valid = t32 >= 0
    factor = 1.0 / valid.sum().astype(jnp.float32) if mean else jnp.float32(1.0)
    scale = jnp.where(valid, factor, 0.0)  # every row ignored: 0, as torch's gradient
    loss, _, *grads = _walk(x, weight, bias, t32, smoothing, softcap, scale=scale)
    dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
    return _total(loss, t32, mean), _gradients_in(dtypes, *grads)


def _loss_total_backward(mean, smoothing, softcap, grads, g):
    scaled = tuple(None if d is None else (d * g).astype(d.dtype) for d in grads)
    return (*scaled, None)


_loss_total.defvjp(_loss_total_forward, _loss_total_backward)


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
    rows = input.reshape(-1, input.shape[-1])
    if reduction == "none":
        return _loss_rows(rows, weight, bias, t32, float(label_smoothing),
                          float(softcap or 0.0)).reshape(target.shape)
    return _loss_total(rows, weight, bias, t32, reduction == "mean", float(label_smoothing),
                       float(softcap or 0.0))
