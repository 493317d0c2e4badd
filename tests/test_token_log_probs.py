"""torch_pallas.token_log_probs (each token's log-probability at a
temperature and its distribution's entropy, fused with the LM head) against
TRL's formula on the logits in float64: values, and the gradients of input,
weight and bias for the log-probs alone, the entropy alone and a weighted
mix of both; temperatures 0.7 and 1.0, with and without bias and soft cap,
every dtype, ignored tokens, ragged tokens, hidden sizes and vocabularies
over several chunks; every CPU backend; bad arguments refused before any
kernel runs; torch.compile; the fake CUDA trace into the Triton kernels.
(opcheck and the registered examples on every backend: tests/test_opcheck.py;
the JAX form: tests/test_jax_forms.py.)"""

from __future__ import annotations

import pytest
import torch

import torch_pallas
from helpers import FLOAT_DTYPES, assert_within, simulators_exhaustive
from torch_pallas.base import dtypes
from torch_pallas.ops import linear_cross_entropy as lce_op
from torch_pallas.ops import token_log_probs as op

from test_linear_cross_entropy import inputs, small_chunks  # noqa: F401 (a fixture)


# The upstream gradients a loss gives (log-probs, entropy): a policy
# gradient's weights per token, an entropy bonus alone, both.
UPSTREAM = {
    "log_probs": lambda shape: (torch.randn(shape), torch.zeros(shape)),
    "entropy": lambda shape: (torch.zeros(shape), torch.randn(shape)),
    "mix": lambda shape: (torch.randn(shape), 0.1 * torch.randn(shape)),
}


