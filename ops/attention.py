"""torch.ops.pallas.attention: `torch.nn.functional.scaled_dot_product_attention`
on FlashAttention-style Pallas kernels (and their Triton twins).

Three ops:
- `pallas::attention(query, key, value, attn_mask=None, dropout_p=0.0,
  is_causal=False, scale=None, enable_gqa=False)`, SDPA's signature and
  semantics. It checks its arguments and reduces the call to the canonical
  form of kernels/attention_shapes.py (batch dimensions broadcast and
  flattened, a head axis for 3-D inputs, a boolean mask made additive), then
  calls the forward op; CompositeImplicitAutograd, so autograd, autocast and
  torch.compile see the two ops below.
- `pallas::attention_forward(q, k, v, mask, scale, is_causal, dropout_p=0.0,
  seed=None) -> (out, lse)` on canonical tensors: the forward kernel,
  saving the row log-sum-exp.
- `pallas::attention_backward(q, k, v, out, grad_out, lse, mask, scale,
  is_causal, dropout_p=0.0, seed=None) -> (dq, dk, dv)`: FlashAttention-2's
  backward kernels, which recompute the probabilities block by block from
  lse (and the dropout mask from the same seed).

Keys and values with fewer heads than the query (GQA, MQA: `enable_gqa`, or
one head broadcast) are read in place, never repeated. A batch dimension
broadcast between query and key/value, or a mask broadcast along its last
two dimensions, is materialised once; a mask broadcast along batch or heads
is not.

Where torch allows both `attn_mask` and `is_causal` (its CPU kernels), both
apply. A row that sees no key gives 0, and gradients 0, as torch gives.
A float mask's own gradient (rare: a learned bias) is computed from the
saved statistics with torch ops, at the cost of one (L, S) tensor per head.

Dropout (`dropout_p > 0`, as SDPA in training): each attention probability
is kept with probability 1 - p and scaled by 1 / (1 - p), out =
dropout(softmax(s)) @ v; p = 1 gives zeros. The mask is never in memory:
the composite draws a 32-bit seed from torch's generator (so
`torch.manual_seed` reproduces it in eager, and under torch.compile it is
one more random op in the graph) and hands it to the forward op, which
hashes it with each (batch·head, query row) into the rows' keys (B, Hq, L)
int32 for the kernels; every kernel hashes a row's key with the key index
into the keep bit (kernels/attention_shapes.py: one hash in every family,
on global indices, so any backend and any block sizes give the same mask
for a seed). The backward op gets the same seed from the autograd context.
`dropout_keep` gives that mask for a seed, in torch, for references. The
statistics match SDPA's, not its bits (torch's own dropout draws its mask
differently). `dropout_p = 0` adds nothing: no seed, no keys, the kernels
as they were.
"""

from __future__ import annotations

import math

import torch

from torch_pallas.kernels.attention_shapes import (DROPOUT_BITS, DROPOUT_GOLDEN, DROPOUT_MIX,
                                                   MAX_HEAD_DIM, AttentionDims, attention_flops,
                                                   dropout_scale, dropout_threshold)
from torch_pallas.base import dtypes
from torch_pallas.runtime import launch, registry, shape_buckets
from torch_pallas.library import registration
from torch_pallas.ops import attention_spans, checks
from torch_pallas.ops import matmul as matmul_op

OP = "pallas::attention"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --- the canonical call ----------------------------------------------------

def _heads(t: torch.Tensor) -> int:
    return t.shape[-3] if t.dim() >= 3 else 1


