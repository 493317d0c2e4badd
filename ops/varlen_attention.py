"""torch.ops.pallas.varlen_attention: packed variable-length attention,
`torch.nn.attention.varlen.varlen_attn`'s layout and semantics on every
device, with sliding windows, softcap and sinks.

`pallas::varlen_attention(query (T_q, H, D), key (T_k, H_kv, D), value
(T_k, H_kv, D_v), cu_seq_q (N + 1,), cu_seq_k (N + 1,), max_q, max_k, *,
scale=None, window_size=[-1, -1], enable_gqa=False, softcap=0.0,
sinks=None) -> (T_q, H, D_v)`: sequence b is the query rows cu_seq_q[b] <=
t < cu_seq_q[b + 1] attending to its own keys cu_seq_k[b] <= j <
cu_seq_k[b + 1]; `window_size` (left, right) within each sequence, aligned
bottom-right where its query and key lengths differ (FlashAttention's
rule: (-1, 0) is causal, the last query sees the last key). A row that sees
no key gives 0 (with zero gradients), or with sinks 0 too.

CompositeImplicitAutograd over `pallas::attention_forward` (ops/attention.py):
the packed tokens are one batch entry's rows, (1, H, T, D) views of the
(T, H, D) tensors (nothing copied; on the CPU the op pads packed lengths
that change from call to call to shape buckets: ops/attention.py's
packed_lengths), and the sequences become each row's key span
(ops/attention_spans.py), so the kernels visit only the key blocks of a
row's own sequence and window. cu_seq's values are checked inside the
forward op (starting at 0, non-decreasing, within the tokens, no sequence
longer than max_q / max_k): one read of each, in eager and compiled calls
alike (torch.compile traces around it). Their errors name this op in eager
calls; in a compiled graph, where this composite is traced away, the
forward op they were found in.
"""

from __future__ import annotations

import math

import torch

from torch_pallas.library import registration
from torch_pallas.ops import attention as attention_op
from torch_pallas.ops import attention_spans, checks
from torch_pallas.runtime import registry

OP = "pallas::varlen_attention"


def _check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, enable_gqa):
    for name, t in (("query", query), ("key", key), ("value", value)):
        checks.tensor(OP, name, t)
        if t.dim() != 3:
            raise ValueError(f"{OP}: {name} must be 3-D (tokens, heads, head_dim), got "
                             f"{name}.shape={tuple(t.shape)}")
    checks.dtype_in(OP, "query", query.dtype, attention_op.DTYPES)
    checks.same_dtype(OP, query, key, names=("query", "key"))
    checks.same_dtype(OP, query, value, names=("query", "value"))
    checks.same_device(OP, query, key, names=("query", "key"))
    checks.same_device(OP, query, value, names=("query", "value"))
    if key.shape[2] != query.shape[2]:
        raise ValueError(f"{OP}: query and key must have the same head dimension, got "
                         f"query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}")
    if key.shape[:2] != value.shape[:2]:
        raise ValueError(f"{OP}: key and value must have the same tokens and heads, got "
                         f"key.shape={tuple(key.shape)}, value.shape={tuple(value.shape)}")
    for name, size in (("query", query.shape[-1]), ("value", value.shape[-1])):
        if not 1 <= size <= attention_op.MAX_HEAD_DIM:
            raise ValueError(f"{OP}: head dimension {name}.shape[-1]={size} is not supported; "
                             f"the kernels take 1 to {attention_op.MAX_HEAD_DIM}")
    hq, hkv = query.shape[1], key.shape[1]
    if hq != hkv and not (enable_gqa and hkv > 0 and hq % hkv == 0):
        raise ValueError(
            f"{OP}: query has {hq} heads and key/value {hkv}: "
            + ("the query's heads must be a multiple of the key's" if enable_gqa else
               "they must be equal unless enable_gqa=True (then a multiple)"))
    for name, cu in (("cu_seq_q", cu_seq_q), ("cu_seq_k", cu_seq_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{OP}: {name} must be a tensor, got {type(cu).__name__}")
        if cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{OP}: {name} must be a 1-D int32 tensor of N + 1 cumulative "
                             f"sequence ends, got dtype {cu.dtype}, shape {tuple(cu.shape)}")
        checks.same_device(OP, query, cu, names=("query", name))
    if cu_seq_q.shape != cu_seq_k.shape:
        raise ValueError(f"{OP}: cu_seq_q and cu_seq_k must have the same length (N + 1), got "
                         f"{tuple(cu_seq_q.shape)} and {tuple(cu_seq_k.shape)}")
    for name, most in (("max_q", max_q), ("max_k", max_k)):
        if not isinstance(most, int) or isinstance(most, bool) or most < 0:
            raise ValueError(f"{OP}: {name} must be an int >= 0, got {most!r}")


def varlen_attention_implementation(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k,
                                    scale=None, window_size=(-1, -1), enable_gqa=False,
                                    softcap=0.0, sinks=None):
    _check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, enable_gqa)
    left, right = attention_op.check_extras(OP, window_size, softcap, sinks, query,
                                            query.shape[1])
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    try:
        out, _ = torch.ops.pallas.attention_forward(
            q, k, v, None, scale, False, 0.0, None, left, right, float(softcap), sinks,
            cu_seq_q, cu_seq_k, max_q, max_k)
    except attention_op.SequenceError as error:  # said for the op the caller called
        raise error.renamed(OP) from None
    return out.squeeze(0).transpose(0, 1)


