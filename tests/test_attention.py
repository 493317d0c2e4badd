"""torch.ops.pallas.attention against torch's scaled_dot_product_attention:
PyTorch's own sample inputs on every CPU backend, forward and backward; the
semantics a PyTorch user relies on (shapes, broadcasting, GQA, masks, causal
alignment, empty rows, dtypes, dropout); bad input refused by name;
autograd, autocast and torch.compile. Dropout is checked against the float64
reference with the kernels' own mask (ops/attention.py, dropout_keep), and
statistically: the mask's keep rate and independence, and the output's mean
and variance over seeds against SDPA's own dropout. Each kernel family's own
tests are in test_attention_<family>.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import torch_pallas
from helpers import CPU_BACKENDS, assert_within, fake_cuda_trace, simulators_exhaustive
from torch_pallas.base import dtypes
from torch_pallas.runtime import backends
from torch_pallas.ops import attention as attention_op

ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# The Mosaic GPU kernels take 16-bit inputs only (float32 falls back to Triton on a GPU).
DTYPES_ON = {name: ((torch.bfloat16,) if name == "mosaic_gpu_interpret"
                    else (torch.float32, torch.bfloat16)) for name in CPU_BACKENDS}
# The simulators take minutes over torch's samples: run with -m exhaustive;
# the default run simulates the op's examples (opcheck,
# determinism, lowering) and each family's kernel tests its own cases.
BACKEND_DTYPES = [
    pytest.param(b, d, marks=[pytest.mark.exhaustive] if backends.get(b).simulated else [],
                 id=f"{b}-{str(d)[6:]}")
    for b in CPU_BACKENDS for d in DTYPES_ON[b]
]


def torch_samples(dtype, requires_grad):
    """PyTorch's OpInfo sample inputs for scaled_dot_product_attention."""
    from torch.testing._internal.common_methods_invocations import (
        sample_inputs_scaled_dot_product_attention)

    return list(sample_inputs_scaled_dot_product_attention(
        None, "cpu", dtype, requires_grad))