def check_arguments(query, key, value, attn_mask, dropout_p, enable_gqa, op: str = OP):
    """SDPA's arguments, as torch checks them; errors name `op`, the function
    the caller called. Returns _batch's dimensions."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        checks.tensor(op, name, t)
        if t.dim() < 2:
            raise checks.RefusedLikeTorch(
                f"{op}: {name} must have at least 2 dimensions (..., length, head_dim), "
                f"got {name}.shape={tuple(t.shape)}")
    checks.dtype_in(op, "query", query.dtype, DTYPES)
    checks.same_dtype(op, query, key, names=("query", "key"))
    checks.same_dtype(op, query, value, names=("query", "value"))
    checks.same_device(op, query, key, names=("query", "key"))
    checks.same_device(op, query, value, names=("query", "value"))
    if key.shape[-1] != query.shape[-1]:
        raise checks.RefusedLikeTorch(
            f"{op}: query and key must have the same head dimension, got "
            f"query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}")
    if key.shape[-2] != value.shape[-2]:
        raise checks.RefusedLikeTorch(
            f"{op}: key and value must have the same length, got "
            f"key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}")
    for name, size in (("query", query.shape[-1]), ("value", value.shape[-1])):
        if not 1 <= size <= MAX_HEAD_DIM:
            raise ValueError(
                f"{op}: head dimension {name}.shape[-1]={size} is not supported; the "
                f"kernels take 1 to {MAX_HEAD_DIM}")
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{op}: dropout_p must be a float in [0, 1], got {dropout_p!r}")
    if enable_gqa:
        hq, hk, hv = _heads(query), _heads(key), _heads(value)
        if hk != hv or hq % hk:
            raise checks.RefusedLikeTorch(
                f"{op}: with enable_gqa the query's heads must be a multiple of the key's "
                f"and value's, which must be equal; got query.shape={tuple(query.shape)}, "
                f"key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}")
    if attn_mask is not None:
        checks.tensor(op, "attn_mask", attn_mask)
        if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
            raise TypeError(
                f"{op}: attn_mask has dtype {attn_mask.dtype}; it must be torch.bool, "
                f"torch.float32 or the query's dtype ({query.dtype}), as torch requires")
        checks.same_device(op, query, attn_mask, names=("query", "attn_mask"))
    outer, heads, kv_heads = _batch(query, key, value, enable_gqa, op)
    if attn_mask is not None and op != OP:  # (the op checks it as it lays the mask out)
        _check_mask_shape(attn_mask, (*outer, heads, query.shape[-2], key.shape[-2]), op)
    return outer, heads, kv_heads


def _batch(query, key, value, enable_gqa, op: str = OP):
    """(outer batch shape, query heads, key/value heads): the dimensions
    before the head axis broadcast; heads broadcast too unless GQA."""
    shapes = [t.shape[:-3] for t in (query, key, value)]
    hq, hk, hv = _heads(query), _heads(key), _heads(value)
    try:
        # torch.broadcast_shapes only where they differ: it costs 15 us.
        same = shapes[0] == shapes[1] == shapes[2]
        outer = shapes[0] if same else torch.broadcast_shapes(*shapes)
        if enable_gqa:
            return outer, hq, hk
        heads = hq if hq == hk == hv else torch.broadcast_shapes((hq,), (hk,), (hv,))[0]
    except RuntimeError:
        raise checks.RefusedLikeTorch(
            f"{op}: the batch dimensions of query.shape={tuple(query.shape)}, "
            f"key.shape={tuple(key.shape)} and value.shape={tuple(value.shape)} do not "
            "broadcast") from None
    # One key/value head shared by every query head is read in place (MQA).
    kv_heads = 1 if hk == hv == 1 and hq == heads else heads
    return outer, heads, kv_heads


def _canonical(t: torch.Tensor, outer, heads: int) -> torch.Tensor:
    """`t` as (B, heads, length, dim): a broadcast materialised, nothing
    copied otherwise; `t` itself where it has that shape (SDPA's usual
    call: each view is a dispatcher call, several us of a decode step)."""
    if t.dim() == 4 and len(outer) == 1 and t.shape[0] == outer[0] and t.shape[1] == heads:
        return t
    t = t.reshape((1,) * (len(outer) + 3 - t.dim()) + tuple(t.shape))
    return t.expand(*outer, heads, *t.shape[-2:]).reshape(math.prod(outer), heads, *t.shape[-2:])


def _check_mask_shape(mask: torch.Tensor, scores: tuple, op: str) -> None:
    try:
        fits = torch.broadcast_shapes(mask.shape, scores) == torch.Size(scores)
    except RuntimeError:
        fits = False
    if not fits:
        raise checks.RefusedLikeTorch(
            f"{op}: attn_mask.shape={tuple(mask.shape)} does not broadcast to the "
            f"attention scores' shape {scores} (batch..., heads, L, S)")


def _canonical_mask(mask: torch.Tensor, dtype, outer, heads: int, length: int,
                    kv_length: int) -> torch.Tensor:
    """The mask as an additive (Bm, Hm, L, S), Bm in {1, B}, Hm in {1, heads}."""
    scores = (*outer, heads, length, kv_length)
    _check_mask_shape(mask, scores, OP)
    if mask.dtype == torch.bool:  # True: take part in attention
        # (not `~mask`: a bool NOT of fake CUDA tensors fails in AOT export)
        mask = torch.full_like(mask, float("-inf"), dtype=dtype).masked_fill(mask, 0.0)
    mask = mask.reshape((1,) * (len(scores) - mask.dim()) + tuple(mask.shape))
    batched = any(size != 1 for size in mask.shape[:len(outer)])
    mask_outer = tuple(outer) if batched else (1,) * len(outer)
    mask_heads = mask.shape[len(outer)]
    mask = mask.expand(*mask_outer, mask_heads, length, kv_length)
    return mask.reshape(math.prod(mask_outer), mask_heads, length, kv_length)


def check_window(op: str, window_size, softcap) -> tuple[int, int]:
    """window_size (left, right) and softcap, as the ops (and
    torch_pallas.jax's attention) take them; returns the window."""
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise TypeError(f"{op}: window_size must be two ints (left, right), got "
                        f"{window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"{op}: window_size entries must be -1 (unbounded) or >= 0, got "
                         f"window_size={tuple(window_size)}")
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or not softcap >= 0:
        raise ValueError(f"{op}: softcap must be a float >= 0 (0: off), got {softcap!r}")
    return left, right


def check_extras(op: str, window_size, softcap, sinks, query, heads: int) -> tuple[int, int]:
    """window_size (left, right), softcap and sinks, as the ops take them;
    returns the window."""
    left, right = check_window(op, window_size, softcap)
    if sinks is not None:
        checks.tensor(op, "sinks", sinks)
        if sinks.shape != (heads,):
            raise ValueError(f"{op}: sinks must hold one logit per query head, shape "
                             f"({heads},), got sinks.shape={tuple(sinks.shape)}")
        if sinks.dtype != query.dtype:
            raise TypeError(f"{op}: sinks.dtype={sinks.dtype} must be the query's dtype "
                            f"({query.dtype})")
        checks.same_device(op, query, sinks, names=("query", "sinks"))
    return left, right


def attention_implementation(query, key, value, attn_mask=None, dropout_p=0.0,
                             is_causal=False, scale=None, enable_gqa=False,
                             window_size=(-1, -1), softcap=0.0, sinks=None):
    outer, heads, kv_heads = check_arguments(query, key, value, attn_mask, dropout_p, enable_gqa)
    left, right = check_extras(OP, window_size, softcap, sinks, query, heads)
    length, kv_length, value_dim = query.shape[-2], key.shape[-2], value.shape[-1]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    q = _canonical(query, outer, heads)
    k = _canonical(key, outer, kv_heads)
    v = _canonical(value, outer, kv_heads)
    mask = None
    if attn_mask is not None:
        mask = _canonical_mask(attn_mask, query.dtype, outer, heads, length, kv_length)
    if left >= 0 or right >= 0 or softcap > 0 or sinks is not None:
        seed = dropout_seed(query.device) if dropout_p > 0 else None
        out, _ = torch.ops.pallas.attention_forward(q, k, v, mask, scale, bool(is_causal),
                                                    float(dropout_p), seed, left, right,
                                                    float(softcap), sinks)
    elif dropout_p > 0:
        out, _ = _forward(q, k, v, mask, scale, bool(is_causal), float(dropout_p),
                          dropout_seed(query.device))
    else:
        out, _ = _forward(q, k, v, mask, scale, bool(is_causal))
    has_heads = max(query.dim(), key.dim(), value.dim()) >= 3
    shape = (*outer, *((heads,) if has_heads else ()), length, value_dim)
    return checks.shaped(out, shape)


# --- the forward op --------------------------------------------------------

def kernel_params(scale: float, is_causal: bool, dropout_p: float = 0.0, spans: bool = False,
                  softcap: float = 0.0, span_width: int = 0,
                  window: tuple[int, int] | None = None) -> dict:
    """The kernels' static parameters; `dropout_p`, `spans`, `softcap`,
    `span_width` and `window` (span_window's) only when used, so that a call
    without them is the same kernel as ever."""
    params = {"scale": float(scale), "causal": bool(is_causal)}
    if dropout_p > 0:
        params["dropout_p"] = float(dropout_p)
    if spans:
        params["spans"] = True
        if span_width > 0:
            params["span_width"] = int(span_width)
        if window is not None:
            params["window"] = (int(window[0]), int(window[1]))
    if softcap > 0:
        params["softcap"] = float(softcap)
    return params


def span_width(is_causal: bool, window_left: int, window_right: int) -> int:
    """The widest span a window allows (left + right + 1 keys, a causal rule
    folded in), 0 where a side is unbounded."""
    if is_causal:
        window_right = 0 if window_right < 0 else min(window_right, 0)
    if window_left < 0 or window_right < 0:
        return 0
    return window_left + window_right + 1


# --- windows, packed sequences, softcap and sinks ---------------------------

def span_rule(is_causal: bool, window_left: int, window_right: int,
              packed: bool) -> tuple[str | None, int, int, bool]:
    """What the kernels take for a window or packed sequences: (the key
    spans to build: None, "window" or "sequences"; the window's left and
    right with a causal rule folded in (SDPA's top-left alignment); the
    kernels' causal flag). Without either, no spans and the causal rule as
    it is. The torch op and torch_pallas.jax build the spans it names, each
    with its own arrays."""
    if not (packed or window_left >= 0 or window_right >= 0):
        return None, window_left, window_right, is_causal
    if is_causal:
        window_right = 0 if window_right < 0 else min(window_right, 0)
    if packed:
        return "sequences", window_left, window_right, False
    if window_left < 0 and window_right == 0:  # plain causal: no spans needed
        return None, window_left, window_right, True
    return "window", window_left, window_right, False


def span_window(is_causal: bool, window_left: int, window_right: int,
                packed: bool) -> tuple[int, int] | None:
    """The window (left, right) a call's spans are exactly, where they are a
    window's (span_rule's "window"), for the kernels to mask by from the
    indices; None otherwise."""
    which, left, right, _ = span_rule(is_causal, window_left, window_right, packed)
    return (left, right) if which == "window" else None


def _spans(q, k, is_causal, window_left, window_right, cu_seq_q, cu_seq_k):
    """(spans (L, 2) or None, causal): span_rule's spans, built."""
    which, left, right, causal = span_rule(is_causal, window_left, window_right,
                                           cu_seq_q is not None)
    if which == "window":
        return attention_spans.window_spans(q.shape[2], k.shape[2], left, right, q.device), causal
    if which == "sequences":
        return attention_spans.sequence_spans(cu_seq_q, cu_seq_k, q.shape[2], left, right), causal
    return None, causal


class SequenceError(ValueError):
    """Bad cu_seq_q / cu_seq_k values, found by the forward op (the one
    place that reads them): `problem` names the argument and its value, and
    `renamed(op)` says it again for the op the caller called
    (varlen_attention's composite)."""

    def __init__(self, op: str, problem: str):
        super().__init__(f"{op}: {problem}")
        self.problem = problem

    def renamed(self, op: str) -> "SequenceError":
        return SequenceError(op, self.problem)


def check_sequences(cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, rows: int, keys: int,
                    max_q: int, max_k: int, op: str) -> None:
    """cu_seq_q's and cu_seq_k's values: starting at 0, non-decreasing,
    within the rows and keys, no sequence longer than max_q / max_k (0:
    unchecked). One read of each; raises SequenceError."""
    for name, cu, total, most, limit in (("cu_seq_q", cu_seq_q, rows, max_q, "max_q"),
                                         ("cu_seq_k", cu_seq_k, keys, max_k, "max_k")):
        values = cu.tolist()
        if values[0] != 0:
            raise SequenceError(op, f"{name} must start at 0, got {name}[0]={values[0]}")
        lengths = [b - a for a, b in zip(values, values[1:])]
        for i, length in enumerate(lengths):
            if length < 0:
                raise SequenceError(op, f"{name} must be non-decreasing (cumulative sequence "
                                        f"ends), got {name}[{i}]={values[i]} > "
                                        f"{name}[{i + 1}]={values[i + 1]}")
        if values[-1] > total:
            raise SequenceError(op, f"{name}[-1]={values[-1]} is past the {total} "
                                    f"{'query' if name == 'cu_seq_q' else 'key'} tokens")
        longest = max(lengths, default=0)
        if most and longest > most:
            raise SequenceError(op, f"sequence {lengths.index(longest)} has {longest} "
                                    f"{'queries' if name == 'cu_seq_q' else 'keys'} in "
                                    f"{name}, more than {limit}={most}")


def _with_sinks(out, lse, sinks):
    """o and lse with each query head's sink logit in every row's softmax
    denominator: lse' = logaddexp(lse, sink), o' = o * exp(lse - lse') (a
    row that saw nothing keeps o = 0, and gets lse' = sink)."""
    sink = sinks.float().reshape(1, -1, 1)
    seen = torch.where(torch.isinf(lse), float("-inf"), lse)
    total = torch.logaddexp(seen, sink)
    out = (out.float() * torch.exp(seen - total).unsqueeze(-1)).to(out.dtype)
    return out, total


def sinks_gradient(sinks, out, grad_out, lse):
    """d loss / d sink_h = -sum over batch and rows of exp(sink_h - lse) *
    rowsum(grad_out * out) (lse including the sink), in the sinks' dtype."""
    delta = (grad_out.float() * out.float()).sum(-1)
    weight = torch.exp(sinks.float().reshape(1, -1, 1) - lse)
    return -(weight * delta).sum((0, 2)).to(sinks.dtype)


def _dropout_operands(q: torch.Tensor, dropout_p: float, seed, where: str) -> tuple:
    """What the kernels take for dropout: the rows' keys (B, Hq, L) hashed
    from the seed (nothing without dropout)."""
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{where}: dropout_p must be in [0, 1], got {dropout_p!r}")
    if dropout_p == 0:
        return ()
    if seed is None or seed.numel() != 1 or seed.dtype.is_floating_point or seed.is_complex():
        got = None if seed is None else (seed.dtype, tuple(seed.shape))
        raise ValueError(f"{where}: dropout_p={dropout_p} needs a one-element integer seed "
                         f"(dropout_seed), got {got}")
    b, hq, length = q.shape[:3]
    return (dropout_row_keys(seed, b * hq, length).reshape(b, hq, length),)


def _dims(q, k, v) -> AttentionDims:
    return AttentionDims(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2],
                         q.shape[3], v.shape[3])


