"""torch_pallas.swiglu against F.silu(gate) * up in float64: values and both
gradients, every dtype, ragged shapes, gates far into both tails of the
sigmoid, the halves of a fused projection (non-contiguous chunks); every CPU
backend; bad arguments refused naming them; the fake CUDA trace into the
Triton kernels. (opcheck, compile on model layouts and the backends' fakes:
tests/test_opcheck.py and tests/test_layouts.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_pallas
from helpers import FLOAT_DTYPES, assert_within, simulators_exhaustive
from torch_pallas.base import dtypes
from torch_pallas.ops import swiglu as swiglu_op

SHAPES = [(1,), (7, 33), (3, 5, 129), (2, 1000, 3)]


def check(gate, up, what):
    gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
    out = torch_pallas.swiglu(gate, up)
    expected = F.silu(gate) * up
    assert out.dtype == expected.dtype and out.shape == expected.shape, what
    ref = swiglu_op.reference(gate.detach(), up.detach())
    assert_within(out, ref, swiglu_op.error_bound(gate, ref), what)
    grad = torch.randn(out.shape).to(out.dtype)
    ours = torch.autograd.grad(out, (gate, up), grad)
    theirs = torch.autograd.grad(expected, (gate, up), grad)
    grads64 = swiglu_op.reference_gradients(grad, gate, up)
    for name, g, t, g64 in zip(("gate", "up"), ours, theirs, grads64):
        assert g.dtype == t.dtype and g.shape == t.shape, f"{what} d{name}"
        # within twice torch's own error in that dtype, plus a rounding or two
        bound = 2 * (t.double() - g64).abs() + 2 * dtypes.ROUNDING[gate.dtype] * g64.abs() + 1e-6
        assert_within(g, g64, bound, f"{what} d{name}")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_values_and_gradients_match_float64(shape, dtype):
    check((torch.randn(shape) * 3).to(dtype), torch.randn(shape).to(dtype), f"{shape} {dtype}")


@pytest.mark.parametrize("cpu_backend", simulators_exhaustive(), indirect=True)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_every_backend(cpu_backend, dtype):
    for shape in SHAPES[1:3]:
        check((torch.randn(shape) * 3).to(dtype), torch.randn(shape).to(dtype),
              f"{cpu_backend} {shape} {dtype}")


def test_every_backend_on_a_block_edge(cpu_backend):
    """A size past one block of every family, ragged."""
    check(torch.randn(37, 130) * 3, torch.randn(37, 130), f"{cpu_backend} (37, 130)")


def test_the_sigmoid_s_tails():
    gate = torch.tensor([-1e4, -100.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 100.0, 1e4])
    check(gate, torch.full_like(gate, 1.5), "tails")
    out = torch_pallas.swiglu(gate, torch.ones_like(gate))
    assert out.isfinite().all()


def test_the_halves_of_a_fused_projection():
    """gate and up as chunks of one (tokens, 2 x width) projection, as
    Phi-3's MLP splits them: non-contiguous views, read as they are."""
    projected = torch.randn(9, 2 * 45, requires_grad=True)
    gate, up = projected.chunk(2, dim=-1)
    out = torch_pallas.swiglu(gate, up)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    (grad,) = torch.autograd.grad(out.square().sum(), projected)
    (expected,) = torch.autograd.grad((F.silu(gate) * up).square().sum(), projected)
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5)


def test_empty_inputs():
    gate = torch.randn(0, 8, requires_grad=True)
    out = torch_pallas.swiglu(gate, torch.randn(0, 8))
    assert out.shape == (0, 8)
    out.sum().backward()
    assert gate.grad.shape == (0, 8)


@pytest.mark.parametrize("call, error, match", [
    (lambda: torch_pallas.swiglu(torch.randn(3, 4), torch.randn(3, 5)), ValueError,
     r"gate.shape=\(3, 4\) and up.shape=\(3, 5\)"),
    (lambda: torch_pallas.swiglu(torch.randn(3), torch.randn(3).half()), TypeError, "float16"),
    (lambda: torch_pallas.swiglu(torch.randn(3).double(), torch.randn(3).double()), TypeError,
     "float64"),
    (lambda: torch_pallas.swiglu(torch.ones(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32)),
     TypeError, "int32"),
], ids=["shape", "dtypes", "float64", "int"])
def test_bad_arguments_are_refused_naming_them(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert "pallas::swiglu" in str(info.value)


def test_torch_compile_on_cuda_traces_the_triton_kernels():
    from helpers import fake_cuda_trace

    model = """
    class Model(torch.nn.Module):
        def forward(self, gate, up, dy):
            return (torch_pallas.swiglu(gate, up),
                    *torch.ops.pallas.swiglu_backward(dy, gate, up))
    """
    inputs = """
    gate, up, dy = (torch.randn(4, 100, 352, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    inputs = (gate, up, dy)
    """
    lines = fake_cuda_trace(model, inputs)
    assert lines["KERNELS"].split() == ["swiglu_backward_kernel", "swiglu_kernel"]
    assert lines["OPAQUE"] == "False"