def compare(args, kwargs, dtype, *, backward: bool, what: str):
    """The op against torch's SDPA in float64 on these inputs: the output
    and, with `backward`, every input's gradient, each within twice torch's
    own error in `dtype` plus a floor. With dropout, the op draws its seed
    from the generator's present state, whose mask (dropout_keep) the
    reference and torch's own computation in `dtype` (SDPA's math, explicit)
    then use."""
    inputs = [a for a in (*args, kwargs.get("attn_mask")) if isinstance(a, torch.Tensor)]
    dropout_p = kwargs.get("dropout_p", 0.0)
    out_shape = attention_op.reference(
        *[a.detach() for a in args], **{n: (t.detach() if isinstance(t, torch.Tensor) else t)
                                        for n, t in kwargs.items() if n != "dropout_p"}).shape
    generator_state = torch.get_rng_state()
    keep = None
    if dropout_p > 0:
        seed = attention_op.dropout_seed("cpu")
        keep = attention_op.dropout_keep(seed, (*out_shape[:-1], args[1].shape[-2]), dropout_p)

    def pallas(*a, **k):
        torch.set_rng_state(generator_state)  # the op draws the seed dropout_keep was given
        return torch_pallas.attention(*a, **k)

    def in_dtype(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        """torch in `dtype`: its SDPA, or with dropout SDPA's math with `keep`."""
        if dropout_p == 0:
            return F.scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal,
                                                  scale=scale, enable_gqa=enable_gqa)
        mask = attention_op.reference_mask(attn_mask, is_causal, query.shape[-2], key.shape[-2])
        return attention_op.dropout_reference(query, key, value, mask, dropout_p, keep,
                                              scale=scale, enable_gqa=enable_gqa)

    def run(fn, cast):
        leaves = [cast(t).detach().requires_grad_(t.requires_grad) for t in inputs]
        new_args = leaves[:len(args)]
        new_kwargs = dict(kwargs)
        if kwargs.get("attn_mask") is not None:
            new_kwargs["attn_mask"] = leaves[len(args)]
        out = fn(*new_args, **new_kwargs)
        if not backward:
            return out.detach(), []
        grad = torch.ones_like(out) if not hasattr(run, "grad") else run.grad.to(out.dtype)
        grads = torch.autograd.grad(out, [l for l in leaves if l.requires_grad], grad)
        return out.detach(), list(grads)

    def double(t):
        return t.double() if t.is_floating_point() else t

    ref_out, ref_grads = (None, [])
    if backward:
        run.grad = torch.randn(out_shape, dtype=torch.float64)
    ref_out, ref_grads = run(lambda *a, **k: attention_op.reference(*a, **k, keep=keep), double)
    torch_out, torch_grads = run(in_dtype, lambda t: t)
    out, grads = run(pallas, lambda t: t)
    assert out.dtype == dtype

    def floor(ref, roundings=1):
        """The floor of a bound: ATOL of values of order 1 per rounding into
        `dtype` on the way (16-bit gradients: two more, of the probabilities
        before P @ V and of the output, both of which delta = rowsum(dO * O)
        inherits), and the float32 rounding of the scores, which
        the probabilities inherit relative to the scores' size (large with
        torch's sample inputs, uniform in [-9, 9])."""
        magnitude = max(1.0, ref.abs().max().item())
        return (ATOL[dtype] * roundings + 8 * 2.0**-24 * max(1.0, score_size)) * magnitude

    q, k = args[0].detach().double(), args[1].detach().double()
    scale = kwargs.get("scale") or 1 / math.sqrt(q.shape[-1])
    score_size = scale * q.shape[-1] * q.abs().max().item() * k.abs().max().item()
    terms = {}
    if dtype != torch.float32:
        terms = rounding_terms(*(t.detach().double() for t in args), kwargs, scale,
                               run.grad if backward else None, dtype, keep)
    assert_within(out, ref_out, 2 * (torch_out.double() - ref_out).abs() + floor(ref_out)
                  + terms.get("out", 0), f"{what}: output")
    names = [n for n, t in zip(("query", "key", "value", "attn_mask"), inputs) if t.requires_grad]
    for name, g, tg, rg in zip(names, grads, torch_grads, ref_grads):
        assert g.dtype == dict(zip(("query", "key", "value", "attn_mask"), inputs))[name].dtype
        roundings = 1 if dtype == torch.float32 else 3
        assert_within(g, rg, 2 * (tg.double() - rg).abs() + floor(rg, roundings)
                      + terms.get(name, 0), f"{what}: gradient of {name}")