def _forward_fake(q, k, v, mask, scale, is_causal, dropout_p=0.0, seed=None, window_left=-1,
                  window_right=-1, softcap=0.0, sinks=None, cu_seq_q=None, cu_seq_k=None,
                  max_q=0, max_k=0):
    b, hq, l, _ = q.shape
    return q.new_empty((b, hq, l, v.shape[-1])), q.new_empty((b, hq, l), dtype=torch.float32)


def forward_implementation(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor | None, scale: float, is_causal: bool,
                           dropout_p: float = 0.0, seed: torch.Tensor | None = None,
                           window_left: int = -1, window_right: int = -1,
                           softcap: float = 0.0, sinks: torch.Tensor | None = None,
                           cu_seq_q: torch.Tensor | None = None,
                           cu_seq_k: torch.Tensor | None = None, max_q: int = 0,
                           max_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    if cu_seq_q is not None:
        check_sequences(cu_seq_q, cu_seq_k, q.shape[2], k.shape[2], max_q, max_k,
                        "pallas::attention_forward")
    return _forward_values(q, k, v, mask, scale, is_causal, dropout_p, seed, window_left,
                           window_right, softcap, sinks, cu_seq_q, cu_seq_k)


def _traced_forward(q, k, v, mask, scale, is_causal, dropout_p=0.0, seed=None, window_left=-1,
                    window_right=-1, softcap=0.0, sinks=None, cu_seq_q=None, cu_seq_k=None,
                    max_q=0, max_k=0):
    """What torch.compile traces on CUDA: the kernels, no read of cu_seq."""
    return _forward_values(q, k, v, mask, scale, is_causal, dropout_p, seed, window_left,
                           window_right, softcap, sinks, cu_seq_q, cu_seq_k)


def _forward_values(q, k, v, mask, scale, is_causal, dropout_p, seed, window_left, window_right,
                    softcap, sinks, cu_seq_q, cu_seq_k):
    dropping = _dropout_operands(q, dropout_p, seed, "pallas::attention_forward")
    if q.shape[:3].numel() * v.shape[-1] == 0 or k.shape[2] == 0:
        out, lse = _forward_fake(q, k, v, mask, scale, is_causal)
        if k.shape[2] == 0:  # no keys: every row sees nothing
            out.zero_()
        lse.fill_(float("inf"))
        return (out, lse) if sinks is None else _with_sinks(out, lse, sinks)
    length = q.shape[2]
    rows, keys = packed_lengths(q, k, v, cu_seq_q, mask, dropout_p)
    q, k, v = _padded(q, rows), _padded(k, keys), _padded(v, keys)
    spans, causal = _spans(q, k, is_causal, window_left, window_right, cu_seq_q, cu_seq_k)
    inputs = ((q, k, v) + (() if mask is None else (mask,)) + (() if spans is None else (spans,))
              + dropping)
    out, lse = launch.run("attention", q.device, inputs,
                          kernel_params(scale, causal, dropout_p, spans is not None, softcap,
                                        span_width(is_causal, window_left, window_right),
                                        span_window(is_causal, window_left, window_right,
                                                    cu_seq_q is not None)))
    out, lse = _unpadded(out, length), _unpadded(lse, length)
    return (out, lse) if sinks is None else _with_sinks(out, lse, sinks)


def packed_lengths(q, k, v, cu_seq_q, mask, dropout_p) -> tuple[int, int]:
    """The query rows and keys a packed call's kernels are built for. On
    the CPU, from the second distinct packed length of a family on, the
    length rounded up to torch_pallas.runtime.shape_buckets' buckets:
    padding-free training packs a new total length into every batch, and
    each length would build its own forward and backward kernels (1-2 s
    each). The padded rows lie past cu_seq_q[-1] and see nothing (sliced
    off); the padded keys lie past cu_seq_k[-1], in no row's span. Query
    and key lengths bucket apart where they differ. Exact without packed
    sequences, with a mask or dropout (its draws follow the shape), where
    torch.compile traces, off the CPU, and for tensors of other types
    (fake, functional, DTensor)."""
    length, keys = q.shape[2], k.shape[2]
    if (cu_seq_q is None or mask is not None or dropout_p > 0 or not shape_buckets.enabled
            or torch.compiler.is_compiling()
            or any(type(t) is not torch.Tensor or t.device.type != "cpu" for t in (q, k, v))):
        return length, keys
    family = ("pallas::attention", q.dtype, q.shape[0], q.shape[1], k.shape[1], q.shape[3],
              v.shape[3])
    if length == keys:
        n = shape_buckets.size((*family, "tokens"), length)
        return n, n
    return shape_buckets.size((*family, "q"), length), shape_buckets.size((*family, "k"), keys)


def _padded(t: torch.Tensor, n: int) -> torch.Tensor:
    """t (B, H, L[, E]) zero-padded to n rows along L (t itself at n), by
    matmul's padding (t written once, the padding alone zeroed)."""
    if t.shape[2] == n:
        return t
    cols = t.shape[3] if t.dim() == 4 else 1
    flat = t.reshape(-1, t.shape[2], cols)  # a view for packed calls' (1, H, T, E)
    return matmul_op.zero_padded(flat, n, cols).view(*t.shape[:2], n, *t.shape[3:])


def _unpadded(t: torch.Tensor, n: int) -> torch.Tensor:
    """t's first n rows along L, contiguous as the kernels' results are."""
    return t if t.shape[2] == n else t[:, :, :n].contiguous()


_FORWARD_DEFAULTS = (0.0, None, -1, -1, 0.0, None, None, None, 0, 0)


def _setup_context(ctx, inputs, output):
    # The dispatcher passes the arguments given: the trailing ones may be absent.
    (q, k, v, mask, scale, is_causal, dropout_p, seed, window_left, window_right, softcap, sinks,
     cu_seq_q, cu_seq_k, _, _) = (*inputs, *_FORWARD_DEFAULTS[len(inputs) - 6:])
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, mask, out, lse, seed, sinks, cu_seq_q, cu_seq_k)
    ctx.params = (scale, is_causal, dropout_p, window_left, window_right, softcap, len(inputs))


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, mask, out, lse, seed, sinks, cu_seq_q, cu_seq_k = ctx.saved_tensors
    scale, is_causal, dropout_p, window_left, window_right, softcap, num_inputs = ctx.params
    extras = (window_left, window_right, softcap, cu_seq_q, cu_seq_k)
    dq = dk = dv = dmask = dsinks = None
    if any(ctx.needs_input_grad[:3]):
        dq, dk, dv = torch.ops.pallas.attention_backward(
            q, k, v, out, grad_out, lse, mask, scale, is_causal, dropout_p, seed, *extras)
    if ctx.needs_input_grad[3]:
        dmask = _mask_gradient(q, k, v, mask, out, grad_out, lse, scale, is_causal, dropout_p,
                               seed, *extras)
    if num_inputs > 11 and ctx.needs_input_grad[11]:
        dsinks = sinks_gradient(sinks, out, grad_out, lse)
    grads = (dq, dk, dv, dmask) + (None,) * 7 + (dsinks,) + (None,) * 4
    return grads[:num_inputs]


