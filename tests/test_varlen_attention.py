"""torch_pallas.varlen_attention (packed sequences, windows, softcap, sinks)
and the SDPA drop-in's window_size / softcap / sinks, against float64
references on fresh random data: ragged sequence lengths (an empty one,
more queries than keys, fewer), rows past the last sequence, GQA; values
and gradients (query, key, value, sinks) on the default backend and on
every CPU backend; rows that see nothing; torch.compile; bad arguments
refused by name. The kernels' block skipping is tested in each family's
kernel file (tests/test_attention_<family>.py)."""

from __future__ import annotations

import math

import pytest
import torch

import torch_pallas
from helpers import assert_within
from torch_pallas.ops import attention as attention_op
from torch_pallas.ops import varlen_attention as varlen_op
from torch_pallas.runtime import compile_cache, shape_buckets

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def packed(lq, lk, hq=4, hkv=2, d=16, dv=None, dtype=F32, extra_rows=0, sinks=False):
    """Random packed q (sum lq + extra_rows, hq, d), k and v (sum lk, hkv,
    d / dv), cu_seq_q, cu_seq_k, and sinks (hq,) when asked; all leaves
    that require grad."""
    dv = d if dv is None else dv
    q = torch.randn(sum(lq) + extra_rows, hq, d).to(dtype).requires_grad_()
    k = torch.randn(sum(lk), hkv, d).to(dtype).requires_grad_()
    v = torch.randn(sum(lk), hkv, dv).to(dtype).requires_grad_()
    s = torch.randn(hq).to(dtype).requires_grad_() if sinks else None
    cu_q = varlen_op.random_sequences(lq, "cpu")
    cu_k = varlen_op.random_sequences(lk, "cpu")
    return q, k, v, cu_q, cu_k, s


def check(lq, lk, *, dtype=F32, extra_rows=0, sinks=False, hq=4, hkv=2, d=16, dv=None,
          **kwargs):
    """Values and every gradient against the float64 reference; the bound:
    float32 accumulation plus the dtype's rounding (ops/attention.py's
    error_bound), gradients scaled by their magnitude."""
    q, k, v, cu_q, cu_k, s = packed(lq, lk, hq, hkv, d, dv, dtype, extra_rows, sinks)
    gqa = hq != hkv
    out = torch_pallas.varlen_attention(q, k, v, cu_q, cu_k, max(lq), max(lk),
                                        enable_gqa=gqa, sinks=s, **kwargs)
    assert out.dtype == dtype and out.shape == (q.shape[0], hq, v.shape[-1])
    leaves = [t for t in (q, k, v, s) if t is not None]
    exact = [t.detach().double().requires_grad_() for t in leaves]
    ref = varlen_op.reference(*exact[:3], cu_q, cu_k, sinks=exact[3] if sinks else None,
                              **kwargs)
    bound = attention_op.error_bound(q.detach().transpose(0, 1), k.detach().transpose(0, 1),
                                     v.detach().transpose(0, 1), ref.detach().transpose(0, 1))
    assert_within(out, ref.detach(), bound.transpose(0, 1), f"varlen_attention {dtype}: out")
    grad = torch.randn(out.shape).to(dtype)
    grads = torch.autograd.grad(out, leaves, grad)
    expected = torch.autograd.grad(ref, exact, grad.double())
    for name, g, e, like in zip(("dq", "dk", "dv", "dsinks"), grads, expected, leaves):
        assert g.dtype == like.dtype and g.shape == like.shape, name
        scale = e.abs().max().item() + 1e-3
        tolerance = {F32: 2e-5, F16: 4e-3, BF16: 3e-2}[dtype] * scale * math.sqrt(max(lk) + 1)
        assert_within(g, e, torch.full_like(e, tolerance), f"varlen_attention {dtype}: {name}")
    return out, grads