def rounding_terms(q, k, v, kwargs, scale, grad, dtype, keep=None) -> dict:
    """What rounding the probabilities P and the scores' gradient dS to a
    16-bit dtype before their products costs (the GPU kernels do, as
    FlashAttention does, to multiply on Tensor Cores), elementwise, in
    float64 from the inputs: |P| |V| for the output, scale |dS| |K| for dQ,
    scale |dS|ᵀ |Q| for dK and |P|ᵀ |dO| for dV, each summed over the heads
    and batches its input is shared by, times three roundings, twice over; and
    what the rounded output costs delta = rowsum(dO * O), which every
    score's gradient in the row inherits. With dropout's `keep`, P Z in
    place of P where it multiplies (Z = keep / (1 - p))."""
    rounding = 2 * 3 * dtypes.ROUNDING[dtype]  # P or dS, and P once more inside dS
    heads = q.shape[-3] if q.dim() >= 3 else 1
    group = heads // k.shape[-3] if kwargs.get("enable_gqa") else 1
    k_full, v_full = (t.repeat_interleave(group, -3) for t in (k, v))
    mask = attention_op.reference_mask(kwargs.get("attn_mask"), kwargs.get("is_causal", False),
                                       q.shape[-2], k.shape[-2])
    scores = (q @ k_full.mT) * scale
    if mask is not None:
        scores = scores + mask
    p = torch.softmax(scores, -1).nan_to_num(0.0)
    z = 1.0 if keep is None else keep * attention_op.dropout_scale(kwargs["dropout_p"])
    terms = {"out": rounding * ((p * z) @ v_full.abs())}
    if grad is None:
        return terms
    out = (p * z) @ v_full
    ds = (p * (z * (grad @ v_full.mT) - (grad * out).sum(-1, keepdim=True))).abs()
    # delta = rowsum(dO * O) reads the rounded output: its error reaches
    # every score's gradient of the row.
    delta_error = (grad.abs() * (terms["out"] + rounding * out.abs())).sum(-1, keepdim=True)
    ds = ds + p * delta_error

    def shared(term, like):  # summed over the GQA group and broadcast batches
        if group > 1:
            term = term.unflatten(-3, (-1, group)).sum(-3)
        return term.sum_to_size(like.shape)

    terms["query"] = shared(rounding * scale * (ds @ k_full.abs()), q) if group == 1 else (
        (rounding * scale * (ds @ k_full.abs())).sum_to_size(q.shape))
    terms["key"] = shared(rounding * scale * (ds.mT @ q.abs()), k)
    terms["value"] = shared(rounding * ((p * z).mT @ grad.abs()), v)
    return terms


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES)
def test_torch_sample_inputs_forward_and_backward(backend, dtype):
    """Every sample PyTorch's own tests give scaled_dot_product_attention
    (3-D, 4-D and broadcast batches, causal, a float mask that requires
    grad) without dropout: output and gradients."""
    assert len(compare_samples(backend, dtype, dropout=False)) == 7


def compare_samples(backend, dtype, *, dropout: bool) -> set:
    """compare() on each distinct torch sample with (or without) dropout;
    returns their keys."""
    seen = set()
    with torch_pallas.backend(backend):
        for sample in torch_samples(dtype, requires_grad=True):
            args, kwargs = (sample.input, *sample.args), dict(sample.kwargs)
            if (kwargs.get("dropout_p", 0.0) > 0) != dropout:
                continue
            key = (tuple(tuple(a.shape) for a in args), kwargs.get("is_causal"),
                   kwargs.get("attn_mask") is not None)
            if key in seen:  # samples differing only in an unused flag
                continue
            seen.add(key)
            compare(args, kwargs, dtype, backward=True, what=f"{backend} {key}")
    return seen


@pytest.mark.exhaustive
@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES)
def test_torch_sample_inputs_with_dropout(backend, dtype):
    """PyTorch's samples with dropout_p = 0.5 (3-D, 4-D, broadcast batches,
    causal): output and gradients against the reference with the kernels'
    mask (the default run checks such calls in test_dropout_*)."""
    assert len(compare_samples(backend, dtype, dropout=True)) == 6


SHAPES = [
    # (q, k, v, kwargs): what a user passes
    ((2, 3, 37, 16), (2, 3, 45, 16), (2, 3, 45, 16), {}),  # ragged, L != S
    ((2, 3, 45, 16), (2, 3, 37, 16), (2, 3, 37, 16), {"is_causal": True}),  # L > S causal
    ((2, 3, 9, 16), (2, 3, 30, 16), (2, 3, 30, 16), {"is_causal": True}),  # L < S: top-left
    ((3, 1, 16), (3, 40, 16), (3, 40, 24), {"is_causal": True}),  # decode, 3-D, Ev != E
    ((7, 8), (5, 8), (5, 8), {}),  # 2-D
    ((2, 1, 13, 8), (2, 1, 1, 8), (2, 1, 1, 8), {}),  # one key
    ((4, 3, 6, 8), (4, 1, 11, 8), (4, 1, 11, 8), {}),  # one kv head broadcast (MQA, in place)
    ((1, 6, 9, 8), (2, 2, 11, 8), (2, 2, 11, 8), {"enable_gqa": True}),  # GQA + batch broadcast
    ((2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), {"scale": 0.3}),
    ((1, 2, 19, 256), (1, 2, 23, 256), (1, 2, 23, 256), {}),  # the largest head dim
]