def _mask_gradient(q, k, v, mask, out, grad_out, lse, scale, is_causal, dropout_p=0.0,
                   seed=None, window_left=-1, window_right=-1, softcap=0.0, cu_seq_q=None,
                   cu_seq_k=None):
    """d loss / d mask = the scores' gradient, p * (dp Z - delta) (Z the
    dropout's kept-and-scaled mask, 1 without dropout), summed over the
    mask's broadcast batch and heads; torch ops in float32."""
    group = q.shape[1] // k.shape[1]
    k32 = k.float().repeat_interleave(group, dim=1)
    v32 = v.float().repeat_interleave(group, dim=1)
    scores = (q.float() @ k32.mT) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores + mask.float()
    spans, is_causal = _spans(q, k, is_causal, window_left, window_right, cu_seq_q, cu_seq_k)
    if spans is not None:
        scores = scores.masked_fill(~attention_spans.visible(spans, k.shape[2]), float("-inf"))
    if is_causal:
        scores = scores.masked_fill(_causal_hidden(q.shape[2], k.shape[2], q.device), float("-inf"))
    p = torch.exp(scores - lse.unsqueeze(-1))
    dp = grad_out.float() @ v32.mT
    if dropout_p > 0:
        keep = dropout_keep(seed, (*q.shape[:3], k.shape[2]), dropout_p)
        dp = dp * keep * dropout_scale(dropout_p)
    delta = (grad_out.float() * out.float()).sum(-1, keepdim=True)
    return (p * (dp - delta)).sum_to_size(mask.shape).to(mask.dtype)