def check(x, w, target, b, what, upstream=("log_probs", "entropy", "mix"), **kwargs):
    """Both outputs against float64; the gradients for each upstream
    within twice torch's own error in that dtype plus a few roundings."""
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]
    log_p, entropy = torch_pallas.token_log_probs(leaves[0], leaves[1], target, leaves[2],
                                                  return_entropy=True, **kwargs)
    theirs = op.torch_token_log_probs(*leaves[:2], target, leaves[2], return_entropy=True,
                                      **kwargs)
    temperature = kwargs.get("temperature", 1.0)
    for name, out, ref in zip(("log_probs", "entropy"), (log_p, entropy),
                              op.reference(x, w, target, b, **kwargs)):
        assert out.dtype == torch.float32 and out.shape == target.shape, f"{what} {name}"
        assert_within(out, ref, op.error_bound(x, w, ref, temperature), f"{what} {name}")
    wanted = [t for t in leaves if t is not None]
    rows, (vocab, hidden) = target.numel(), w.shape
    chunks = -(-rows // lce_op.chunk_rows(rows, hidden, vocab))
    for kind in upstream:
        grad_lp, grad_h = UPSTREAM[kind](target.shape)
        ours = torch.autograd.grad((log_p, entropy), wanted, (grad_lp, grad_h),
                                   retain_graph=True)
        torch_grads = torch.autograd.grad(theirs, wanted, (grad_lp, grad_h), retain_graph=True)
        grads64 = op.reference_gradients(grad_lp, grad_h, x, w, target, b, None, None,
                                         temperature=temperature, softcap=kwargs.get("softcap"))
        conditions = gradient_conditions(x, w, target, b, grad_lp, grad_h, kwargs)
        for name, g, t, g64, condition in zip(("input", "weight", "bias"), ours, torch_grads,
                                              grads64, conditions):
            assert g.dtype == t.dtype and g.shape == t.shape, f"{what} {kind} d{name}"
            roundings = 8 * (chunks if name == "weight" else 1)
            bound = (2 * (t.double() - g64).abs() + 1e-6
                     + roundings * dtypes.ROUNDING[x.dtype] * (condition + condition.mean()))
            assert_within(g, g64, bound, f"{what} {kind} d{name}")


def gradient_conditions(x, w, target, b, grad_lp, grad_h, kwargs):
    """|dz| @ |W|, |dz|^T @ |x| and the column sums of |dz| in float64 (the
    sizes of the sums the gradients are), each plus the same products of
    dz's change when the logits move by a rounding of the input's dtype
    (the op's products round them, in another order than torch's): for
    p = softmax(u), |d dz_j / d u_j| <= p_j (|a| + |b| (|E - u_j| + 2)) / T
    for upstream gradients a (log-probs) and b (entropy)."""
    temperature, softcap = kwargs.get("temperature", 1.0), kwargs.get("softcap")
    z = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    z = z.to(x.dtype).double().requires_grad_()
    (dz,) = torch.autograd.grad(op.of_logits(z, target, **kwargs), z,
                                (grad_lp.double(), grad_h.double()))
    with torch.no_grad():
        u = (z if softcap is None else softcap * torch.tanh(z / softcap)) / temperature
        p = torch.softmax(u, -1)
        mean = (p * u).sum(-1, keepdim=True)
        a, c = grad_lp.double().abs()[..., None], grad_h.double().abs()[..., None]
        moved = z.abs().amax(-1, keepdim=True) / temperature  # (the bound multiplies by a rounding)
        sensitivity = p * (a + c * ((mean - u).abs() + 2)) * moved / temperature
        sensitivity = torch.where((target == -100)[..., None], 0.0, sensitivity)
    dz = (dz.abs() + sensitivity).reshape(-1, w.shape[0])
    x64 = x.double().abs().reshape(-1, w.shape[1])
    return (dz @ w.double().abs()).reshape(x.shape), dz.T @ x64, dz.sum(0)


CASES = {
    "T1": {},
    "T0.7": {"temperature": 0.7},
    "T0.7-softcap": {"temperature": 0.7, "softcap": 2.5},
}


def _sweep():
    """float32 in every case, with and without bias, in the default run;
    the 16-bit dtypes in the last case with a bias there, every other
    combination with -m exhaustive."""
    for dtype in FLOAT_DTYPES:
        for case in CASES:
            for bias in (True, False):
                default = dtype == torch.float32 or (case == "T0.7-softcap" and bias)
                yield pytest.param(case, dtype, bias,
                                   marks=[] if default else [pytest.mark.exhaustive],
                                   id=f"{case}-{str(dtype).removeprefix('torch.')}-"
                                      f"{'bias' if bias else 'no_bias'}")


@pytest.mark.parametrize("case, dtype, bias", _sweep())
def test_values_and_gradients_match_float64(small_chunks, case, dtype, bias):
    x, w, target, b = inputs((3, 13), 40, 333, dtype, bias)
    check(x, w, target, b, f"{case} {dtype}", **CASES[case])


@pytest.mark.parametrize("leading, hidden, vocab, bias", [
    ((1,), 8, 3, True), ((37,), 24, 101, False), ((2, 5, 7), 33, 257, True)], ids=str)
def test_ragged_shapes(small_chunks, leading, hidden, vocab, bias):
    x, w, target, b = inputs(leading, hidden, vocab, torch.float32, bias, ignored=1)
    check(x, w, target, b, f"{leading} H={hidden} V={vocab}", upstream=("mix",),
          temperature=0.7)


def test_every_backend(cpu_backend, small_chunks):
    """A vocabulary past one block of every family (ragged), two chunks, a
    temperature and the soft cap, in bfloat16."""
    x, w, target, b = inputs((21,), 24, 300, torch.bfloat16)
    check(x, w, target, b, cpu_backend, upstream=("mix",), temperature=0.7, softcap=5.0)


@pytest.mark.parametrize("cpu_backend", simulators_exhaustive(), indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_backend_and_dtype(cpu_backend, dtype, small_chunks):
    x, w, target, b = inputs((21,), 24, 300, dtype)
    check(x, w, target, b, f"{cpu_backend} {dtype}", temperature=1.0)


def test_without_entropy_the_op_returns_log_probs_alone():
    """`return_entropy=False`: the function gives the log-probs (as TRL's
    `selective_log_softmax`), the torch op an empty entropy; its gradient
    is the log-probs' alone."""
    x, w, target, b = inputs((4, 6), 16, 50, torch.float32)
    x.requires_grad_()
    log_p = torch_pallas.token_log_probs(x, w, target, b, temperature=0.7)
    assert isinstance(log_p, torch.Tensor) and log_p.shape == target.shape
    both = torch.ops.pallas.token_log_probs(x, w, target, b, temperature=0.7)
    assert both[1].numel() == 0 and torch.equal(both[0], log_p)
    expected = op.torch_token_log_probs(x, w, target, b, temperature=0.7)
    grad = torch.randn(target.shape)
    (ours,) = torch.autograd.grad(log_p, x, grad)
    (theirs,) = torch.autograd.grad(expected, x, grad)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_ignored_tokens_give_zero_and_no_gradient():
    """Every token ignored (a prompt's, padding): both outputs 0, every
    gradient 0; a custom ignore_index that is a class elsewhere."""
    x, w, target, b = inputs((5,), 12, 40, torch.float32)
    leaves = [t.requires_grad_() for t in (x, w, b)]
    ignored = torch.full_like(target, -100)
    log_p, h = torch_pallas.token_log_probs(*leaves[:2], ignored, leaves[2],
                                            return_entropy=True)
    assert not log_p.any() and not h.any()
    grads = torch.autograd.grad((log_p.sum() + h.sum()), leaves)
    assert not any(g.any() for g in grads)
    target[(target == -100) | (target == 7)] = 3
    target[0] = 7
    log_p, h = torch_pallas.token_log_probs(x, w, target, b, ignore_index=7,
                                            return_entropy=True)
    assert log_p[0] == 0 and h[0] == 0 and (h[1:] > 0).all()


def test_gradients_wanted_for_some_leaves_only(small_chunks):
    x, w, target, b = inputs((19,), 16, 70, torch.float32)
    w.requires_grad_()
    log_p, h = torch_pallas.token_log_probs(x, w, target, b, return_entropy=True)
    (d_w,) = torch.autograd.grad(log_p.sum() + h.sum(), w)
    expected = op.reference_gradients(torch.ones(19), torch.ones(19), x, w, target, b, None,
                                      None)[1]
    assert_within(d_w, expected, 1e-4 * (expected.abs() + 1), "d_weight alone")


def _bad(change):
    x, w, target, b = inputs((3, 4), 8, 20, torch.float32)
    args = {"input": x, "weight": w, "target": target, "bias": b}
    kwargs = {}
    change(args, kwargs)
    return lambda: torch_pallas.token_log_probs(args["input"], args["weight"], args["target"],
                                                args["bias"], **kwargs)


@pytest.mark.parametrize("change, error, match", [
    (lambda a, k: a["target"].view(-1).__setitem__(0, 20), IndexError, r"target holds 20"),
    (lambda a, k: a["target"].view(-1).__setitem__(0, -5), IndexError, r"target holds -5"),
    (lambda a, k: k.update(temperature=0.0), ValueError, r"temperature=0\.0"),
    (lambda a, k: k.update(temperature=-1.0), ValueError, r"temperature=-1\.0"),
    (lambda a, k: k.update(temperature=float("inf")), ValueError, r"temperature=inf"),
    (lambda a, k: k.update(temperature=float("nan")), ValueError, r"temperature=nan"),
    (lambda a, k: a.update(target=a["target"][:, :3]), RuntimeError, r"target\.shape"),
    (lambda a, k: a.update(weight=a["weight"][:, :7]), RuntimeError, r"weight\.shape"),
    (lambda a, k: a.update(bias=a["bias"][:5]), RuntimeError, r"bias\.shape"),
    (lambda a, k: a.update(input=a["input"].long()), TypeError, r"input"),
    (lambda a, k: a.update(weight=a["weight"].double()), TypeError, r"weight"),
    (lambda a, k: a.update(weight=a["weight"].half()), TypeError, r"weight"),
    (lambda a, k: a.update(target=a["target"].float()), TypeError, r"target"),
    (lambda a, k: k.update(softcap=0.0), ValueError, r"softcap=0\.0"),
], ids=["target-past-vocab", "target-negative", "T0", "T-negative", "T-inf", "T-nan",
        "target-shape", "hidden", "bias-shape", "integer-input", "float64-weight",
        "mixed-floats", "float-target", "softcap"])
def test_bad_arguments_are_refused_naming_them(change, error, match, monkeypatch):
    from torch_pallas.runtime import launch

    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel ran before the arguments were checked")

    monkeypatch.setattr(launch, "run", no_kernel)
    with pytest.raises(error, match=match) as info:
        _bad(change)()
    assert "pallas::token_log_probs" in str(info.value)


def test_torch_compile_fullgraph_dynamic_matches_eager(small_chunks):
    """A GRPO-style loss (weighted log-probs plus an entropy bonus) under
    torch.compile(fullgraph=True, dynamic=True): two token counts, one
    graph, values and gradients as eager."""
    def loss(x, w, target, weights):
        log_p, h = torch_pallas.token_log_probs(x, w, target, temperature=0.7,
                                                return_entropy=True)
        return -(weights * log_p).sum() - 0.01 * h.sum()

    compiled = torch.compile(loss, fullgraph=True, dynamic=True, backend="aot_eager")
    for tokens in (19, 26):
        x, w, target, _ = inputs((tokens,), 16, 70, torch.float32)
        weights = torch.randn(tokens)
        leaves = [t.requires_grad_() for t in (x, w)]
        expected = loss(*leaves, target, weights)
        found = compiled(*leaves, target, weights)
        torch.testing.assert_close(found, expected)
        for g, e in zip(torch.autograd.grad(found, leaves), torch.autograd.grad(expected, leaves)):
            torch.testing.assert_close(g, e)


def test_torch_compile_on_cuda_traces_the_triton_kernels():
    """The public op and the backward op, on fake CUDA tensors, traced into
    the matmul and the token_log_probs kernels."""
    from helpers import fake_cuda_trace

    model = """
    class Model(torch.nn.Module):
        def forward(self, x, w, t, g):
            log_p, h, lse = torch.ops.pallas.token_log_probs_forward(x, w, t, None, -100, 0.7,
                                                                     30.0)
            return (log_p, h, *torch.ops.pallas.token_log_probs_backward(
                g, g, x, w, t, None, lse, h, -100, 0.7, 30.0, [True, True, False]))
    """
    inputs_ = """
    x = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1000, 64, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, 1000, (300,), device="cuda")
    inputs = (x, w, t, torch.randn(300, device="cuda"))
    """
    lines = fake_cuda_trace(model, inputs_)
    kernels = set(lines["KERNELS"].split())
    assert {"log_prob_kernel", "log_prob_gradient_kernel"} <= kernels, kernels
    assert any("matmul" in k for k in kernels), kernels
    assert lines["OPAQUE"] == "False"