@pytest.mark.parametrize("q_shape,k_shape,v_shape,kwargs", SHAPES,
                         ids=[f"{q}x{k}-{'-'.join(kw) or 'plain'}" for q, k, _, kw in SHAPES])
def test_shapes_and_semantics(q_shape, k_shape, v_shape, kwargs):
    """On the default CPU backend, float32, forward and backward."""
    q, k, v = (torch.randn(s, requires_grad=True) for s in (q_shape, k_shape, v_shape))
    compare((q, k, v), kwargs, torch.float32, backward=True, what=str(q_shape))


MASKS = {
    "bool padding (B, 1, 1, S)": lambda b, h, l, s: torch.rand(b, 1, 1, s) > 0.3,
    "bool per head (H, L, S)": lambda b, h, l, s: torch.rand(h, l, s) > 0.5,
    "float (L, S)": lambda b, h, l, s: torch.randn(l, s),
    "float per batch (B, 1, L, S) with -inf": lambda b, h, l, s: torch.randn(b, 1, l, s).masked_fill(
        torch.rand(b, 1, l, s) < 0.3, float("-inf")),
    "bool, some rows see nothing": lambda b, h, l, s: (torch.rand(b, h, l, s) > 0.5).index_fill(
        2, torch.tensor([0, 4]), False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("make_mask", MASKS.values(), ids=MASKS.keys())
def test_masks(make_mask, dtype):
    b, h, l, s = 2, 3, 11, 17
    q, k, v = (torch.randn(b, h, n, 16).to(dtype).requires_grad_() for n in (l, s, s))
    mask = make_mask(b, h, l, s)
    mask = mask if mask.dtype == torch.bool else mask.to(dtype)
    compare((q, k, v), {"attn_mask": mask}, dtype, backward=True, what="mask")


def test_rows_that_see_nothing_are_zero_with_zero_gradients():
    q, k, v = (torch.randn(1, 2, n, 8, requires_grad=True) for n in (5, 6, 6))
    mask = torch.ones(5, 6, dtype=torch.bool)
    mask[2] = False
    out = torch_pallas.attention(q, k, v, attn_mask=mask)
    assert (out[:, :, 2] == 0).all() and out.isfinite().all()
    out.sum().backward()
    assert (q.grad[:, :, 2] == 0).all() and q.grad.isfinite().all()
    assert k.grad.isfinite().all() and v.grad.isfinite().all()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, expected)


def test_mask_and_causal_both_apply_as_on_torchs_cpu_kernel():
    """As torch 2.13's CPU kernel applies them: the mask, and the causal rule
    top-left (query i sees keys j <= i). torch 2.14's SDPA refuses the pair."""
    q, k, v = (torch.randn(2, 2, n, 8) for n in (6, 9, 9))
    mask = torch.randn(6, 9)
    out = torch_pallas.attention(q, k, v, mask, is_causal=True)
    causal = torch.ones(6, 9, dtype=torch.bool).tril()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.masked_fill(~causal, float("-inf"))))
    try:
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    except RuntimeError as e:  # torch 2.14 on
        assert "attn_mask should not be set when is_causal=True" in str(e)
        return
    torch.testing.assert_close(out, expected)


def test_float32_mask_with_a_16_bit_query():
    q, k, v = (torch.randn(2, 2, n, 8, dtype=torch.bfloat16, requires_grad=True) for n in (6, 9, 9))
    mask = torch.randn(2, 1, 6, 9)
    compare((q, k, v), {"attn_mask": mask}, torch.bfloat16, backward=True, what="f32 mask")


def test_a_learned_mask_gets_its_gradient():
    q, k, v = (torch.randn(2, 2, n, 8, requires_grad=True) for n in (6, 9, 9))
    bias = torch.randn(2, 1, 6, 9, requires_grad=True)
    compare((q, k, v), {"attn_mask": bias, "is_causal": False}, torch.float32, backward=True,
            what="learned bias")