def _causal_hidden(length: int, kv_length: int, device) -> torch.Tensor:
    return ~torch.ones(length, kv_length, dtype=torch.bool, device=device).tril()


def _forward_flops(q_shape, k_shape, v_shape, *args, out_shape, **kwargs) -> int:
    dims = AttentionDims(q_shape[0], q_shape[1], k_shape[1], q_shape[2], k_shape[2],
                         q_shape[3], v_shape[3])
    return attention_flops(dims, causal=False)


registration.define(
    "pallas::attention_forward", forward_implementation, fake=_forward_fake,
    backward=_backward, setup_context=_setup_context, flops=_forward_flops,
    triton_traced=_traced_forward,
)
# torch.ops.pallas.attention_forward, skipping the dispatcher on plain eager calls.
_forward = registration.direct_caller(torch.ops.pallas.attention_forward.default)


def _autocast_call(device_type: str, q, k, v, mask, scale, is_causal, dropout_p=0.0,
                   seed=None, window_left=-1, window_right=-1, softcap=0.0, sinks=None,
                   cu_seq_q=None, cu_seq_k=None, max_q=0, max_k=0):
    """Under torch.autocast, floating inputs are cast to its dtype, as torch
    casts scaled_dot_product_attention's."""
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t):
        if t is None or not t.is_floating_point() or t.device.type != device_type:
            return t
        return t if t.dtype == torch.float64 else t.to(dtype)

    return torch.ops.pallas.attention_forward(cast(q), cast(k), cast(v), cast(mask), scale,
                                              is_causal, dropout_p, seed, window_left,
                                              window_right, softcap, cast(sinks), cu_seq_q,
                                              cu_seq_k, max_q, max_k)


