"""torch.ops.pallas.attention against torch's scaled_dot_product_attention:
PyTorch's own sample inputs on every CPU backend, forward and backward; the
semantics a PyTorch user relies on (shapes, broadcasting, GQA, masks, causal
alignment, empty rows, dtypes); bad input refused by name; autograd,
autocast and torch.compile. Each kernel family's own tests are in
test_attention_<family>.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import torch_pallas
from helpers import CPU_BACKENDS, assert_within, fake_cuda_trace
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
    own error in `dtype` plus a floor."""
    inputs = [a for a in (*args, kwargs.get("attn_mask")) if isinstance(a, torch.Tensor)]

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
        out_shape = attention_op.reference(*[a.detach() for a in args],
                                           **{k: (v.detach() if isinstance(v, torch.Tensor) else v)
                                              for k, v in kwargs.items()}).shape
        run.grad = torch.randn(out_shape, dtype=torch.float64)
    ref_out, ref_grads = run(lambda *a, **k: attention_op.reference(*a, **k), double)
    torch_out, torch_grads = run(F.scaled_dot_product_attention, lambda t: t)
    out, grads = run(torch_pallas.attention, lambda t: t)
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
                               run.grad if backward else None, dtype)
    assert_within(out, ref_out, 2 * (torch_out.double() - ref_out).abs() + floor(ref_out)
                  + terms.get("out", 0), f"{what}: output")
    names = [n for n, t in zip(("query", "key", "value", "attn_mask"), inputs) if t.requires_grad]
    for name, g, tg, rg in zip(names, grads, torch_grads, ref_grads):
        assert g.dtype == dict(zip(("query", "key", "value", "attn_mask"), inputs))[name].dtype
        roundings = 1 if dtype == torch.float32 else 3
        assert_within(g, rg, 2 * (tg.double() - rg).abs() + floor(rg, roundings)
                      + terms.get(name, 0), f"{what}: gradient of {name}")


def rounding_terms(q, k, v, kwargs, scale, grad, dtype) -> dict:
    """What rounding the probabilities P and the scores' gradient dS to a
    16-bit dtype before their products costs (the GPU kernels do, as
    FlashAttention does, to multiply on Tensor Cores), elementwise, in
    float64 from the inputs: |P| |V| for the output, scale |dS| |K| for dQ,
    scale |dS|ᵀ |Q| for dK and |P|ᵀ |dO| for dV, each summed over the heads
    and batches its input is shared by, times three roundings, twice over; and
    what the rounded output costs delta = rowsum(dO * O), which every
    score's gradient in the row inherits."""
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
    terms = {"out": rounding * (p @ v_full.abs())}
    if grad is None:
        return terms
    out = p @ v_full
    ds = (p * (grad @ v_full.mT - (grad * out).sum(-1, keepdim=True))).abs()
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
    terms["value"] = shared(rounding * (p.mT @ grad.abs()), v)
    return terms


@pytest.mark.parametrize("backend,dtype", BACKEND_DTYPES)
def test_torch_sample_inputs_forward_and_backward(backend, dtype):
    """Every sample PyTorch's own tests give scaled_dot_product_attention
    (3-D, 4-D and broadcast batches, causal, a float mask that requires
    grad): output and gradients; those with dropout are refused by name."""
    seen = set()
    with torch_pallas.backend(backend):
        for sample in torch_samples(dtype, requires_grad=True):
            args, kwargs = (sample.input, *sample.args), dict(sample.kwargs)
            if kwargs.get("dropout_p", 0.0) > 0:
                with pytest.raises(NotImplementedError, match=r"pallas::attention: dropout_p=0.5"):
                    torch_pallas.attention(*args, **kwargs)
                continue
            key = (tuple(tuple(a.shape) for a in args), kwargs.get("is_causal"),
                   kwargs.get("attn_mask") is not None)
            if key in seen:  # samples differing only in an unused flag
                continue
            seen.add(key)
            compare(args, kwargs, dtype, backward=True, what=f"{backend} {key}")
    assert len(seen) == 7


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
    q, k, v = (torch.randn(2, 2, n, 8) for n in (6, 9, 9))
    mask = torch.randn(6, 9)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    torch.testing.assert_close(torch_pallas.attention(q, k, v, mask, is_causal=True), expected)


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
    (lambda q, k, v: torch_pallas.attention(q, k, v, dropout_p=0.1), NotImplementedError,
     r"pallas::attention: dropout_p=0.1 is not supported"),
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
    q, k, v = (torch.randn(2, 4, n, 16, requires_grad=True) for n in (13, 21, 21))
    k2, v2 = k[:, :2].detach().requires_grad_(), v[:, :2].detach().requires_grad_()

    def loss(q, k, v):
        return torch_pallas.attention(q, k, v, is_causal=True, enable_gqa=True).square().sum()

    compiled = torch.compile(loss, fullgraph=True)
    got = torch.autograd.grad(compiled(q, k2, v2), (q, k2, v2))
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
        o, lse = torch.ops.pallas.attention_forward(q, k, v, None, 0.125, True)
        grads = torch.ops.pallas.attention_backward(q, k, v, o, grad, lse, None, 0.125, True)
        return (out, *grads)
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
    assert int(lines["WRAPPERS"]) >= 3
    assert lines["OPAQUE"] == "False"  # no call into JAX left in the graph