def test_empty_inputs():
    q, k, v = torch.randn(2, 0, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 4)
    assert torch_pallas.attention(q, k, v).shape == (2, 0, 4)
    # No keys: every row sees nothing (0), as torch gives.
    q, k, v = torch.randn(2, 3, 8), torch.randn(2, 0, 8), torch.randn(2, 0, 4)
    out = torch_pallas.attention(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


ERRORS = [
    (lambda q, k, v: torch_pallas.attention(q, k, v, dropout_p=1.5), ValueError,
     r"pallas::attention: dropout_p must be a float in \[0, 1\], got 1.5"),
    (lambda q, k, v: torch_pallas.attention(q, k, v, dropout_p=-0.1), ValueError,
     r"pallas::attention: dropout_p must be a float in \[0, 1\], got -0.1"),
    (lambda q, k, v: torch_pallas.attention(q, k.double(), v), TypeError,
     r"pallas::attention: query and key must have the same dtype"),
    (lambda q, k, v: torch_pallas.attention(q.int(), k.int(), v.int()), TypeError,
     r"pallas::attention: query has dtype torch.int32"),
    (lambda q, k, v: torch_pallas.attention(q, k, v, attn_mask=torch.zeros(4, 6, dtype=torch.int32)),
     TypeError, r"pallas::attention: attn_mask has dtype torch.int32"),
    (lambda q, k, v: torch_pallas.attention(q, k, v, attn_mask=torch.zeros(5, 6)),
     RuntimeError, r"pallas::attention: attn_mask.shape=\(5, 6\) does not broadcast"),
    (lambda q, k, v: torch_pallas.attention(q, k[..., :4], v), RuntimeError,
     r"pallas::attention: query and key must have the same head dimension"),
    (lambda q, k, v: torch_pallas.attention(q, k, v[:, :, :5]), RuntimeError,
     r"pallas::attention: key and value must have the same length"),
    (lambda q, k, v: torch_pallas.attention(q, k[:, :2], v[:, :2], enable_gqa=True), RuntimeError,
     r"pallas::attention: with enable_gqa the query's heads must be a multiple"),
    (lambda q, k, v: torch_pallas.attention(q, k[:, :2], v[:, :2]), RuntimeError,
     r"pallas::attention: the batch dimensions .* do not broadcast"),
    (lambda q, k, v: torch_pallas.attention(*(torch.randn(1, 2, 3, 257) for _ in range(3))),
     ValueError, r"pallas::attention: head dimension query.shape\[-1\]=257"),
    (lambda q, k, v: torch_pallas.attention(q[0, 0, 0], k, v), RuntimeError,
     r"pallas::attention: query must have at least 2 dimensions"),
]


@pytest.mark.parametrize("call,error,message", ERRORS, ids=[m.split(": ")[1][:40] for _, _, m in ERRORS])
def test_bad_input_is_refused_by_name(call, error, message):
    q, k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 8)
    with pytest.raises(error, match=message):
        call(q, k, v)


def test_forward_mode_ad_raises_by_name():
    import torch.autograd.forward_ad as fwAD

    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.randn_like(q))
        with pytest.raises(RuntimeError, match="pallas::attention_forward: forward-mode AD"):
            torch_pallas.attention(dual, k, v)


def test_autocast_runs_in_the_autocast_dtype_like_torch():
    q, k, v = (torch.randn(2, 2, n, 16) for n in (7, 9, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch_pallas.attention(q, k, v, is_causal=True)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_torch_compile_fullgraph_forward_and_backward():
    """fullgraph (no graph break) with dynamic shapes, with and without
    dropout in one graph: the dropout's seed is one more random op of the
    graph; with Inductor drawing it from torch's generator
    (fallback_random), forward and gradients equal eager's under the same
    torch.manual_seed."""
    from torch._inductor import config as inductor_config

    q, k, v = (torch.randn(2, 4, n, 16, requires_grad=True) for n in (13, 21, 21))
    k2, v2 = k[:, :2].detach().requires_grad_(), v[:, :2].detach().requires_grad_()

    def loss(q, k, v):
        out = torch_pallas.attention(q, k, v, is_causal=True, enable_gqa=True)
        dropped = torch_pallas.attention(q, k, v, dropout_p=0.3, enable_gqa=True)
        return out.square().sum() + (dropped * out).sum()

    with inductor_config.patch(fallback_random=True):
        compiled = torch.compile(loss, fullgraph=True, dynamic=True)
        torch.manual_seed(11)
        got = torch.autograd.grad(compiled(q, k2, v2), (q, k2, v2))
    torch.manual_seed(11)
    expected = torch.autograd.grad(loss(q, k2, v2), (q, k2, v2))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)


def test_nn_functional_is_a_drop_in():
    from torch_pallas.nn import functional

    q, k, v = (torch.randn(2, 4, n, 16) for n in (13, 21, 21))
    torch.testing.assert_close(
        functional.scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=0.2),
        F.scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=0.2))


