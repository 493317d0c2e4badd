"""torch_pallas.linear_cross_entropy against F.cross_entropy(F.linear(...))
in float64: the loss and the gradients of input, weight and bias, every
dtype, every reduction, ignore_index present, absent and a real class,
label smoothing, the soft cap, ragged rows, hidden sizes and vocabularies
over several chunks; every CPU backend; PyTorch's own OpInfo samples of
nn.functional.cross_entropy for the loss part; every row ignored; bad
arguments and targets refused before any kernel runs; the fake CUDA trace;
peak memory bounded as tokens grow. (opcheck, compile on model layouts and
the backends' fakes: tests/test_opcheck.py and tests/test_layouts.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import torch_pallas
from helpers import FLOAT_DTYPES, assert_within, simulators_exhaustive
from torch_pallas.base import dtypes
from torch_pallas.ops import linear_cross_entropy as lce_op

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few rows, so that small inputs span several (the last
    one ragged)."""
    monkeypatch.setattr(lce_op, "MIN_CHUNK_ROWS", 8)


def inputs(leading, hidden, vocab, dtype, bias=True, ignored=2):
    x = (torch.randn(*leading, hidden) * hidden**-0.5 * 3).to(dtype)
    w = torch.randn(vocab, hidden).to(dtype)
    b = torch.randn(vocab).to(dtype) if bias else None
    target = torch.randint(0, vocab, leading)
    # some rows ignored, never all (test_every_row_ignored_gives_what_torch_gives)
    target.view(-1)[torch.randperm(target.numel())[:min(ignored, target.numel() - 1)]] = -100
    return x, w, target, b