registration.define_composite(
    OP,
    "(Tensor query, Tensor key, Tensor value, Tensor cu_seq_q, Tensor cu_seq_k, int max_q, "
    "int max_k, *, float? scale=None, int[2] window_size=[-1, -1], bool enable_gqa=False, "
    "float softcap=0.0, Tensor? sinks=None) -> Tensor",
    varlen_attention_implementation,
)


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, max_q: int, max_k: int, *,
                     scale: float | None = None, window_size: tuple[int, int] = (-1, -1),
                     enable_gqa: bool = False, softcap: float = 0.0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.nn.attention.varlen.varlen_attn` on the Pallas attention
    kernels, on every device and in float32, float16 and bfloat16:
    query (T_q, H, D), key and value (T_k, H_kv, D / D_v), `cu_seq_q` and
    `cu_seq_k` (N + 1,) int32 cumulative sequence ends, `max_q` / `max_k`
    the longest sequence's lengths; `window_size` (left, right) aligned
    bottom-right in each sequence ((-1, 0): causal). Differentiable in
    query, key, value and sinks. Beyond torch's: `softcap` (scores capped
    to c * tanh(s / c) after scaling) and `sinks` (H,), a logit per query
    head in each row's softmax denominator (gpt-oss)."""
    return torch.ops.pallas.varlen_attention(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
        window_size=list(window_size), enable_gqa=enable_gqa, softcap=softcap, sinks=sinks)


def torch_varlen_attention(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *,
                           scale=None, window_size=(-1, -1), enable_gqa=False, softcap=0.0,
                           sinks=None):
    """The stock PyTorch path: torch's `varlen_attn` where it runs (CUDA,
    16-bit, no softcap or sinks), else SDPA one sequence at a time with the
    window as a mask (sinks and softcap through the float64-free math of
    `reference` in the inputs' dtype)."""
    if (query.is_cuda and query.dtype != torch.float32 and not softcap and sinks is None):
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                           window_size=tuple(window_size), enable_gqa=enable_gqa)
    if softcap or sinks is not None:
        return reference(query, key, value, cu_seq_q, cu_seq_k, scale=scale,
                         window_size=window_size, softcap=softcap, sinks=sinks,
                         dtype=query.dtype)
    out = query.new_zeros(*query.shape[:2], value.shape[-1])
    ends_q, ends_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    for b in range(len(ends_q) - 1):
        q0, q1, k0, k1 = ends_q[b], ends_q[b + 1], ends_k[b], ends_k[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        spans = attention_spans.sequence_spans(
            torch.tensor([0, q1 - q0]), torch.tensor([0, k1 - k0]), q1 - q0, *window_size)
        seen = attention_spans.visible(spans, k1 - k0).to(query.device)
        q, k, v = (t.transpose(0, 1) for t in (query[q0:q1], key[k0:k1], value[k0:k1]))
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=seen, scale=scale, enable_gqa=enable_gqa)
        out[q0:q1] = torch.nan_to_num(o, nan=0.0).transpose(0, 1)
    return out


# --- references and examples -----------------------------------------------

def reference(query, key, value, cu_seq_q, cu_seq_k, max_q=0, max_k=0, *, scale=None,
              window_size=(-1, -1), enable_gqa=False, softcap=0.0, sinks=None,
              dtype=torch.float64):
    """Every sequence at once with a (T_q, T_k) visibility mask, in `dtype`
    torch ops: scores, softcap, the window aligned bottom-right, the sinks
    in the softmax; rows that see nothing 0. Differentiable."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    group = query.shape[1] // key.shape[1]
    spans = attention_spans.sequence_spans(cu_seq_q, cu_seq_k, query.shape[0], *window_size)
    seen = attention_spans.visible(spans, key.shape[0])  # (T_q, T_k)
    q, k, v = query.to(dtype), key.to(dtype), value.to(dtype)
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        sink = sinks.to(dtype).reshape(-1, 1, 1).expand(-1, scores.shape[1], 1)
        p = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        empty = ~seen.any(-1, keepdim=True)
        p = torch.softmax(scores.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    return torch.einsum("hqk,khd->qhd", p, v).to(query.dtype if dtype != torch.float64
                                                  else dtype)


def random_sequences(lengths, device) -> torch.Tensor:
    """(N + 1,) int32 cumulative ends of sequences of `lengths`."""
    ends = [0]
    for n in lengths:
        ends.append(ends[-1] + n)
    return torch.tensor(ends, dtype=torch.int32, device=device)


def examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """Packed causal sequences (an empty one, one with more queries than
    keys) with GQA, a window and sinks (bfloat16); sequences with softcap
    and a window on both sides (float16)."""
    found = []
    cases = (
        ([5, 0, 9, 6], [7, 3, 9, 4], 4, 2, 16, torch.bfloat16,
         {"window_size": (3, 0), "enable_gqa": True, "sinks": True}),
        ([11, 4], [8, 13], 2, 2, 8, torch.float16, {"window_size": (2, 1), "softcap": 5.0}),
    )
    for lq, lk, hq, hkv, d, dtype, kwargs in cases:
        q = torch.randn(sum(lq), hq, d, device=device).to(dtype)
        k = torch.randn(sum(lk), hkv, d, device=device).to(dtype)
        v = torch.randn(sum(lk), hkv, d, device=device).to(dtype)
        cu_q, cu_k = random_sequences(lq, device), random_sequences(lk, device)
        if kwargs.get("sinks"):
            kwargs = dict(kwargs, sinks=torch.randn(hq, device=device).to(dtype))
        if requires_grad:
            for t in (q, k, v, kwargs.get("sinks")):
                if t is not None:
                    t.requires_grad_()
        args = (q, k, v, cu_q, cu_k, max(lq), max(lk))
        ref = reference(*(a.detach().cpu() if isinstance(a, torch.Tensor) else a for a in args),
                        **{n: (t.detach().cpu() if isinstance(t, torch.Tensor) else t)
                           for n, t in kwargs.items()})
        bound = attention_op.error_bound(q.detach().cpu().transpose(0, 1),
                                         k.detach().cpu().transpose(0, 1),
                                         v.detach().cpu().transpose(0, 1),
                                         ref.transpose(0, 1)).transpose(0, 1)
        found.append(registry.Example(args, kwargs, ref, bound))
    return found


registry.register(registry.OpInfo(
    name="varlen_attention",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.attention",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.attention",
        "triton": "torch_pallas.kernels.triton.attention",
    },
    function=varlen_attention,
    torch_function=torch_varlen_attention,
    examples=examples,
))
