"""The JAX-side form of linear_cross_entropy: a language model's head and
its cross-entropy loss on JAX arrays without the (tokens x vocabulary)
logits. The rows go in chunks, each chunk's logits from the matmul kernel,
reduced by the loss kernel to each row's loss and log-sum-exp; for the
gradients the backward kernel turns a chunk's logits into their gradient
and a product into the chunk's d_input. d_weight and d_bias come from the
same chunk where the rows are one; else from a pass over the vocabulary in
blocks (each block's logits for every row, recomputed from the rows'
log-sum-exp, and one product), so that no (V, H) float32 sum is carried
across chunks: at 8192 tokens of a 128256 x 4096 head that sum was 2.1 GB,
read and written 16 times. `jax.custom_vjp`: for "mean" and "sum", as the
torch op does, the forward computes the gradients itself and the gradient
scales them; "none" computes them in its backward from the saved
log-sum-exp.
"""
from __future__ import annotations

import functools

import numpy as np

from torch_pallas.base import jax_env
from torch_pallas.jax import calls
from torch_pallas.jax.ops import FLOATS
from torch_pallas.kernels.cross_entropy import capped, logit_gradient
from torch_pallas.ops import linear_cross_entropy as lce_op

jax = jax_env.jax()
jnp = jax.numpy

REDUCTIONS = ("mean", "sum", "none")


def _split(a, step: int):
    """a's rows as the whole chunks of `step` rows, stacked (n, step, ...),
    and the rest (fewer than `step` rows)."""
    whole = a.shape[0] // step * step
    return a[:whole].reshape(-1, step, *a.shape[1:]), a[whole:]


def head_logits(x, weight, bias):
    """x @ weightᵀ (+ bias) in x's dtype, through the matmul kernel."""
    z = calls.run("matmul", x[None], weight[None], transpose_a=False, transpose_b=True)[0]
    return z if bias is None else z + bias.astype(z.dtype)


def product(a, b, transpose_a=False):
    return calls.run("matmul", a[None], b[None], transpose_a=transpose_a, transpose_b=False)[0]


def over_chunks(chunk, rows: int, step: int, arrays: dict) -> dict:
    """`chunk(rows of arrays) -> outputs` (dicts of arrays) over the
    arrays' rows in chunks of `step`: the whole chunks in a `lax.scan` (one
    chunk's logits alive at a time: an unrolled loop let XLA schedule every
    chunk's at once, 17.8 GB for 8192 tokens of a 128256-word vocabulary),
    then the rest; the outputs' rows joined in order."""
    whole, rest = {}, {}
    for name, a in arrays.items():
        whole[name], rest[name] = _split(a, step)
    _, outputs = jax.lax.scan(lambda carry, xs: (carry, chunk(xs)), None, whole)
    outputs = {k: o.reshape(-1, *o.shape[2:]) for k, o in outputs.items()}
    if rows % step:
        last = chunk(rest)
        outputs = {k: jnp.concatenate([o, last[k]]) for k, o in outputs.items()}
    return outputs


def vocab_block(hidden: int, vocab: int) -> int:
    """Vocabulary entries per block of the weight-gradient pass: logits
    (rows x block) of about the input's size (rows x hidden), as the row
    chunks' are, a power of two of at least 128 (a lane tile)."""
    return min(vocab, max(128, 1 << (hidden - 1).bit_length()))