def check(x, w, target, b, what, **kwargs):
    """The loss and every gradient against float64, the gradients within
    twice torch's own error in that dtype plus a few roundings."""
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]
    out = torch_pallas.linear_cross_entropy(leaves[0], leaves[1], target, leaves[2], **kwargs)
    expected = lce_op.torch_linear_cross_entropy(*leaves[:2], target, leaves[2], **kwargs)
    assert out.dtype == torch.float32 and out.shape == expected.shape, what
    ref = lce_op.reference(x, w, target, b, **kwargs)
    assert_within(out, ref, lce_op.error_bound(x, w, ref), what)

    grad = torch.randn(out.shape)
    wanted = [t for t in leaves if t is not None]
    ours = torch.autograd.grad(out, wanted, grad)
    theirs = torch.autograd.grad(expected, wanted, grad)
    grads64 = lce_op.reference_gradients(grad, x, w, target, b, None,
                                         kwargs.get("ignore_index", -100),
                                         kwargs.get("reduction", "mean"),
                                         kwargs.get("label_smoothing", 0.0), kwargs.get("softcap"))
    rows, (vocab, hidden) = target.numel(), w.shape
    chunks = -(-rows // lce_op.chunk_rows(rows, hidden, vocab))
    conditions = gradient_conditions(x, w, target, b, grad, kwargs)
    for name, g, t, g64, condition in zip(("input", "weight", "bias"), ours, theirs, grads64,
                                          conditions):
        assert g.dtype == t.dtype and g.shape == t.shape, f"{what} d{name}"
        # Each logit's gradient is rounded to the dtype before the products
        # (as torch's are): errors of a rounding times the sum of the
        # products' magnitudes; d_weight adds one product per chunk, each
        # rounded.
        roundings = 8 * (chunks if name == "weight" else 1)
        bound = (2 * (t.double() - g64).abs() + 1e-6
                 + roundings * dtypes.ROUNDING[x.dtype] * (condition + condition.mean()))
        assert_within(g, g64, bound, f"{what} d{name}")


def gradient_conditions(x, w, target, b, grad, kwargs):
    """|dL/dz| @ |W|, |dL/dz|^T @ |x| and the column sums of |dL/dz| in
    float64: the sizes of the sums the gradients are."""
    z = F.linear(x.double(), w.double(), None if b is None else b.double())
    z = z.to(x.dtype).double().requires_grad_()
    (dz,) = torch.autograd.grad(lce_op.loss_of_logits(z, target, **kwargs), z, grad.double())
    dz = dz.abs().reshape(-1, w.shape[0])
    x64 = x.double().abs().reshape(-1, w.shape[1])
    return (dz @ w.double().abs()).reshape(x.shape), dz.T @ x64, dz.sum(0)


CASES = {
    "mean": {},
    "sum-smoothing": {"reduction": "sum", "label_smoothing": 0.1},
    "none-softcap": {"reduction": "none", "softcap": 2.5},
    "mean-all": {"label_smoothing": 0.05, "softcap": 30.0},
}


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_values_and_gradients_match_float64(small_chunks, case, dtype):
    x, w, target, b = inputs((3, 13), 40, 333, dtype)
    check(x, w, target, b, f"{case} {dtype}", **CASES[case])


@pytest.mark.parametrize("leading, hidden, vocab, bias", [
    ((1,), 8, 3, True), ((37,), 24, 101, False), ((2, 5, 7), 33, 257, True)], ids=str)
def test_ragged_shapes(small_chunks, leading, hidden, vocab, bias):
    x, w, target, b = inputs(leading, hidden, vocab, torch.float32, bias, ignored=1)
    for reduction in ("mean", "none"):
        check(x, w, target, b, f"{leading} H={hidden} V={vocab} {reduction}",
              reduction=reduction)


def test_every_backend(cpu_backend):
    """A vocabulary past one block of every family (ragged), label
    smoothing and the soft cap, in bfloat16 (one chunk: the chunks are the
    op's, the same on every backend)."""
    x, w, target, b = inputs((21,), 24, 300, torch.bfloat16)
    check(x, w, target, b, f"{cpu_backend}", label_smoothing=0.1, softcap=5.0)


@pytest.mark.parametrize("cpu_backend", simulators_exhaustive(), indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_backend_and_dtype(cpu_backend, dtype, small_chunks):
    x, w, target, b = inputs((21,), 24, 300, dtype)
    check(x, w, target, b, f"{cpu_backend} {dtype}", label_smoothing=0.1, softcap=5.0)
    check(x, w, target, None, f"{cpu_backend} {dtype} none", reduction="none")


@pytest.mark.parametrize("dtype, softcap, bias", [
    (torch.float32, None, True), (torch.bfloat16, 2.5, False)], ids=str)
def test_rows_log_sum_exp_and_its_gradients_match_float64(small_chunks, dtype, softcap, bias):
    """pallas::linear_logsumexp, each row's log-sum-exp of its logits (what
    each rank of a vocabulary-split weight computes): ragged rows and
    vocabulary, chunked, against float64."""
    check_rows_log_sum_exp(inputs((37,), 24, 101, dtype, bias), softcap)


def test_rows_log_sum_exp_on_every_backend(cpu_backend):
    """Its target that matches no column (not an ignored row) on every
    kernel family: a ragged vocabulary past one block, in bfloat16."""
    check_rows_log_sum_exp(inputs((9,), 16, 150, torch.bfloat16), 4.0)


def check_rows_log_sum_exp(made, softcap):
    x, w, _, b = made
    dtype = x.dtype
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, w, b)]
    lse = torch.ops.pallas.linear_logsumexp(*leaves, softcap)
    grad = torch.randn(lse.shape)
    ours = torch.autograd.grad(lse, [t for t in leaves if t is not None], grad)
    leaves64 = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w, b)]
    z = F.linear(*leaves64).to(dtype).double()  # rounded as F.linear rounds
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    expected = torch.logsumexp(z, -1)
    theirs = torch.autograd.grad(expected, [t for t in leaves64 if t is not None], grad.double())
    assert lse.dtype == torch.float32
    assert_within(lse, expected, lce_op.error_bound(x, w, expected), f"lse {dtype}")
    for name, g, g64, leaf in zip(("input", "weight", "bias"), ours, theirs, leaves):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape, name
        bound = 32 * dtypes.ROUNDING[dtype] * (g64.abs() + g64.abs().mean()) + 1e-6
        assert_within(g, g64, bound, f"lse d{name} {dtype}")


@pytest.mark.parametrize("change, error, match", [
    (lambda x, w, b: (x, w[:, :7], b, None), RuntimeError, r"must share H.*\(11, 7\)"),
    (lambda x, w, b: (x, w.double(), b, None), TypeError, "same dtype"),
    (lambda x, w, b: (x[0], w, b, None), ValueError, r"rows \(R, H\).*\(8,\)"),
    (lambda x, w, b: (x, w, b[:3], None), RuntimeError, r"bias.shape=\(3,\)"),
    (lambda x, w, b: (x, w, b, -1.0), ValueError, "softcap=-1.0"),
], ids=["hidden", "dtype", "rows", "bias", "softcap"])
def test_rows_log_sum_exp_refuses_bad_arguments_naming_them(change, error, match):
    x, w, _, b = inputs((5,), 8, 11, torch.float32)
    with pytest.raises(error, match=r"pallas::linear_logsumexp: .*" + match):
        torch.ops.pallas.linear_logsumexp(*change(x, w, b))


def test_rows_log_sum_exp_passes_opcheck(small_chunks):
    x, w, _, b = inputs((13,), 8, 21, torch.float32)
    torch.library.opcheck(torch.ops.pallas.linear_logsumexp.default,
                          (x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), None))


