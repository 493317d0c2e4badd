"""The JAX-side form of token_log_probs: each token's log-probability at a
temperature and its distribution's entropy, from the hidden states and the
LM head on JAX arrays, without the (tokens x vocabulary) logits.

The rows go in chunks as linear_cross_entropy's JAX form walks them
(linear_cross_entropy.py: each chunk's logits from the matmul kernel, the
whole chunks in a `lax.scan`), the forward kernel reducing each row to its
log-probability, entropy and log-sum-exp. `jax.custom_vjp`: the backward
recomputes each chunk's logits, the backward kernel turns them and the
upstream gradients of both outputs into their gradient, a product into the
chunk's d_input; d_weight and d_bias from the same chunk where the rows are
one, else from one pass over the vocabulary in blocks.
"""
from __future__ import annotations

import functools

from torch_pallas.base import jax_env
from torch_pallas.jax import calls
from torch_pallas.jax.linear_cross_entropy import (check_arguments, head_logits, kernel_targets,
                                                   over_chunks, product, weight_gradients)
from torch_pallas.kernels.cross_entropy import log_prob_gradient, tempered
from torch_pallas.ops import linear_cross_entropy as lce_op
from torch_pallas.ops.token_log_probs import check_temperature

jax = jax_env.jax()
jnp = jax.numpy


def _walk(chunk, x, weight, arrays: dict) -> dict:
    """`chunk(rows of arrays)` over the rows of x (and of `arrays`) in the
    op's chunks."""
    rows, hidden = x.shape
    step = lce_op.chunk_rows(rows, hidden, weight.shape[0])
    arrays = {"x": x, **arrays}
    return chunk(arrays) if rows <= step else over_chunks(chunk, rows, step, arrays)


def _forward(x, weight, bias, t32, temperature: float, softcap: float):
    params = {"softcap": softcap, "temperature": temperature}

    def chunk(a):
        z = head_logits(a["x"], weight, bias)
        log_prob, entropy, lse = calls.run("token_log_probs", z, a["t"], **params)
        return {"log_prob": log_prob, "entropy": entropy, "lse": lse}

    return _walk(chunk, x, weight, {"t": t32})


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _rows(x, weight, bias, t32, temperature: float, softcap: float):
    out = _forward(x, weight, bias, t32, temperature, softcap)
    return out["log_prob"], out["entropy"]


def _rows_forward(x, weight, bias, t32, temperature, softcap):
    out = _forward(x, weight, bias, t32, temperature, softcap)
    return (out["log_prob"], out["entropy"]), (x, weight, bias, t32, out["lse"], out["entropy"])


def _rows_backward(temperature, softcap, saved, grads):
    x, weight, bias, t32, lse, entropy = saved
    valid = t32 >= 0
    per_row = {"t": t32, "lse": lse, "expected": lse - entropy,
               "a": jnp.where(valid, grads[0].astype(jnp.float32), 0.0),
               "b": jnp.where(valid, grads[1].astype(jnp.float32), 0.0)}
    params = {"softcap": softcap, "temperature": temperature}
    rows, hidden = x.shape
    one_chunk = rows <= lce_op.chunk_rows(rows, hidden, weight.shape[0])

    def chunk(r):
        z = head_logits(r["x"], weight, bias)
        dz = calls.run("token_log_probs_backward", z, r["t"], r["lse"], r["expected"], r["a"],
                       r["b"], **params)
        out = {"d_x": product(dz, weight)}
        if one_chunk:
            out["d_weight"] = product(dz, r["x"], transpose_a=True)
            out["d_bias"] = dz.astype(jnp.float32).sum(0)
        return out

    out = _walk(chunk, x, weight, per_row)
    if not one_chunk:
        column = {k: v[:, None] for k, v in per_row.items()}
        out["d_weight"], out["d_bias"] = weight_gradients(x, weight, bias, lambda z, col: (
            log_prob_gradient(tempered(z, softcap, temperature), column["lse"],
                              column["expected"], col == column["t"], column["a"], column["b"],
                              softcap=softcap, temperature=temperature)))
    d_bias = None if bias is None else out["d_bias"].astype(bias.dtype)
    return (out["d_x"].astype(x.dtype), out["d_weight"].astype(weight.dtype), d_bias, None)


_rows.defvjp(_rows_forward, _rows_backward)


def token_log_probs(input, weight, target, bias=None, *, temperature: float = 1.0,
                    ignore_index: int = -100, return_entropy: bool = False,
                    softcap: float | None = None):
    """Each token's log-probability `log_softmax(z / temperature)[target]`
    of z = input @ weightᵀ + bias (`softcap * tanh(z / softcap)` first with
    a softcap), never holding z whole, float32 with target's shape; with
    `return_entropy` also each position's entropy: (log_probs, entropy).
    input (..., H), weight (V, H), target (...) integer tokens or
    `ignore_index` (0 for both outputs there). Differentiable in input,
    weight and bias through both outputs. Under jax.jit the targets are
    traced and not checked against the vocabulary."""
    op = "torch_pallas.jax.token_log_probs"
    check_arguments(op, input, weight, target, bias, softcap)
    check_temperature(op, temperature)
    t32 = kernel_targets(op, target, ignore_index, weight.shape[0])
    if t32.size == 0:  # no tokens: nothing to score (and no grid to run)
        empty = jnp.zeros(target.shape, jnp.float32)
        return (empty, empty) if return_entropy else empty
    log_prob, entropy = _rows(input.reshape(-1, input.shape[-1]), weight, bias, t32,
                              float(temperature), float(softcap or 0.0))
    log_prob = log_prob.reshape(target.shape)
    return (log_prob, entropy.reshape(target.shape)) if return_entropy else log_prob
