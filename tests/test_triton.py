"""The torch.compile path: on CUDA the ops decompose into their Triton
kernels; on CPU they stay opaque calls into the Pallas kernels. (The Triton
kernels' results are checked with every other backend's, under
TRITON_INTERPRET=1, in the op tests.)"""

from __future__ import annotations


import pytest
import torch

import torch_pallas
from helpers import fake_cuda_trace

# Traces every op on fake CUDA tensors (no GPU needed) through AOTAutograd
# and prints what the graph calls. (Forward only: tracing a backward creates
# autograd nodes on the CUDA device, which a CPU-only torch cannot.)
TRACED_MODEL = """
class Model(torch.nn.Module):
    def forward(self, a, b, x):
        h = torch.ops.pallas.matmul(a, b)
        h = torch.ops.pallas.add(h, x)
        ramp = torch.ops.pallas.iota(h.shape[-1], dtype=h.dtype, device=h.device)
        half = torch.ops.pallas.fill(h.shape, 0.5, dtype=h.dtype, device=h.device)
        return (torch.ops.pallas.add(h, ramp).mul(half),)
"""
TRACED_INPUTS = """
a = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
b = torch.randn(48, 32, device="cuda", dtype=torch.bfloat16).t()  # read in place
x = torch.randn(48, device="cuda", dtype=torch.bfloat16)
inputs = (a, b, x)
"""


def test_tracing_on_cuda_tensors_reaches_the_triton_kernels():
    lines = fake_cuda_trace(TRACED_MODEL, TRACED_INPUTS)
    assert lines["KERNELS"].split() == ["add_kernel", "fill_kernel", "iota_kernel", "matmul_kernel"]
    assert int(lines["WRAPPERS"]) == 5  # matmul, add, iota, fill, add
    assert lines["OPAQUE"] == "False"  # no call into JAX left in the graph


def test_tracing_on_cpu_tensors_keeps_the_ops_opaque():
    from torch._functorch.aot_autograd import aot_export_module

    class Model(torch.nn.Module):
        def forward(self, a, b):
            return (torch.ops.pallas.add(torch.ops.pallas.matmul(a, b), b[0]),)

    gm, _ = aot_export_module(Model(), (torch.randn(5, 4), torch.randn(4, 4)), trace_joint=False)
    assert "torch.ops.pallas.matmul.default" in gm.code
    assert "torch.ops.pallas.add.default" in gm.code
    assert "triton_kernel_wrapper" not in gm.code


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.gpu
@needs_gpu
def test_compiled_model_on_cuda_launches_triton_kernels_only():
    from torch._inductor.utils import run_and_get_code

    layer = torch_pallas.nn.Linear(256, 384).cuda().to(torch.bfloat16)
    x = torch.randn(8, 100, 256, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True)
    out, code = run_and_get_code(compiled, x)
    source = "\n".join(code)
    assert "matmul_kernel" in source
    assert "jax" not in source and "torch.ops.pallas" not in source
    torch.testing.assert_close(out, layer(x), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@needs_gpu
def test_reduce_overhead_mode_gives_identical_results():
    a = torch.randn(300, 200, device="cuda", dtype=torch.float16)
    b = torch.randn(200, 170, device="cuda", dtype=torch.float16)

    def f(a, b):
        return torch.ops.pallas.add(torch.ops.pallas.matmul(a, b), b[0, :170])

    default = torch.compile(f, fullgraph=True)(a, b)
    for _ in range(3):  # CUDA graphs are recorded after warm-up runs
        graphed = torch.compile(f, fullgraph=True, mode="reduce-overhead")(a, b)
    assert torch.equal(default, graphed)


@pytest.mark.gpu
@needs_gpu
def test_compile_dynamic_on_cuda():
    w = torch.randn(64, 32, device="cuda")
    f = torch.compile(lambda x: torch.ops.pallas.matmul(x, w.t()), dynamic=True, fullgraph=True)
    for rows in (5, 17, 33):
        x = torch.randn(rows, 32, device="cuda")
        torch.testing.assert_close(f(x), x @ w.t(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@needs_gpu
def test_compiled_training_step_on_cuda_matches_eager():
    model = torch_pallas.nn.replace_linear(
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10))
    ).cuda()
    x = torch.randn(32, 64, device="cuda")
    compiled = torch.compile(model, fullgraph=True)
    compiled(x).square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().mean().backward()
    for got, expected in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
@needs_gpu
def test_float32_matmul_precision_on_cuda():
    """At torch's default 'highest' precision float32 products are full
    float32 (the default backend runs Triton's IEEE kernel; mosaic_gpu,
    TF32 only, refuses when asked by name); at 'high' both may use TF32."""
    from torch_pallas.ops import matmul as matmul_op

    a = torch.randn(300, 1000, device="cuda")
    b = torch.randn(1000, 170, device="cuda")
    ref = matmul_op.reference(a.cpu(), b.cpu())
    bound = matmul_op.error_bound(a.cpu(), b.cpu(), ref)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        out = torch.ops.pallas.matmul(a, b).cpu()
        assert bool(((out.double() - ref).abs() <= bound).all())
        if torch.cuda.get_device_capability()[0] >= 9:
            with torch_pallas.backend("mosaic_gpu"), pytest.raises(RuntimeError, match="TF32"):
                torch.ops.pallas.matmul(a, b)
        torch.set_float32_matmul_precision("high")
        tf32_bound = matmul_op.error_bound(a.cpu(), b.cpu(), ref, tf32=True)
        for backend in ("triton", "mosaic_gpu") if torch.cuda.get_device_capability()[0] >= 9 else ("triton",):
            with torch_pallas.backend(backend):
                for w in (b, b.t().contiguous().t()):  # B as given, and transposed in memory
                    out = torch.ops.pallas.matmul(a, w).cpu()
                    assert bool(((out.double() - ref).abs() <= tf32_bound).all()), backend
    finally:
        torch.set_float32_matmul_precision(before)