CASES = {
    # an empty sequence, more queries than keys (rows that see nothing),
    # fewer, and rows past the last sequence
    "causal": (([5, 0, 9, 6], [7, 3, 9, 4]), dict(window_size=(-1, 0), extra_rows=3)),
    "full": (([5, 11], [13, 2]), dict()),
    "window_left": (([17, 9], [17, 12]), dict(window_size=(4, 0), dtype=BF16)),
    "window_both_sides": (([12, 7], [10, 10]), dict(window_size=(2, 3), dtype=F16)),
    "softcap": (([9, 14], [9, 14]), dict(window_size=(-1, 0), softcap=4.0)),
    "sinks": (([6, 0, 10], [6, 2, 8]), dict(window_size=(5, 0), sinks=True)),
    "sinks_softcap_bf16": (([8, 13], [8, 13]), dict(softcap=3.0, sinks=True, dtype=BF16,
                                                   window_size=(6, 0))),
    "mha_dv": (([7, 8], [9, 8]), dict(hq=2, hkv=2, dv=24, window_size=(-1, 0))),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_matches_float64(case):
    (lq, lk), kwargs = case
    check(lq, lk, **kwargs)


def test_every_backend(cpu_backend):
    """Each CPU backend (the simulators included) on a small packed, GQA,
    windowed call with sinks and softcap, and its gradients."""
    check([5, 0, 7], [6, 3, 5], dtype=BF16, window_size=(3, 0), sinks=True, softcap=5.0,
          extra_rows=2)


def test_rows_that_see_nothing_give_zero_and_zero_gradients():
    """Sequence 0 has 6 queries and 2 keys, causal bottom-right: its first
    4 rows see nothing; rows past the last sequence neither."""
    out, (dq, _, _) = check([6, 3], [2, 3], window_size=(-1, 0), extra_rows=2)
    for rows in (slice(0, 4), slice(9, 11)):
        assert torch.equal(out[rows], torch.zeros_like(out[rows]))
        assert torch.equal(dq[rows], torch.zeros_like(dq[rows]))


def test_matches_each_sequence_run_alone():
    """A packed batch equals SDPA on each sequence alone (causal, same
    lengths): what padding-free training relies on."""
    lengths = [13, 4, 22]
    q, k, v, cu, _, _ = packed(lengths, lengths, hq=2, hkv=2)
    out = torch_pallas.varlen_attention(q, k, v, cu, cu, 22, 22, window_size=(-1, 0))
    start = 0
    for n in lengths:
        alone = torch.nn.functional.scaled_dot_product_attention(
            *(t[start:start + n].transpose(0, 1) for t in (q, k, v)), is_causal=True)
        torch.testing.assert_close(out[start:start + n], alone.transpose(0, 1), rtol=1e-5,
                                   atol=1e-5)
        start += n


def test_changing_token_counts_build_bucketed_kernels():
    """Padding-free batches of changing total lengths (what training with
    DataCollatorWithFlattening sends): the first length's kernels are
    exact, later lengths' are built for shape_buckets' sizes (the rows and
    keys padded past the last sequence, sliced off the results), so four
    lengths build three sizes' kernels; values and every gradient stay the
    float64 reference's, with and without a window, Lq != Lk too."""
    shape_buckets.reset()
    # No kernel an earlier test in this process built (a padded batch's
    # fold is a packed row too) may stand in for one counted here.
    compile_cache.clear()
    try:
        before = compile_cache.compiled.builds
        for lengths in ([20, 13], [9, 25, 4], [30, 1], [17, 16, 2]):  # 33, 38, 31, 35 tokens
            check(lengths, lengths, window_size=(-1, 0))
        # 33 exact, then buckets 40, 32, 40: a forward and a backward kernel each
        assert compile_cache.compiled.builds - before == 2 * 3
        q, k, v, cu, *_ = packed([18, 17], [20, 19])
        q, k, v = (t.detach().transpose(0, 1).unsqueeze(0) for t in (q, k, v))

        def lengths(q, k, v, **kw):
            return attention_op.packed_lengths(q, k, v, cu, kw.get("mask"), kw.get("p", 0.0))
        assert lengths(q, k, v) == (35, 39)  # new families: exact
        assert lengths(q[:, :, :-1], k, v) == (40, 39)  # the queries' length changed
        assert lengths(q, k[:, :, :-2], v[:, :, :-2]) == (40, 40)  # then the keys'
        # never with a mask, dropout or without packed sequences
        assert lengths(q[:, :, :-3], k, v, mask=torch.zeros(32, 39)) == (32, 39)
        assert lengths(q[:, :, :-3], k, v, p=0.1) == (32, 39)
        assert attention_op.packed_lengths(q[:, :, :-3], k, v, None, None, 0.0) == (32, 39)
        check([11, 23, 4], [12, 30, 3], window_size=(3, 0), extra_rows=3)  # 41 x 45: 48 x 48
        shape_buckets.enabled = False
        assert lengths(q[:, :, :-2], k, v) == (33, 39)
    finally:
        shape_buckets.reset()
        shape_buckets.enabled = True


# --- the SDPA drop-in's extras -------------------------------------------------

def sdpa_reference(q, k, v, *, attn_mask=None, is_causal=False, window_size=(-1, -1),
                   softcap=0.0, sinks=None):
    """SDPA's math in float64 with a window (top-left), softcap and sinks."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    k, v = (t.repeat_interleave(group, -3) for t in (k, v))
    scores = (q @ k.mT) / math.sqrt(q.shape[-1])
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if attn_mask is not None:
        scores = scores + attn_mask.double()
    i = torch.arange(q.shape[-2])[:, None]
    j = torch.arange(k.shape[-2])
    seen = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)
    left, right = window_size
    if left >= 0:
        seen &= j >= i - left
    if right >= 0:
        seen &= j <= i + right
    if is_causal:
        seen &= j <= i
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        sink = sinks.double().reshape(-1, 1, 1).expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1] @ v
    empty = (scores == float("-inf")).all(-1, keepdim=True)
    return torch.softmax(scores.masked_fill(empty, 0), -1).masked_fill(empty, 0) @ v


SDPA_CASES = {
    "window_causal": dict(is_causal=True, window_size=(4, 7)),
    "window_both_sides_mask": dict(window_size=(3, 2), mask=True),
    "softcap": dict(softcap=2.5),
    "sinks_window": dict(window_size=(6, 0), sinks=True),
    "all_bf16": dict(is_causal=True, window_size=(5, -1), softcap=4.0, sinks=True, dtype=BF16),
}


@pytest.mark.parametrize("case", list(SDPA_CASES.values()), ids=list(SDPA_CASES))
def test_sdpa_drop_in_extras(case):
    case = dict(case)
    dtype = case.pop("dtype", F32)
    b, hq, hkv, l, s, e = 2, 4, 2, 23, 29, 16
    q, k, v = (torch.randn(shape).to(dtype).requires_grad_()
               for shape in ((b, hq, l, e), (b, hkv, s, e), (b, hkv, s, e)))
    if case.pop("mask", False):
        case["attn_mask"] = torch.randn(b, 1, l, s)
    if case.pop("sinks", False):
        case["sinks"] = torch.randn(hq).to(dtype).requires_grad_()
    out = torch_pallas.attention(q, k, v, enable_gqa=True, **case)
    leaves = [q, k, v] + ([case["sinks"]] if "sinks" in case else [])
    exact = [t.detach().double().requires_grad_() for t in leaves]
    kwargs = dict(case, sinks=exact[3]) if "sinks" in case else case
    ref = sdpa_reference(*exact[:3], **kwargs)
    tol = {F32: 2e-5, BF16: 3e-2}[dtype]
    torch.testing.assert_close(out.double(), ref.detach(), rtol=tol, atol=tol)
    grad = torch.randn(out.shape).to(dtype)
    for g, e in zip(torch.autograd.grad(out, leaves, grad),
                    torch.autograd.grad(ref, exact, grad.double())):
        torch.testing.assert_close(g.double(), e, rtol=tol, atol=tol * (e.abs().max().item() + 1))


def test_sdpa_without_extras_is_unchanged():
    q, k, v = (torch.randn(2, 3, 17, 8) for _ in range(3))
    plain = torch_pallas.attention(q, k, v, is_causal=True)
    spelled = torch_pallas.attention(q, k, v, is_causal=True, window_size=(-1, -1), softcap=0.0)
    assert torch.equal(plain, spelled)


# --- torch.compile ----------------------------------------------------------------

@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(dynamic):
    """A packed causal call under torch.compile(fullgraph=True), twice with
    other lengths: values and gradients as eager (cu_seq's check runs
    inside the op)."""

    def step(q, k, v, cu, max_len, sinks):
        out = torch_pallas.varlen_attention(q, k, v, cu, cu, max_len, max_len,
                                            window_size=(5, 0), enable_gqa=True, sinks=sinks)
        return out.square().sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    for lengths in ([7, 12], [9, 3, 8]):
        q, k, v, cu, _, sinks = packed(lengths, lengths, sinks=True)
        leaves = (q, k, v, sinks)
        grads = torch.autograd.grad(compiled(q, k, v, cu, max(lengths), sinks), leaves)
        expected = torch.autograd.grad(step(q, k, v, cu, max(lengths), sinks), leaves)
        for g, e in zip(grads, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cu_seq_q.*non-decreasing"):
        q, k, v, _, _, sinks = packed([6, 6], [6, 6], sinks=True)
        compiled(q, k, v, torch.tensor([0, 8, 6, 12], dtype=torch.int32), 8, sinks)


# --- bad arguments ------------------------------------------------------------------

def _args(**change):
    q, k, v, cu_q, cu_k, _ = packed([5, 4], [5, 4])
    args = dict(query=q, key=k, value=v, cu_seq_q=cu_q, cu_seq_k=cu_k, max_q=5, max_k=5,
                enable_gqa=True)
    args.update(change)
    return args


I32 = torch.int32
BAD = {
    "cu_seq_q decreasing": (dict(cu_seq_q=torch.tensor([0, 6, 5], dtype=I32)), ValueError,
                            "cu_seq_q"),
    "cu_seq_k not from 0": (dict(cu_seq_k=torch.tensor([1, 5, 9], dtype=I32)), ValueError,
                            "cu_seq_k"),
    "cu_seq_k past the keys": (dict(cu_seq_k=torch.tensor([0, 5, 12], dtype=I32)), ValueError,
                               "cu_seq_k"),
    "a sequence beyond max_q": (dict(max_q=4), ValueError, "max_q"),
    "a sequence beyond max_k": (dict(max_k=3), ValueError, "max_k"),
    "cu_seq float": (dict(cu_seq_q=torch.tensor([0.0, 5.0, 9.0])), ValueError, "cu_seq_q"),
    "cu_seq lengths differ": (dict(cu_seq_k=torch.tensor([0, 9], dtype=I32)), ValueError,
                              "cu_seq"),
    "heads not divisible": (dict(key=torch.randn(9, 3, 16), value=torch.randn(9, 3, 16)),
                            ValueError, "heads"),
    "gqa not enabled": (dict(enable_gqa=False), ValueError, "enable_gqa"),
    "sinks shape": (dict(sinks=torch.randn(2)), ValueError, "sinks"),
    "sinks dtype": (dict(sinks=torch.randn(4).double()), TypeError, "sinks"),
    "window_size": (dict(window_size=(-2, 0)), ValueError, "window_size"),
    "softcap negative": (dict(softcap=-1.0), ValueError, "softcap"),
    "query 4-D": (dict(query=torch.randn(1, 9, 4, 16)), ValueError, "query"),
}


@pytest.mark.parametrize("case", list(BAD.values()), ids=list(BAD))
def test_bad_arguments_raise_naming_the_op_and_the_argument(case):
    change, error, argument = case
    with pytest.raises(error, match=rf"(?s)^pallas::varlen_attention: .*{argument}"):
        kwargs = _args(**change)
        positional = [kwargs.pop(n) for n in ("query", "key", "value", "cu_seq_q", "cu_seq_k",
                                              "max_q", "max_k")]
        torch_pallas.varlen_attention(*positional, **kwargs)


def test_sdpa_extras_refuse_bad_sinks_by_name():
    q = torch.randn(1, 4, 5, 8)
    with pytest.raises(ValueError, match="attention.*sinks"):
        torch_pallas.attention(q, q, q, sinks=torch.randn(3))