def test_ignore_index_absent_and_a_real_class(small_chunks):
    x, w, target, b = inputs((30,), 16, 50, torch.float32, ignored=0)
    check(x, w, target, b, "nothing ignored")
    target[::3] = 7  # class 7 ignored wherever it is the target
    check(x, w, target, b, "ignore_index=7", ignore_index=7, label_smoothing=0.2)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_every_row_ignored_gives_what_torch_gives(reduction):
    x, w, _, b = inputs((6,), 8, 20, torch.float32)
    target = torch.full((6,), -100)
    x.requires_grad_()
    ours = torch_pallas.linear_cross_entropy(x, w, target, b, reduction=reduction)
    theirs = lce_op.torch_linear_cross_entropy(x, w, target, b, reduction=reduction)
    torch.testing.assert_close(ours, theirs, equal_nan=True)
    (g_ours,) = torch.autograd.grad(ours.sum(), x)
    (g_theirs,) = torch.autograd.grad(theirs.sum(), x)
    torch.testing.assert_close(g_ours, g_theirs, equal_nan=True)


def test_torch_opinfo_samples_of_cross_entropy():
    """nn.functional.cross_entropy's own sample inputs with class targets
    and no class weights, as (N, C) logits: input the logits, weight the
    identity, so the op's loss is the sample's."""
    from torch.testing._internal.common_methods_invocations import op_db

    info = next(o for o in op_db if o.name == "nn.functional.cross_entropy")
    checked = 0
    for sample in info.sample_inputs("cpu", torch.float32, requires_grad=True):
        logits, (target,) = sample.input, sample.args
        kwargs = {k: v for k, v in sample.kwargs.items()
                  if k in ("ignore_index", "reduction", "label_smoothing")}
        if (logits.dim() != 2 or target.dtype != torch.int64 or "weight" in sample.kwargs
                or set(sample.kwargs) - set(kwargs)):
            continue
        eye = torch.eye(logits.shape[1])
        ours = torch_pallas.linear_cross_entropy(logits, eye, target, **kwargs)
        theirs = F.cross_entropy(logits, target, **kwargs)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, equal_nan=True)
        grad = torch.randn(ours.shape)
        torch.testing.assert_close(torch.autograd.grad(ours, logits, grad)[0],
                                   torch.autograd.grad(theirs, logits, grad)[0],
                                   rtol=1e-5, atol=1e-6, equal_nan=True)
        checked += 1
    assert checked >= 4, f"only {checked} samples checked"


def test_gradients_wanted_for_some_leaves_only(small_chunks):
    """A frozen weight (LoRA-style) or input: the forward writes only the
    gradients autograd wants, and those are right."""
    x, w, target, b = inputs((17,), 12, 40, torch.float32)
    x.requires_grad_()
    (dx,) = torch.autograd.grad(torch_pallas.linear_cross_entropy(x, w, target, b), x)
    x64 = x.detach().double().requires_grad_()
    (dx64,) = torch.autograd.grad(lce_op.torch_linear_cross_entropy(
        x64, w.double(), target, b.double()), x64)
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-5, atol=1e-7)
    w.requires_grad_()
    (dw,) = torch.autograd.grad(torch_pallas.linear_cross_entropy(x.detach(), w, target), w)
    assert dw.shape == w.shape and dw.abs().sum() > 0


