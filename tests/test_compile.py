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


def test_an_eager_call_under_dynamo_runs_the_kernel_untraced():
    """A frame Dynamo runs eagerly while it traces the frames below it (a
    `torch.compiler.disable(recursive=False)` function) calls the op: the
    kernel's Python (JAX code) is never traced, so Dynamo compiles the same
    frames as for torch.matmul in its place."""
    from torch._dynamo.testing import CompileCounter

    def frames_compiled(matmul):
        @torch.compiler.disable(recursive=False)
        def eager(x, w):
            return matmul(x, w)

        counter = CompileCounter()
        torch._dynamo.reset()
        x, w = torch.randn(5, 7), torch.randn(7, 3)
        out = torch.compile(lambda x, w: eager(x, w).relu(), backend=counter)(x, w)
        torch.testing.assert_close(out, (x @ w).relu(), rtol=1e-5, atol=1e-5)
        return counter.frame_count

    assert frames_compiled(torch.ops.pallas.matmul) == frames_compiled(torch.matmul)


def test_op_calls_leave_dynamo_and_sympy_unimported():
    """Until something imports Dynamo no compiled region exists: the ops'
    guard against it costs nothing (it imported Dynamo, ~1.4 s, at a
    process's first op call). Nor do eager size checks import torch's
    symbolic shapes (sympy, 0.38 s: checks.require)."""
    import subprocess
    import sys

    code = ("import sys, torch, torch_pallas\n"
            "a = torch.randn(9, 13)\n"
            "got = torch_pallas.matmul(a, a.t()), torch_pallas.add(a, a), torch_pallas.iota(5)\n"
            "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)\n"
            "for g, want in zip(got, (a @ a.t(), a + a, torch.arange(5))):\n"
            "    torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False False"