def weight_gradients(x, weight, bias, logit_gradient_of):
    """(d_weight in x's dtype, d_bias float32) from one pass over the
    vocabulary in blocks: each block's logits for every row, their gradient
    (`logit_gradient_of(z as float32, each element's column)`, float32)
    and one product over all rows, written into its rows of d_weight.
    Nothing is summed across row chunks, so no float32 (V, H) running sum
    (2.1 GB at a 128256 x 4096 head, read and written once per chunk); the
    price is the logits computed once more (4 products for the loss and its
    gradients, not 3)."""
    vocab, hidden = weight.shape
    block = vocab_block(hidden, vocab)

    def gradients(start, size: int):
        w = jax.lax.dynamic_slice_in_dim(weight, start, size)
        b = None if bias is None else jax.lax.dynamic_slice_in_dim(bias, start, size)
        z = head_logits(x, w, b)
        col = start + jax.lax.broadcasted_iota(jnp.int32, z.shape, 1)
        dz = logit_gradient_of(z.astype(jnp.float32), col).astype(z.dtype)
        return product(dz, x, transpose_a=True), dz.astype(jnp.float32).sum(0)

    def into(sums, start, size: int):
        d_weight, d_bias = sums
        gw, gb = gradients(start, size)
        return (jax.lax.dynamic_update_slice_in_dim(d_weight, gw, start, 0),
                jax.lax.dynamic_update_slice_in_dim(d_bias, gb, start, 0))

    sums = (jnp.zeros(weight.shape, x.dtype), jnp.zeros((vocab,), jnp.float32))
    sums = jax.lax.fori_loop(0, vocab // block, lambda i, s: into(s, i * block, block), sums)
    if vocab % block:
        sums = into(sums, vocab - vocab % block, vocab % block)
    return sums


def _weight_gradients(x, weight, bias, t32, lse, scale, smoothing: float, softcap: float):
    """linear_cross_entropy's d_weight and d_bias (weight_gradients)."""
    vocab = weight.shape[0]
    t, lse, scale = t32[:, None], lse[:, None], scale[:, None]
    return weight_gradients(x, weight, bias, lambda z, col: logit_gradient(
        capped(z, softcap), lse, col == t, scale, vocab=vocab, smoothing=smoothing,
        softcap=softcap))


def _walk(x, weight, bias, t32, smoothing: float, softcap: float, *, lse=None, scale=None):
    """The rows in chunks, each chunk's logits computed once: without `lse`
    (the forward) each row's loss and log-sum-exp; with `scale` (each row's
    factor on its logits' gradient) the gradients: d_x from the backward
    kernel and a product, and where the rows are one chunk d_weight and
    d_bias from it too, else from _weight_gradients' pass over the
    vocabulary. Returns (loss, lse, d_x, d_weight, d_bias), None for what
    was not computed."""
    rows, hidden = x.shape
    step = lce_op.chunk_rows(rows, hidden, weight.shape[0])
    params = {"smoothing": smoothing, "softcap": softcap}
    one_chunk = rows <= step

    def chunk(a):
        z = head_logits(a["x"], weight, bias)
        out = {}
        lc = a.get("lse")
        if lc is None:
            out["loss"], lc = calls.run("linear_cross_entropy", z, a["t"], **params)
            out["lse"] = lc
        if "scale" in a:
            dz = calls.run("linear_cross_entropy_backward", z, a["t"], lc, a["scale"], **params)
            out["d_x"] = product(dz, weight)
            if one_chunk:
                out["d_weight"] = product(dz, a["x"], transpose_a=True)
                out["d_bias"] = dz.astype(jnp.float32).sum(0)
        return out

    arrays = {"x": x, "t": t32}
    arrays.update({k: v for k, v in (("lse", lse), ("scale", scale)) if v is not None})
    out = chunk(arrays) if one_chunk else over_chunks(chunk, rows, step, arrays)
    lse = out.get("lse", lse)
    if scale is not None and not one_chunk:
        out["d_weight"], out["d_bias"] = _weight_gradients(x, weight, bias, t32, lse, scale,
                                                           smoothing, softcap)
    return (out.get("loss"), lse, out.get("d_x"), out.get("d_weight"), out.get("d_bias"))


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


def check_arguments(op: str, input, weight, target, bias, softcap) -> None:
    """The head's arguments: input (..., H), weight (V, H), target (...)
    integer, bias (V,), one float dtype; a soft cap > 0 or None."""
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
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{op}: softcap={softcap} must be > 0 (or None: off)")


def kernel_targets(op: str, target, ignore_index: int, vocab: int):
    """The targets as the kernels take them, flat int32, -1 where ignored;
    checked against the vocabulary where their values are known (not under
    jax.jit)."""
    if not isinstance(target, jax.core.Tracer):  # its values known: checked on the host
        values = np.asarray(target)
        bad = values[(values != ignore_index) & ((values < 0) | (values >= vocab))]
        if bad.size:
            raise IndexError(f"{op}: target holds {int(bad[0])}, not a class in [0, {vocab}) "
                             f"nor ignore_index={ignore_index}")
    return jnp.where(target == ignore_index, -1, target).astype(jnp.int32).reshape(-1)


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
    check_arguments(op, input, weight, target, bias, softcap)
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction={reduction!r} must be one of {REDUCTIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing={label_smoothing} must be in [0, 1]")
    t32 = kernel_targets(op, target, ignore_index, weight.shape[0])
    if t32.size == 0:  # no rows: torch's empty reductions (and no grid to run)
        if reduction == "none":
            return jnp.zeros(target.shape, jnp.float32)
        return jnp.float32(jnp.nan if reduction == "mean" else 0.0)
    rows = input.reshape(-1, input.shape[-1])
    if reduction == "none":
        return _loss_rows(rows, weight, bias, t32, float(label_smoothing),
                          float(softcap or 0.0)).reshape(target.shape)
    return _loss_total(rows, weight, bias, t32, reduction == "mean", float(label_smoothing),
                       float(softcap or 0.0))