def test_a_second_backward_through_the_graph_is_refused():
    """The gradients are written during the forward and scaled in place by
    the first backward: a second (retain_graph) raises torch's own error
    rather than scale them twice."""
    x, w, target, _ = inputs((9,), 8, 20, torch.float32)
    x.requires_grad_()
    loss = torch_pallas.linear_cross_entropy(x, w, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("call, error, match", [
    (lambda x, w, t: torch_pallas.linear_cross_entropy(x, w[:, :5], t), RuntimeError,
     r"input \(\.\.\., H\) and weight \(V, H\) must share H"),
    (lambda x, w, t: torch_pallas.linear_cross_entropy(x, w, t[:3]), RuntimeError,
     r"target.shape=\(3,\)"),
    (lambda x, w, t: torch_pallas.linear_cross_entropy(x, w.double(), t), TypeError,
     "weight.dtype=torch.float64"),
    (lambda x, w, t: torch_pallas.linear_cross_entropy(x, w, t.float()), TypeError,
     "target has dtype torch.float32"),
    (lambda x, w, t: torch_pallas.linear_cross_entropy(x, w, t, torch.randn(3)), RuntimeError,
     r"bias.shape=\(3,\) must be \(V,\) = \(20,\)"),
    (lambda x, w, t: torch_pallas.linear_cross_entropy(x, w, t, reduction="avg"), ValueError,
     "reduction='avg'"),
    (lambda x, w, t: torch_pallas.linear_cross_entropy(x, w, t, label_smoothing=1.5), ValueError,
     "label_smoothing=1.5"),
    (lambda x, w, t: torch_pallas.linear_cross_entropy(x, w, t, softcap=0.0), ValueError,
     "softcap=0.0"),
    (lambda x, w, t: torch_pallas.linear_cross_entropy(x, w, t.clamp(max=19) + 1), IndexError,
     r"target holds 20, not a class in \[0, 20\)"),
    (lambda x, w, t: torch_pallas.linear_cross_entropy(x, w, t.clamp(min=0) - 5), IndexError,
     r"target holds -\d, not a class"),
], ids=["hidden", "target-shape", "weight-dtype", "target-dtype", "bias-shape", "reduction",
        "smoothing", "softcap", "target-past-vocab", "target-negative"])
def test_bad_arguments_are_refused_naming_them(call, error, match):
    x = torch.randn(6, 8)
    w = torch.randn(20, 8)
    target = torch.randint(0, 20, (6,))
    target[-1] = 19
    with pytest.raises(error, match=match) as info:
        call(x, w, target)
    assert "pallas::linear_cross_entropy" in str(info.value)


def test_torch_compile_on_cuda_traces_the_triton_kernels():
    """The public op, the forward op writing gradients, and the backward op
    (fake CUDA tensors: no autograd graph on a CPU-only torch), each traced
    into the matmul and loss kernels."""
    from helpers import fake_cuda_trace

    model = """
    class Model(torch.nn.Module):
        def forward(self, x, w, t, g):
            _, lse, *grads = torch.ops.pallas.linear_cross_entropy_forward(
                x, w, t, None, -100, "mean", 0.1, 30.0, [True, True, False])
            return (torch_pallas.linear_cross_entropy(x, w, t, label_smoothing=0.1), *grads,
                    *torch.ops.pallas.linear_cross_entropy_backward(
                        g, x, w, t, None, lse, -100, "none", 0.0, None, [True, True, False]))
    """
    inputs_ = """
    x = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1000, 64, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, 1000, (300,), device="cuda")
    inputs = (x, w, t, torch.randn(300, device="cuda"))
    """
    lines = fake_cuda_trace(model, inputs_)
    kernels = set(lines["KERNELS"].split())
    assert {"loss_kernel", "logit_gradient_kernel"} <= kernels, kernels
    assert any("matmul" in k for k in kernels), kernels
    assert lines["OPAQUE"] == "False"


MEMORY_WORKLOAD = """
import sys, torch, torch_pallas
from torch_pallas.ops import linear_cross_entropy as lce_op

def workload(provider, tokens, hidden, vocab):
    torch.manual_seed(0)
    x = (torch.randn(tokens, hidden) * 0.1).requires_grad_()
    w = (torch.randn(vocab, hidden) * 0.1).requires_grad_()
    t = torch.randint(0, vocab, (tokens,))
    loss = (torch_pallas.linear_cross_entropy if provider == "pallas"
            else lce_op.torch_linear_cross_entropy)

    def run():
        x.grad = w.grad = None
        loss(x, w, t).backward()
    return run
"""


def test_peak_memory_stays_bounded_as_tokens_grow(tmp_path):
    """Forward and backward at 512 and 4096 tokens (vocabulary 8192,
    hidden 64), the peaks measured in a fresh process (bench/memory.py):
    torch's composition grows by its logits and their gradients (at least
    2 x 3584 x 8192 x 4 bytes more), the fused loss by far less than one
    logits' worth (its chunks keep their size; only input-sized arrays
    grow)."""
    (tmp_path / "lce_memory.py").write_text(MEMORY_WORKLOAD)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import memory
    finally:
        sys.path.remove(str(ROOT / "bench"))
    env_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env_path]))
    try:
        calls = [(provider, tokens, 64, 8192) for provider in ("pallas", "torch")
                 for tokens in (512, 4096)]
        peaks = dict(zip([c[:2] for c in calls], memory.peaks("lce_memory:workload", calls)))
    finally:
        if env_path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = env_path
    logits_growth = (4096 - 512) * 8192 * 4
    torch_growth = peaks["torch", 4096] - peaks["torch", 512]
    ours_growth = peaks["pallas", 4096] - peaks["pallas", 512]
    assert torch_growth >= 2 * logits_growth, json.dumps({str(k): v for k, v in peaks.items()})
    assert ours_growth < logits_growth / 4, json.dumps({str(k): v for k, v in peaks.items()})
    assert peaks["pallas", 4096] < peaks["torch", 4096] / 4
