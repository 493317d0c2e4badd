"""Bounded kernel builds under changing shapes (torch_pallas.runtime.shape_buckets):
the bucket sizes, a varying size building a bounded number of kernels, and
results as accurate as the unpadded kernels' (equal up to the GEMM's own
rounding, which depends on its blocking), at the buckets' edges, forward
and backward."""

from __future__ import annotations

import pytest
import torch

import torch_pallas
from torch_pallas.runtime import compile_cache, shape_buckets


@pytest.fixture
def buckets():
    shape_buckets.reset()
    yield shape_buckets
    shape_buckets.reset()
    shape_buckets.enabled = True


def test_bucket_sizes_three_per_octave():
    assert [shape_buckets.bucket(n) for n in (1, 8, 9, 12, 13, 16, 17, 25, 100, 129, 193, 700)] \
        == [1, 8, 10, 12, 16, 16, 20, 32, 128, 160, 256, 768]
    octaves = {}
    for n in range(1, 5000):
        b = shape_buckets.bucket(n)
        assert n <= b < max(n + 1, 4 / 3 * n)  # at most a third more work
        assert shape_buckets.bucket(b) == b  # a bucket is its own bucket
        octaves.setdefault((b - 1).bit_length(), set()).add(b)
    assert all(len(sizes) <= 3 for octave, sizes in octaves.items() if octave > 3)


def test_one_size_is_never_padded_a_second_one_starts_buckets(buckets):
    family = ("test", 1)
    assert [buckets.size(family, n) for n in (100, 100, 100)] == [100, 100, 100]
    assert [buckets.size(family, n) for n in (110, 100, 130)] == [128, 128, 160]
    buckets.enabled = False
    assert buckets.size(("test", 2), 37) == buckets.size(("test", 2), 41) - 4 == 37


def _linear_step(x, w, grad, matmul=torch_pallas.matmul):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = matmul(x, w.t())
    gx, gw = torch.autograd.grad(out, (x, w), grad)
    return out.detach(), gx, gw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varying_rows_build_bounded_kernels_with_the_same_results(buckets, dtype):
    """A linear layer's forward (M varies), input gradient (M varies) and
    weight gradient (K varies) at six token counts, at and around the
    buckets' edges: kernels for a few buckets, results equal to the
    unbucketed kernels' up to a GEMM's rounding, and as close to float64."""
    w = torch.randn(48, 40).to(dtype)
    sizes = [33, 47, 48, 49, 95, 96]
    cases = [(torch.randn(t, 40).to(dtype), torch.randn(t, 48).to(dtype)) for t in sizes]
    before = compile_cache.compiled.builds
    bucketed = [_linear_step(x, w, g) for x, g in cases]
    built = compile_cache.compiled.builds - before
    # 33 exact, then buckets 48, 64, 96 (3 kernels each: forward, dX, dW).
    assert built <= 3 * 4
    buckets.enabled = False
    ulp = torch.finfo(dtype).eps
    for (x, g), got in zip(cases, bucketed):
        unpadded = _linear_step(x, w, g)
        exact = _linear_step(x.double(), w.double(), g.double(), torch.matmul)
        for a, b, e in zip(got, unpadded, exact):
            assert a.shape == b.shape == e.shape and a.dtype == dtype
            scale = e.abs().max().item()
            # Each within a few roundings of the float64 result, as the unpadded one is.
            assert (a.double() - e).abs().max().item() <= 16 * ulp * scale
            assert (a.double() - b.double()).abs().max().item() <= 16 * ulp * scale


def test_batched_and_transposed_operands_padded_exactly(buckets):
    b = torch.randn(3, 20, 16)
    for rows in (5, 11, 13, 29):
        a = torch.randn(3, 20, rows).mT  # a transposed view: read in place, padded along M
        torch.testing.assert_close(torch_pallas.matmul(a, b), torch.matmul(a, b),
                                   rtol=1e-5, atol=1e-5)
        assert torch_pallas.matmul(a, b).shape == (3, rows, 16)


def test_a_weights_sizes_are_never_padded(buckets):
    """Layers whose weights share a size (K) but not the other (N) are not
    one changing size: a weight is never padded (that would copy it on every
    call), nor is a weight's gradient's output, while the token count, M
    forward and K in the weight's gradient, is bucketed once it changes."""
    from torch_pallas.ops import matmul as matmul_op

    matmul_op._PLANS.clear()
    weights = [torch.nn.Parameter(torch.randn(n, 37)) for n in (50, 23, 70)]
    for rows in (10, 13, 10):
        x = torch.randn(rows, 37, requires_grad=True)
        outs = [torch_pallas.linear(x, w) for w in weights]
        dys = [torch.randn_like(o) for o in outs]
        grads = torch.autograd.grad(outs, [x, *weights], dys)
        torch.testing.assert_close(grads[0], sum(dy @ w for dy, w in zip(dys, weights)),
                                   atol=1e-4, rtol=1e-4)
        for w, o, dy, g in zip(weights, outs, dys, grads[1:]):
            torch.testing.assert_close(o, x @ w.t(), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(g, dy.t() @ x, atol=1e-4, rtol=1e-4)
    sizes = [plan.sizes for plan in matmul_op._PLANS.values()]
    weight_dims = {(50, 37), (23, 37), (70, 37), (37, 50), (37, 23), (37, 70)}
    # forward and input gradient: (M, N, K) with N, K a weight's, never padded
    forward = [(s, p) for s, p in sizes if (s[1], s[2]) in weight_dims]
    assert forward and all(p[1:] == s[1:] for s, p in forward)
    assert any(p[0] == 16 and s[0] == 13 for s, p in forward)  # the rows changed: bucketed
    # weight gradient: the weight's (N, K) as its output, never padded (three
    # widths in one family are not a changing size), the contraction over
    # the tokens bucketed
    weight_grad = [(s, p) for s, p in sizes if (s[0], s[1]) in weight_dims]
    assert len(weight_grad) >= 3 and all(p[:2] == s[:2] for s, p in weight_grad)
    assert any(s[2] == 13 and p[2] == 16 for s, p in weight_grad)


def test_a_backward_pads_its_output_gradient_once(buckets, monkeypatch):
    """dX = dY @ W and dW = X^T @ dY both pad dY's rows to one bucket: one
    copy serves both (kept for that backward call alone), and the gradients
    match float64."""
    from torch_pallas.ops import matmul as matmul_op

    made = []
    original = matmul_op.zero_padded

    def counting(t, rows, cols):
        made.append(tuple(t.shape))
        return original(t, rows, cols)

    monkeypatch.setattr(matmul_op, "zero_padded", counting)
    w = torch.nn.Parameter(torch.randn(48, 40))
    for rows in (33, 47):  # the second size starts buckets: 47 -> 48
        x = torch.randn(rows, 40, requires_grad=True)
        made.clear()
        out = torch_pallas.linear(x, w)
        dy = torch.randn_like(out)
        gx, gw = torch.autograd.grad(out, (x, w), dy)
        xd, wd, dyd = x.detach().double(), w.detach().double(), dy.double()
        torch.testing.assert_close(out.double(), xd @ wd.t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gx.double(), dyd @ wd, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gw.double(), dyd.t() @ xd, rtol=1e-5, atol=1e-5)
    # x in the forward, dY once for dX and dW, x again in dW (the forward's
    # copy is not kept: other layers may read x)
    assert sorted(made) == [(1, 47, 40), (1, 47, 40), (1, 47, 48)]
