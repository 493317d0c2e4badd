"""The JAX-side forms of attention and varlen_attention: SDPA's semantics
(with the torch ops' windows, softcap, sinks and grouped query heads) on
JAX arrays, forward through the attention kernel and gradients through its
backward kernel (`jax.custom_vjp`), jit-traceable.

The kernels take what the torch op gives them (ops/attention.py's
`span_rule` and `kernel_params`); the key spans are built here with
jax.numpy as ops/attention_spans.py builds them with torch.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from torch_pallas.base import jax_env
from torch_pallas.jax import calls
from torch_pallas.ops import attention as attention_op

jax = jax_env.jax()
jnp = jax.numpy


class Static(NamedTuple):
    """A call's static parameters (hashable: custom_vjp's nondiff argument)."""

    scale: float
    is_causal: bool
    left: int
    right: int
    softcap: float


# --- key spans (ops/attention_spans.py's, in jax.numpy) --------------------------

def _bounded(start, end, low, high):
    start = jnp.minimum(jnp.maximum(start, low), high)
    end = jnp.maximum(jnp.minimum(end, high), start)
    return jnp.stack((start, end), axis=-1).astype(jnp.int32)


def window_spans(length: int, kv_length: int, left: int, right: int):
    """(length, 2) int32: row i sees keys [i - left, i + right] (top-left)."""
    i = jnp.arange(length, dtype=jnp.int32)
    start = i - left if left >= 0 else jnp.zeros_like(i)
    end = i + right + 1 if right >= 0 else jnp.full_like(i, kv_length)
    return _bounded(start, end, 0, kv_length)


def sequence_spans(cu_seq_q, cu_seq_k, rows: int, left: int, right: int):
    """(rows, 2) int32 for packed sequences, each window aligned
    bottom-right in its sequence; rows past cu_seq_q[-1] see nothing."""
    cu_q, cu_k = cu_seq_q.astype(jnp.int32), cu_seq_k.astype(jnp.int32)
    t = jnp.arange(rows, dtype=jnp.int32)
    sequences = cu_q.shape[0] - 1
    b = jnp.searchsorted(cu_q[1:], t, side="right")
    inside = b < sequences
    b = jnp.minimum(b, max(sequences - 1, 0))
    q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
    diagonal = k0 + (t - q0) + (k1 - k0) - (q1 - q0)
    start = diagonal - left if left >= 0 else k0
    end = diagonal + right + 1 if right >= 0 else k1
    last = cu_k[-1]
    start = jnp.where(inside, jnp.maximum(start, k0), last)
    return _bounded(start, jnp.where(inside, end, last), 0, jnp.where(inside, k1, last))


def key_spans(spans, kv_length: int):
    """(kv_length, 2) int32: the rows that see key j."""
    j = jnp.arange(kv_length, dtype=jnp.int32)
    first = jnp.searchsorted(spans[:, 1], j, side="right")
    past = jnp.searchsorted(spans[:, 0], j, side="right")
    return jnp.stack((first, jnp.maximum(past, first)), axis=-1).astype(jnp.int32)


def padded_batch_sequences(padding):
    """(cu_seq_q, cu_seq_k, holes) of a padded batch folded into one row of
    packed sequences, five a row (ops/attention_spans.py's, in jax.numpy):
    `padding` (B, S) true or nonzero at the real tokens."""
    real = padding != 0
    batch, length = real.shape
    index = jnp.arange(length, dtype=jnp.int32)
    count = real.sum(-1, dtype=jnp.int32)
    start = jnp.where(real, index, length).min(-1)
    end = jnp.where(real, index + 1, 0).max(-1)
    start = jnp.where(count > 0, start, 0)
    end = jnp.maximum(end, start)
    holes = count != end - start
    zero = jnp.zeros_like(start)
    queries = jnp.stack((start, zero, end - start, length - end, zero), axis=-1)
    keys = jnp.stack((zero, start, end - start, zero, length - end), axis=-1)
    first = jnp.zeros((1,), jnp.int32)
    cu_q = jnp.concatenate((first, jnp.cumsum(queries.reshape(-1), dtype=jnp.int32)))
    cu_k = jnp.concatenate((first, jnp.cumsum(keys.reshape(-1), dtype=jnp.int32)))
    return cu_q, cu_k, holes


# --- the kernels, sinks on top ------------------------------------------------------

def _tables(static: Static, q, k, cu_seq_q, cu_seq_k):
    """(spans or None, the kernels' parameters) for a call."""
    which, left, right, causal = attention_op.span_rule(
        static.is_causal, static.left, static.right, cu_seq_q is not None)
    spans = None
    if which == "window":
        spans = window_spans(q.shape[2], k.shape[2], left, right)
    elif which == "sequences":
        spans = sequence_spans(cu_seq_q, cu_seq_k, q.shape[2], left, right)
    params = attention_op.kernel_params(
        static.scale, causal, 0.0, spans is not None, static.softcap,
        attention_op.span_width(static.is_causal, static.left, static.right),
        (left, right) if which == "window" else None)
    return spans, params


def _with_sinks(out, lse, sinks):
    """The sinks' logits in each row's denominator: out rescaled, lse with
    them (ops/attention.py's `_with_sinks`)."""
    sink = sinks.astype(jnp.float32).reshape(1, -1, 1)
    seen = jnp.where(jnp.isinf(lse), -jnp.inf, lse)
    total = jnp.logaddexp(seen, sink)
    return (out.astype(jnp.float32) * jnp.exp(seen - total)[..., None]).astype(out.dtype), total


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def attention_forward(q, k, v, sinks, cu_seq_q, cu_seq_k, static: Static):
    """pallas::attention_forward without a mask or dropout: (out, lse) for
    q (B, Hq, L, D), lse (B, Hq, L) float32 (the sinks' logits in it);
    differentiable in q, k, v and sinks through out."""
    spans, params = _tables(static, q, k, cu_seq_q, cu_seq_k)
    out, lse = calls.run("attention", q, k, v, *(() if spans is None else (spans,)), **params)
    return (out, lse) if sinks is None else _with_sinks(out, lse, sinks)


def _attention_vjp_forward(q, k, v, sinks, cu_seq_q, cu_seq_k, static):
    out, lse = attention_forward(q, k, v, sinks, cu_seq_q, cu_seq_k, static)
    return (out, lse), (q, k, v, sinks, cu_seq_q, cu_seq_k, out, lse)


def attention_backward(q, k, v, out, g, lse, cu_seq_q, cu_seq_k, static: Static):
    """pallas::attention_backward without a mask or dropout: (dq, dk, dv)
    from out's gradient `g`, the forward's out and lse."""
    spans, params = _tables(static, q, k, cu_seq_q, cu_seq_k)
    tables = () if spans is None else (spans, key_spans(spans, k.shape[2]))
    return tuple(calls.run("attention_backward", q, k, v, out, g.astype(q.dtype), lse, *tables,
                           **params))


def sinks_gradient(sinks, out, g, lse):
    """d loss / d sink_h = -Σ over batch and rows of exp(sink_h - lse) *
    rowsum(g * out), lse with the sinks (ops/attention.py's)."""
    delta = (g.astype(jnp.float32) * out.astype(jnp.float32)).sum(-1)
    weight = jnp.exp(sinks.astype(jnp.float32).reshape(1, -1, 1) - lse)
    return -(weight * delta).sum((0, 2)).astype(sinks.dtype)


def _attention_vjp_backward(static, saved, g):
    q, k, v, sinks, cu_seq_q, cu_seq_k, out, lse = saved
    dq, dk, dv = attention_backward(q, k, v, out, g[0], lse, cu_seq_q, cu_seq_k, static)
    d_sinks = None if sinks is None else sinks_gradient(sinks, out, g[0], lse)
    return dq, dk, dv, d_sinks, None, None


attention_forward.defvjp(_attention_vjp_forward, _attention_vjp_backward)


# --- the public functions -------------------------------------------------------------

FLOATS = ("float32", "float16", "bfloat16")


def _check(op: str, q, k, v, window_size, softcap, sinks, heads_axis: int):
    """Refuses what the kernels would compute wrongly; returns (left, right)."""
    names = ("query", "key", "value")
    for name, t in zip(names, (q, k, v)):
        if jnp.dtype(t.dtype).name not in FLOATS:
            raise TypeError(f"{op}: {name} has dtype {jnp.dtype(t.dtype).name}; expected one "
                            f"of {', '.join(FLOATS)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{op}: {name}.dtype={jnp.dtype(t.dtype).name} must be the "
                            f"query's ({jnp.dtype(q.dtype).name})")
    heads, kv_heads = q.shape[heads_axis], k.shape[heads_axis]
    if v.shape[heads_axis] != kv_heads or kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{op}: key and value need the same number of heads, dividing the "
                         f"query's; got query {q.shape}, key {k.shape}, value {v.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{op}: query's and key's last dimensions must be equal, got "
                         f"{q.shape} and {k.shape}")
    left, right = attention_op.check_window(op, window_size, softcap)
    if sinks is not None and (sinks.shape != (heads,) or sinks.dtype != q.dtype):
        raise ValueError(f"{op}: sinks must hold one logit per query head in the query's "
                         f"dtype, shape ({heads},); got {sinks.shape} {jnp.dtype(sinks.dtype).name}")
    return left, right


def attention(query, key, value, *, is_causal: bool = False, scale: float | None = None,
              window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks=None,
              padding_mask=None):
    """SDPA on the Pallas attention kernels: query (B, Hq, L, D), key
    (B, Hk, S, D), value (B, Hk, S, Dv), Hk dividing Hq (grouped query
    heads); softmax statistics in float32. `window_size` (left, right): row
    i sees keys i - left <= j <= i + right (top-left, -1 unbounded; with
    `is_causal` the right side at most 0); `softcap` caps the scaled scores
    to c * tanh(s / c); `sinks` (Hq,) adds a logit per head to each row's
    denominator. Differentiable in query, key, value and sinks.

    `padding_mask` (B, L), bool or integers, true or nonzero at a batch's
    real tokens (a tokenizer's attention_mask), for self-attention (L == S):
    real tokens see their row's real tokens alone (the causal rule and the
    window in token indices, as without padding), and a padding token's
    row gives 0 with gradient 0 (flash-attention's rows after unpadding).
    Each row's real tokens must be one run (left, right or both sides
    padded): a concrete mask with holes raises ValueError; a traced one
    (under jax.jit, not readable) gives NaN in those batch rows (which a
    following layer on this function spreads to the others). The mask
    is data: traced, it costs no recompilation, and the kernels read it as
    five packed sequences a row (the varlen kernels' tables); a mask of
    all ones takes the unpadded kernels (`lax.cond` where it is traced)."""
    op = "torch_pallas.jax.attention"
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(f"{op}: query, key and value must be 4-D (B, H, L, D); got "
                         f"{query.shape}, {key.shape}, {value.shape}")
    if not (query.shape[0] == key.shape[0] == value.shape[0]) or key.shape[2] != value.shape[2]:
        raise ValueError(f"{op}: query {query.shape}, key {key.shape} and value {value.shape} "
                         "must share the batch, key and value the length")
    left, right = _check(op, query, key, value, window_size, softcap, sinks, heads_axis=1)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    static = Static(scale, bool(is_causal), left, right, float(softcap))

    def unpadded():
        return attention_forward(query, key, value, sinks, None, None, static)[0]

    if padding_mask is None:
        return unpadded()

    def padded():
        return _padded(op, query, key, value, padding_mask, is_causal, scale, left, right,
                       softcap, sinks)

    _check_padding(op, query, key, padding_mask)
    every_token_real = jnp.all(padding_mask != 0)
    if not isinstance(every_token_real, jax.core.Tracer):
        return unpadded() if bool(every_token_real) else padded()
    # A traced mask of all ones (a tokenizer's, for a batch of one length)
    # takes the unpadded kernels, at their speed: the folded batch's grid
    # walks more block pairs.
    return jax.lax.cond(every_token_real, unpadded, padded)


def _check_padding(op, q, k, padding_mask) -> None:
    batch, _, length, _ = q.shape
    if padding_mask.shape != (batch, length) or k.shape[2] != length:
        raise ValueError(f"{op}: padding_mask must be (B, L) = ({batch}, {length}) for "
                         f"self-attention (as many keys as queries); got padding_mask "
                         f"{padding_mask.shape} for key {k.shape}")
    if not (padding_mask.dtype == jnp.bool_ or jnp.issubdtype(padding_mask.dtype, jnp.integer)):
        raise TypeError(f"{op}: padding_mask must be bool or integers, got "
                        f"{jnp.dtype(padding_mask.dtype).name}")


def _padded(op, q, k, v, padding_mask, is_causal, scale, left, right, softcap, sinks):
    """`attention` with a padding mask: the batch folded into one row of
    packed sequences (`padded_batch_sequences`), out unfolded."""
    batch, heads, length, _ = q.shape
    cu_q, cu_k, holes = padded_batch_sequences(padding_mask)
    if not isinstance(holes, jax.core.Tracer) and bool(holes.any()):
        rows = [int(b) for b in jnp.nonzero(holes)[0]]
        raise ValueError(f"{op}: padding_mask's real tokens must be one run a row (left, "
                         f"right or both sides padded); rows {rows} have padding between them")
    if is_causal:
        right = 0
    fold = lambda t: jnp.swapaxes(t, 0, 1).reshape(1, t.shape[1], batch * length, t.shape[3])
    out, _ = attention_forward(fold(q), fold(k), fold(v), sinks, cu_q, cu_k,
                               Static(scale, False, left, right, float(softcap)))
    out = jnp.swapaxes(out.reshape(heads, batch, length, out.shape[-1]), 0, 1)
    return jnp.where(holes.reshape(batch, 1, 1, 1), jnp.nan, out).astype(out.dtype)


def _check_sequences(op: str, cu_seq_q, cu_seq_k, rows: int, keys: int) -> None:
    """cu_seq_q's and cu_seq_k's values where they are known (not traced):
    from 0, non-decreasing, within the rows and keys."""
    if cu_seq_q.ndim != 1 or cu_seq_q.shape != cu_seq_k.shape or cu_seq_q.shape[0] < 1:
        raise ValueError(f"{op}: cu_seq_q and cu_seq_k must be 1-D, one length (N + 1); got "
                         f"{cu_seq_q.shape} and {cu_seq_k.shape}")
    for name, cu, total in (("cu_seq_q", cu_seq_q, rows), ("cu_seq_k", cu_seq_k, keys)):
        if not jnp.issubdtype(cu.dtype, jnp.integer):
            raise TypeError(f"{op}: {name} must be integers, got {jnp.dtype(cu.dtype).name}")
        if isinstance(cu, jax.core.Tracer):
            continue
        values = [int(x) for x in jax.device_get(cu)]
        if values[0] != 0 or any(b < a for a, b in zip(values, values[1:])) or values[-1] > total:
            raise ValueError(f"{op}: {name} must start at 0, not decrease and end at most at "
                             f"{total}; got {values}")


def varlen_attention(query, key, value, cu_seq_q, cu_seq_k, *, scale: float | None = None,
                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks=None):
    """torch.nn.attention.varlen's varlen_attn on the Pallas attention
    kernels: packed query (T, Hq, D), key (S, Hk, D), value (S, Hk, Dv),
    sequence b's rows cu_seq_q[b] <= t < cu_seq_q[b + 1] seeing its keys
    cu_seq_k[b] <= j < cu_seq_k[b + 1]; `window_size` aligned bottom-right
    in each sequence ((-1, 0): causal). Differentiable in query, key, value
    and sinks. Under jax.jit the cu_seq values are traced and not checked."""
    op = "torch_pallas.jax.varlen_attention"
    if query.ndim != 3 or key.ndim != 3 or value.ndim != 3 or key.shape[0] != value.shape[0]:
        raise ValueError(f"{op}: query (T, H, D), key and value (S, H_kv, D); got "
                         f"{query.shape}, {key.shape}, {value.shape}")
    left, right = _check(op, query, key, value, window_size, softcap, sinks, heads_axis=1)
    _check_sequences(op, cu_seq_q, cu_seq_k, query.shape[0], key.shape[0])
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    q, k, v = (jnp.swapaxes(t, 0, 1)[None] for t in (query, key, value))
    out, _ = attention_forward(q, k, v, sinks, cu_seq_q, cu_seq_k,
                               Static(scale, False, left, right, float(softcap)))
    return jnp.swapaxes(out[0], 0, 1)