registration.register_autocast("pallas::attention_forward", _autocast_call)


# --- the backward op -------------------------------------------------------

def _backward_fake(q, k, v, out, grad_out, lse, mask, scale, is_causal, dropout_p=0.0,
                   seed=None, window_left=-1, window_right=-1, softcap=0.0, cu_seq_q=None,
                   cu_seq_k=None):
    # Contiguous, as the kernels write them, whatever the inputs' layout
    # (empty_like would promise q's strides: a transposed view's, in a model).
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def backward_implementation(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor,
                            mask: torch.Tensor | None, scale: float, is_causal: bool,
                            dropout_p: float = 0.0, seed: torch.Tensor | None = None,
                            window_left: int = -1, window_right: int = -1,
                            softcap: float = 0.0, cu_seq_q: torch.Tensor | None = None,
                            cu_seq_k: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if grad_out.dtype != q.dtype:
        raise TypeError(f"pallas::attention_backward: grad_out has dtype {grad_out.dtype}, "
                        f"q {q.dtype}; they must be the same")
    dropping = _dropout_operands(q, dropout_p, seed, "pallas::attention_backward")
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0 or out.numel() == 0:
        return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)
    length, kv_length = q.shape[2], k.shape[2]
    rows, keys = packed_lengths(q, k, v, cu_seq_q, mask, dropout_p)
    # padded rows see no key: their p is 0 whatever their (zero) lse
    q, out, grad_out, lse = (_padded(t, rows) for t in (q, out, grad_out, lse))
    k, v = _padded(k, keys), _padded(v, keys)
    spans, causal = _spans(q, k, is_causal, window_left, window_right, cu_seq_q, cu_seq_k)
    tables = () if spans is None else (spans, attention_spans.key_spans(spans, k.shape[2]))
    inputs = (q, k, v, out, grad_out, lse) + (() if mask is None else (mask,)) + tables + dropping
    dq, dk, dv = launch.run("attention_backward", q.device, inputs,
                            kernel_params(scale, causal, dropout_p, spans is not None, softcap,
                                          span_width(is_causal, window_left, window_right),
                                          span_window(is_causal, window_left, window_right,
                                                      cu_seq_q is not None)))
    return _unpadded(dq, length), _unpadded(dk, kv_length), _unpadded(dv, kv_length)


def _backward_flops(q_shape, k_shape, v_shape, *args, out_shape, **kwargs) -> int:
    """Five products of the forward's size: s, dp, dv, dq, dk (s
    recomputed)."""
    dims = AttentionDims(q_shape[0], q_shape[1], k_shape[1], q_shape[2], k_shape[2],
                         q_shape[3], v_shape[3])
    return attention_flops(dims, causal=False) * 5 // 2


registration.define(
    "pallas::attention_backward", backward_implementation, fake=_backward_fake,
    flops=_backward_flops,
)