# The graph traced on fake CUDA tensors must call the Triton kernels, not JAX.
TRACED_MODEL = """
class Model(torch.nn.Module):
    def forward(self, q, k, v, mask, grad):
        out = torch.ops.pallas.attention(q, k, v, mask, enable_gqa=True)
        dropped = torch.ops.pallas.attention(q, k, v, None, 0.1, True, enable_gqa=True)
        o, lse = torch.ops.pallas.attention_forward(q, k, v, None, 0.125, True)
        grads = torch.ops.pallas.attention_backward(q, k, v, o, grad, lse, None, 0.125, True)
        return (out, dropped, *grads)
"""
TRACED_INPUTS = """
q = torch.randn(2, 4, 100, 64, device="cuda", dtype=torch.bfloat16)
k = torch.randn(2, 2, 130, 64, device="cuda", dtype=torch.bfloat16)
v = torch.randn(2, 2, 130, 64, device="cuda", dtype=torch.bfloat16)
mask = torch.rand(2, 1, 1, 130, device="cuda") > 0.5
grad = torch.randn(2, 4, 100, 64, device="cuda", dtype=torch.bfloat16)
inputs = (q, k, v, mask, grad)
"""


def test_tracing_on_cuda_tensors_reaches_the_triton_kernels():
    lines = fake_cuda_trace(TRACED_MODEL, TRACED_INPUTS)
    assert len(lines["KERNELS"].split()) >= 3, lines["KERNELS"]  # forward, backward's
    assert int(lines["WRAPPERS"]) >= 5  # two forwards (one dropping), three backward launches
    assert lines["OPAQUE"] == "False"  # no call into JAX left in the graph


# --- dropout ----------------------------------------------------------------

DROPOUT_CASES = {  # (q, k, v shapes, keywords; attn_mask: how to make it, dtype)
    "gqa-causal-ragged-bf16": (((2, 4, 37, 16), (2, 2, 45, 16), (2, 2, 45, 24)),
                               {"is_causal": True, "enable_gqa": True, "dropout_p": 0.3},
                               torch.bfloat16),
    "bool-padding-mask": (((2, 3, 11, 16), (2, 3, 17, 16), (2, 3, 17, 16)),
                          {"attn_mask": "padding", "dropout_p": 0.5}, torch.float32),
    "3d-learned-bias-causal": (((3, 13, 8), (3, 21, 8), (3, 21, 8)),
                               {"attn_mask": "bias", "is_causal": True, "dropout_p": 0.2},
                               torch.float32),
}
MASK_MAKERS = {
    "padding": lambda q, k: torch.rand(q.shape[0], 1, 1, k.shape[-2]) > 0.3,
    "bias": lambda q, k: torch.randn(q.shape[-2], k.shape[-2], requires_grad=True),
}


@pytest.mark.parametrize("backend,case", [
    pytest.param(b, c, marks=[pytest.mark.exhaustive] if (
        backends.get(b).simulated or (b == "triton" and "bias" in name)) else [],
        id=f"{b}-{name}")
    for b in CPU_BACKENDS for name, c in DROPOUT_CASES.items()])
