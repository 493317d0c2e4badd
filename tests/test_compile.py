"""torch.compile(fullgraph=True) of functions calling each op, on CPU
tensors (the ops stay opaque calls into the Pallas kernels)."""

from __future__ import annotations

import torch

import torch_pallas


def test_compile_fullgraph_every_op():
    def f(a, b, x):
        h = torch.ops.pallas.matmul(a, b)
        h = torch.ops.pallas.add(h, x)
        ramp = torch.ops.pallas.iota(h.shape[-1], dtype=h.dtype)
        ones = torch.ops.pallas.fill(h.shape, 0.5, dtype=h.dtype)
        return torch.ops.pallas.add(h, ramp) * ones

    a, b, x = torch.randn(12, 9), torch.randn(9, 10), torch.randn(10)
    compiled = torch.compile(f, fullgraph=True, backend="inductor")
    expected = ((a @ b + x) + torch.arange(10, dtype=torch.float32)) * 0.5
    torch.testing.assert_close(compiled(a, b, x), expected, rtol=1e-5, atol=1e-5)


def test_compile_wrappers_and_backward():
    a = torch.randn(6, 4, requires_grad=True)
    b = torch.randn(4, 5, requires_grad=True)

    @torch.compile(fullgraph=True)
    def loss(a, b):
        return torch_pallas.add(torch_pallas.matmul(a, b), torch_pallas.fill((5,), 1.0)).sum()

    loss(a, b).backward()
    torch.testing.assert_close(a.grad, torch.ones(6, 5) @ b.detach().t())
    torch.testing.assert_close(b.grad, a.detach().t() @ torch.ones(6, 5))