# --- the composite, SDPA's signature ---------------------------------------

registration.define_composite(
    "pallas::attention",
    "(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
    "float dropout_p=0.0, bool is_causal=False, *, float? scale=None, "
    "bool enable_gqa=False, int[2] window_size=[-1, -1], float softcap=0.0, "
    "Tensor? sinks=None) -> Tensor",
    attention_implementation,
)
# torch.ops.pallas.attention, its implementation run straight on plain eager calls.
_call = registration.direct_caller(torch.ops.pallas.attention.default)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False, *, window_size: tuple[int, int] = (-1, -1),
              softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.nn.functional.scaled_dot_product_attention` on the Pallas
    attention kernels: same arguments, same results (float32 softmax
    statistics), differentiable (FlashAttention-2's backward), with SDPA's
    dropout when `dropout_p > 0` (the mask drawn from torch's generator).

    Beyond SDPA, keyword-only:
    - `window_size=(left, right)`: query i sees keys i - left <= j <= i +
      right (SDPA's top-left alignment; -1 unbounded; with `is_causal` both
      apply); the kernels skip the key blocks outside it.
    - `softcap=c`: scores capped to c * tanh(s / c) after scaling, before
      the mask (Gemma 2); 0 is off.
    - `sinks` (Hq,): a logit per query head joining each row's softmax
      denominator, adding nothing to the output (gpt-oss); differentiable,
      in the query's dtype."""
    if window_size == (-1, -1) and not softcap and sinks is None:
        return _call(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                     enable_gqa=enable_gqa)
    return torch.ops.pallas.attention(query, key, value, attn_mask, dropout_p, is_causal,
                                      scale=scale, enable_gqa=enable_gqa,
                                      window_size=list(window_size), softcap=softcap,
                                      sinks=sinks)


def attention_backward(q, k, v, out, grad_out, lse, mask=None, scale=None, is_causal=False,
                       dropout_p=0.0, seed=None):
    """The backward op on canonical tensors (kernels/attention_shapes.py):
    (dq, dk, dv) from the forward's `out` and `lse` (and, with dropout, its
    seed)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.ops.pallas.attention_backward(q, k, v, out, grad_out, lse, mask, scale,
                                               is_causal, dropout_p, seed)


# --- dropout: the seed, the rows' keys and the keep mask --------------------
#
# The hash of kernels/attention_shapes.py in int64 torch arithmetic on
# values in [0, 2**32) (torch has no wrapping uint32 products): what the
# composite hands the kernels, and the mask references are built from.

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), in halves of c, so that no
    int64 product overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, DROPOUT_MIX[0])
    x = x ^ (x >> 15)
    x = _mul32(x, DROPOUT_MIX[1])
    return x ^ (x >> 16)


def _absorb(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return _mix((key + _mul32(index, DROPOUT_GOLDEN)) & _MASK32)


def dropout_seed(device) -> torch.Tensor:
    """A 32-bit seed (0-d int64) drawn from torch's generator for `device`."""
    return torch.randint(0, 2**32, (), dtype=torch.int64, device=device)


def dropout_row_keys(seed: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """(rows, length) int32: the key of query row i of batch·head n, the
    seed hashed with n, then i (the bits of a uint32)."""
    device = seed.device
    n = torch.arange(rows, dtype=torch.int64, device=device).unsqueeze(-1)
    i = torch.arange(length, dtype=torch.int64, device=device)
    keys = _absorb(_absorb(seed.to(torch.int64) & _MASK32, n), i)
    return torch.where(keys >= 2**31, keys - 2**32, keys).to(torch.int32)


def dropout_keep(seed: torch.Tensor, scores_shape, dropout_p: float) -> torch.Tensor:
    """The keep mask the kernels use for `seed`, as a bool tensor of the
    attention scores' shape (..., L, S) (batch and head dimensions
    flattened in order, as the op flattens them)."""
    *lead, length, kv_length = scores_shape
    keys = dropout_row_keys(seed, math.prod(lead), length).to(torch.int64) & _MASK32
    j = torch.arange(kv_length, dtype=torch.int64, device=seed.device)
    bits = _absorb(keys.unsqueeze(-1), j)
    return ((bits >> (32 - DROPOUT_BITS)) >= dropout_threshold(dropout_p)).reshape(scores_shape)


# --- references and examples -----------------------------------------------

def reference(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
              scale=None, enable_gqa=False, keep=None) -> torch.Tensor:
    """torch's scaled_dot_product_attention in float64, a causal rule added
    to the mask (so that both may apply) and rows that see nothing 0. With
    dropout, `keep` (the scores' shape, e.g. from `dropout_keep`) is the
    mask: softmax, then kept entries times 1 / (1 - p), then @ value."""
    mask = reference_mask(attn_mask, is_causal, query.shape[-2], key.shape[-2])
    if dropout_p > 0:
        return dropout_reference(query.double(), key.double(), value.double(), mask,
                                 dropout_p, keep, scale=scale, enable_gqa=enable_gqa)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.double(), key.double(), value.double(), attn_mask=mask, scale=scale,
        enable_gqa=enable_gqa)
    return torch.nan_to_num(out, nan=0.0)


def dropout_reference(query, key, value, mask, dropout_p, keep, *, scale=None,
                      enable_gqa=False) -> torch.Tensor:
    """Attention with an explicit dropout mask, in the inputs' dtype: SDPA's
    math (softmax, dropout, @ value) with `keep` as the mask; `mask` additive
    or None; rows that see nothing 0, with gradients 0 (not NaN)."""
    if keep is None:
        raise ValueError("attention reference: dropout needs the keep mask (dropout_keep)")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if enable_gqa:
        group = query.shape[-3] // key.shape[-3]
        key, value = (t.repeat_interleave(group, -3) for t in (key, value))
    scores = (query @ key.mT) * scale
    if mask is not None:
        scores = scores + mask.to(scores.dtype)
    empty = (scores == float("-inf")).all(-1, keepdim=True)
    p = torch.softmax(scores.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    return (p * keep * dropout_scale(dropout_p)) @ value


def reference_mask(attn_mask, is_causal: bool, length: int, kv_length: int):
    """The mask and the causal rule as one additive float64 mask (or None)."""
    mask = None
    if attn_mask is not None:
        mask = attn_mask.double() if attn_mask.dtype != torch.bool else (
            torch.zeros((), dtype=torch.float64).masked_fill(~attn_mask.cpu(), float("-inf")))
    if is_causal:
        causal = torch.zeros(length, kv_length, dtype=torch.float64).masked_fill(
            _causal_hidden(length, kv_length, "cpu"), float("-inf"))
        mask = causal if mask is None else mask + causal
    return mask


def error_bound(query, key, value, ref, **kwargs) -> torch.Tensor:
    """Elementwise bound on |pallas - ref|: float32 accumulation over S and E
    (scores and the weighted sum of values), then one rounding of the output
    into the query's dtype; 16-bit probabilities are rounded once before
    P @ V on the GPU kernels."""
    s, e = key.shape[-2], query.shape[-1]
    magnitude = value.double().abs().max()
    accumulate = (s + e) * 2.0**-24 * 8 * magnitude
    probabilities = (2 * dtypes.ROUNDING[query.dtype] * magnitude if query.dtype != torch.float32
                     else 0)
    return accumulate + probabilities + dtypes.ROUNDING[query.dtype] * ref.abs() + 1e-6


def examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """Ragged lengths with GQA and a causal rule (bfloat16), and a broadcast
    boolean padding mask with L != S (float16): 16-bit, which every family
    runs (the Mosaic GPU kernels take no float32)."""
    found = []

    def make(shape, dtype):
        return torch.randn(shape, device=device, dtype=dtype, requires_grad=requires_grad)

    cases = (
        ((1, 4, 19, 16), (1, 2, 23, 16), (1, 2, 23, 24), torch.bfloat16,
         {"is_causal": True, "enable_gqa": True}),
        ((2, 1, 9, 8), (2, 1, 13, 8), (2, 1, 13, 8), torch.float16,
         {"attn_mask": torch.rand(2, 1, 1, 13, device=device) > 0.3}),
    )
    for q_shape, k_shape, v_shape, dtype, kwargs in cases:
        q, k, v = make(q_shape, dtype), make(k_shape, dtype), make(v_shape, dtype)
        ref = reference(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(),
                        **{n: (t.cpu() if isinstance(t, torch.Tensor) else t)
                           for n, t in kwargs.items()})
        found.append(registry.Example(
            (q, k, v), kwargs, ref, error_bound(q.detach().cpu(), k.detach().cpu(),
                                                v.detach().cpu(), ref)))
    return found


registry.register(registry.OpInfo(
    name="attention",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.attention",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.attention",
        "triton": "torch_pallas.kernels.triton.attention",
    },
    function=attention,
    torch_function=torch.nn.functional.scaled_dot_product_attention,
    examples=examples,
))


def backward_examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """The backward of a ragged GQA call with a causal rule, and of one with
    a per-batch mask that hides every key from some rows."""
    found = []
    cases = (((1, 4, 2, 21, 30, 16, 8), True, False, torch.bfloat16),
             ((1, 2, 2, 9, 13, 8, 8), False, True, torch.float16))
    for (b, hq, hkv, l, s, e, ev), causal, masked, dtype in cases:
        q, k, v, do = (torch.randn(shape, device=device).to(dtype)
                       for shape in ((b, hq, l, e), (b, hkv, s, e), (b, hkv, s, ev), (b, hq, l, ev)))
        mask = None
        if masked:
            mask = torch.randn(b, 1, l, s, device=device).to(dtype)
            mask[:, :, ::4] = float("-inf")
        scale = 1.0 / math.sqrt(e)
        out, lse = torch.ops.pallas.attention_forward(q, k, v, mask, scale, causal)
        grads = _reference_gradients(q, k, v, mask, do, scale, causal)
        bounds = tuple(error_bound(q.cpu(), k.cpu(), v.cpu(), g) * 4 * math.sqrt(s)
                       for g in grads)
        found.append(registry.Example((q, k, v, out, do, lse, mask, scale, causal), {},
                                      grads, bounds))
    return found


def _reference_gradients(q, k, v, mask, do, scale, causal):
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    out = reference(q64, k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1),
                    attn_mask=None if mask is None else mask.cpu(), is_causal=causal, scale=scale)
    return torch.autograd.grad(out, (q64, k64, v64), do.cpu().double())


registry.register(registry.OpInfo(
    name="attention_backward",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.attention_backward",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.attention_backward",
        "triton": "torch_pallas.kernels.triton.attention_backward",
    },
    function=attention_backward,
    torch_function=_reference_gradients,
    examples=backward_examples,
))