def test_dropout_matches_float64_with_the_kernels_mask(backend, case):
    """Output and gradients of q, k, v (and of a learned bias) against the
    float64 reference that drops what dropout_keep says the kernels drop.
    (The simulators' default-run dropout cases are in
    test_attention_<family>.py, on the same reference; the bias's gradient
    is torch's, the same on every backend.)"""
    shapes, kwargs, dtype = case
    dtype = dtype if dtype in DTYPES_ON[backend] else torch.bfloat16
    q, k, v = (torch.randn(s).to(dtype).requires_grad_() for s in shapes)
    kwargs = dict(kwargs)
    if "attn_mask" in kwargs:
        kwargs["attn_mask"] = MASK_MAKERS[kwargs["attn_mask"]](q, k)
    with torch_pallas.backend(backend):
        compare((q, k, v), kwargs, dtype, backward=True, what=f"{backend} dropout")


@pytest.mark.parametrize("backend", simulators_exhaustive())
def test_every_backend_drops_what_dropout_keep_says(backend):
    """Same seed, same mask, on every backend: with q = 0 every probability
    is 1 / S, and with v the identity out[i, j] = Z_ij / S, so the output
    shows the kernels' mask itself."""
    b, h, l, s = 2, 2, 19, 40
    q = torch.zeros(b, h, l, 8, dtype=torch.bfloat16)
    k = torch.randn(b, h, s, 8, dtype=torch.bfloat16)
    v = torch.eye(s, dtype=torch.bfloat16).expand(b, h, s, s)
    torch.manual_seed(7)
    seed = attention_op.dropout_seed("cpu")
    torch.manual_seed(7)
    with torch_pallas.backend(backend):
        out = torch_pallas.attention(q, k, v, dropout_p=0.5)
    keep = attention_op.dropout_keep(seed, (b, h, l, s), 0.5)
    assert torch.equal(out != 0, keep), f"{backend}: {int((out != 0).ne(keep).sum())} differ"
    assert torch.equal(out[keep], torch.full_like(out[keep], 2 / s))


def test_dropout_is_reproducible_under_manual_seed():
    """torch.manual_seed gives the same output and gradients; another seed,
    or the generator's next state, another mask; dropout_p = 0 draws
    nothing from the generator."""
    q, k, v = (torch.randn(2, 3, n, 16, requires_grad=True) for n in (21, 30, 30))

    def run(seed=None):
        if seed is not None:
            torch.manual_seed(seed)
        out = torch_pallas.attention(q, k, v, dropout_p=0.4, is_causal=True)
        return (out, *torch.autograd.grad(out.square().sum(), (q, k, v)))

    first, again, later = run(3), run(3), run()  # `later`: the generator moved on
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], later[0])
    torch.manual_seed(4)
    assert not torch.equal(first[0], torch_pallas.attention(q, k, v, dropout_p=0.4,
                                                            is_causal=True))
    state = torch.get_rng_state()
    torch_pallas.attention(q, k, v, dropout_p=0.0)
    assert torch.equal(torch.get_rng_state(), state)


def _pair_bound(q: float, pairs: int) -> float:
    """Six standard deviations of the mean of `pairs` products x_i x_j of
    independent Bernoulli(q) bits, neighbouring pairs sharing a bit."""
    q2 = q * q
    return 6 * math.sqrt((q2 - q2 * q2 + 2 * (q**3 - q**4)) / pairs)


@pytest.mark.parametrize("dropout_p", [0.1, 0.5, 0.9])
def test_keep_mask_rate_and_independence(dropout_p):
    """The keep mask's rate is 1 - p, and its bits are independent of their
    neighbours along keys, queries, heads, batches and seeds (the joint
    rate of each pair (1 - p)², within six standard deviations)."""
    shape = (2, 8, 128, 128)
    keep = attention_op.dropout_keep(attention_op.dropout_seed("cpu"), shape, dropout_p)
    other = attention_op.dropout_keep(attention_op.dropout_seed("cpu"), shape, dropout_p)
    q = 1 - dropout_p
    rate = keep.double().mean().item()
    assert abs(rate - q) <= 6 * math.sqrt(q * dropout_p / keep.numel()), rate
    keep = keep.double()
    neighbours = {"keys": (keep[..., 1:], keep[..., :-1]),
                  "queries": (keep[..., 1:, :], keep[..., :-1, :]),
                  "heads": (keep[:, 1:], keep[:, :-1]), "batches": (keep[1:], keep[:-1]),
                  "seeds": (keep, other.double())}
    for name, (a, b) in neighbours.items():
        joint = (a * b).mean().item()
        assert abs(joint - q * q) <= _pair_bound(q, a.numel()), (name, joint, q * q)


def test_dropout_one_gives_zeros_and_none_keeps_everything():
    q, k, v = (torch.randn(2, 2, n, 8, requires_grad=True) for n in (5, 7, 7))
    out = torch_pallas.attention(q, k, v, dropout_p=1.0)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, dropout_p=1.0))
    for g in torch.autograd.grad(out.sum(), (q, k, v)):
        assert torch.equal(g, torch.zeros_like(g))
    seed = attention_op.dropout_seed("cpu")
    assert attention_op.dropout_keep(seed, (2, 3, 64, 64), 1e-9).all()
    assert not attention_op.dropout_keep(seed, (2, 3, 64, 64), 1.0).any()


def test_dropout_statistics_match_sdpas():
    """Over many seeds, every output element's mean and variance match the
    exact ones, E = P v and Var = p / (1 - p) · P² v² (P the softmax), within
    six standard errors of each estimate (the variance's from the fourth
    moment of a sum of independent scaled Bernoulli terms), for the op and
    for torch's own SDPA alike: the same distribution, not the same bits."""
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 4)
    p, n = 0.4, 200
    probs = torch.softmax(q.double() @ k.double().mT / math.sqrt(8), -1)
    a = probs.unsqueeze(-1) * v.double().unsqueeze(-3)  # (.., L, S, Ev): P_ik v_kj
    w2 = p / (1 - p)  # E[(Z - 1)^2]
    w4 = p * (p**3 + (1 - p) ** 3) / (1 - p) ** 3  # E[(Z - 1)^4]
    mean = a.sum(-2)
    var = w2 * a.square().sum(-2)
    mu4 = (w4 - 3 * w2 * w2) * a.pow(4).sum(-2) + 3 * var.square()
    var_error = ((mu4 - var.square() * (n - 3) / (n - 1)) / n).sqrt()
    for name, fn in (("pallas", torch_pallas.attention),
                     ("sdpa", F.scaled_dot_product_attention)):
        samples = torch.stack([fn(q, k, v, dropout_p=p) for _ in range(n)]).double()
        assert_within(samples.mean(0), mean, 6 * (var / n).sqrt() + 1e-6, f"{name}: mean")
        assert_within(samples.var(0), var, 6 * var_error + 1e-6, f"{name}: variance")


def test_the_internal_ops_refuse_dropout_without_a_seed_by_name():
    q, k, v = (torch.randn(1, 2, n, 8) for n in (5, 6, 6))
    seed = attention_op.dropout_seed("cpu")
    for call, message in (
            (lambda: torch.ops.pallas.attention_forward(q, k, v, None, 0.3, False, 0.2),
             r"pallas::attention_forward: dropout_p=0.2 needs a one-element integer seed"),
            (lambda: torch.ops.pallas.attention_forward(q, k, v, None, 0.3, False, 0.2,
                                                         seed.double()),
             r"needs a one-element integer seed .*got \(torch.float64, \(\)\)"),
            (lambda: torch.ops.pallas.attention_forward(q, k, v, None, 0.3, False, 1.5, seed),
             r"pallas::attention_forward: dropout_p must be in \[0, 1\], got 1.5"),
            (lambda: torch.ops.pallas.attention_backward(q, k, v, q, q, q[..., 0], None, 0.3,
                                                          False, 0.2),
             r"pallas::attention_backward: dropout_p=0.2 needs a one-element integer seed")):
        with pytest.raises(ValueError, match=message):
            call()
