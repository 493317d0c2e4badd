"""torch_pallas.rms_norm against torch.nn.functional.rms_norm in float64:
values and both gradients, every dtype, ragged rows and widths, one and two
normalized dimensions, with and without a weight (of the input's dtype or
float32), eps given or torch's default; inputs in any layout; PyTorch's own
sample inputs; bad arguments refused before any kernel runs; the layer
torch_pallas.nn.RMSNorm. (opcheck, compile on model layouts and the
backends' fakes: tests/test_opcheck.py and tests/test_layouts.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_pallas
from helpers import FLOAT_DTYPES, assert_within, simulators_exhaustive
from torch_pallas.base import dtypes
from torch_pallas.ops import rms_norm as rms_norm_op

# (input shape, normalized_shape): ragged rows and widths, no multiple of any tile
SHAPES = [((1, 7), (7,)), ((5, 33), (33,)), ((3, 4, 130), (130,)), ((2, 3, 5, 9), (5, 9))]
SIMULATED_SHAPES = SHAPES[:2]


def gradient_bound(ours_error_scale, torch_grad, grad64, dtype):
    """|ours - float64| within twice torch's own error in that dtype, plus
    a few roundings of the gradient's size."""
    return (2 * (torch_grad.double() - grad64).abs()
            + 8 * dtypes.ROUNDING[dtype] * (grad64.abs() + grad64.abs().mean()) * ours_error_scale)


def check(x, normalized, weight, eps, what):
    """Values and gradients of one call against float64 and torch's own."""
    x = x.detach().requires_grad_()
    if weight is not None:
        weight = weight.detach().requires_grad_()
    out = torch_pallas.rms_norm(x, normalized, weight, eps)
    expected = F.rms_norm(x, normalized, weight, eps)
    assert out.dtype == expected.dtype and out.shape == expected.shape, what
    ref = rms_norm_op.reference(x.detach(), normalized, None if weight is None else weight.detach(),
                                eps)
    bound = rms_norm_op.error_bound(x.detach(), ref)
    assert_within(out, ref, bound, what)

    grad = torch.randn(out.shape).to(out.dtype)
    inputs = (x,) if weight is None else (x, weight)
    ours = torch.autograd.grad(out, inputs, grad)
    theirs = torch.autograd.grad(expected, inputs, grad)
    x64 = x.detach().double().requires_grad_()
    w64 = None if weight is None else weight.detach().double().requires_grad_()
    eps64 = torch.finfo(x.dtype).eps if eps is None else eps
    out64 = F.rms_norm(x64, normalized, w64, eps64)
    grads64 = torch.autograd.grad(out64, (x64,) if w64 is None else (x64, w64), grad.double())
    for name, g, t, g64 in zip(("input", "weight"), ours, theirs, grads64):
        assert g.dtype == t.dtype and g.shape == t.shape, f"{what} d{name}"
        # dw sums over rows: its rounding grows with their count
        scale = 1 if name == "input" else max(1, x.numel() // x.shape[-1]) ** 0.5
        assert_within(g, g64, gradient_bound(scale, t, g64, x.dtype), f"{what} d{name}")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("weighted", ["none", "same", "float32"])
@pytest.mark.parametrize("shape,normalized", SHAPES, ids=str)
def test_values_and_gradients_match_float64(shape, normalized, weighted, dtype):
    x = torch.randn(shape).to(dtype)
    weight = None
    if weighted != "none":
        weight = (torch.rand(normalized) + 0.5).to(dtype if weighted == "same" else torch.float32)
    check(x, normalized, weight, None, f"{shape} {dtype} weight={weighted}")


@pytest.mark.parametrize("cpu_backend", simulators_exhaustive(), indirect=True)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_every_backend(cpu_backend, dtype):
    for shape, normalized in SIMULATED_SHAPES:
        x = torch.randn(shape).to(dtype) * 3
        check(x, normalized, (torch.rand(normalized) + 0.5).to(dtype), 1e-5,
              f"{cpu_backend} {shape} {dtype}")
        check(x, normalized, None, None, f"{cpu_backend} {shape} {dtype} without weight")


@pytest.mark.slow
def test_wide_rows_many_blocks(cpu_backend):
    """Rows wider than a tile and more rows than a block, on each backend:
    the Mosaic GPU kernels' two passes over column tiles, the TPU kernels'
    lane padding and row blocks, the Triton backward's runs of rows."""
    x = torch.randn(70, 300)
    check(x, (300,), torch.rand(300) + 0.5, 1e-6, f"{cpu_backend} (70, 300)")


def test_eps_defaults_to_the_dtypes_epsilon_and_is_used():
    x = torch.randn(4, 16) * 1e-3  # small enough that eps matters
    for eps in (None, 1e-2):
        torch.testing.assert_close(torch_pallas.rms_norm(x, (16,), eps=eps),
                                   F.rms_norm(x, (16,), eps=eps), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(torch_pallas.rms_norm(x, (16,)), torch_pallas.rms_norm(x, (16,), eps=1e-2))


def test_inputs_in_any_layout():
    base = torch.randn(6, 40, 8)
    weight = torch.rand(6) + 0.5
    for x in (base.transpose(0, 2), base[:, ::2, :6].transpose(0, 1), torch.randn(6).expand(5, 6)):
        torch.testing.assert_close(torch_pallas.rms_norm(x, (6,), weight),
                                   F.rms_norm(x, (6,), weight), rtol=1e-5, atol=1e-5)


def test_a_single_int_normalized_shape_and_empty_rows():
    x = torch.randn(3, 10)
    torch.testing.assert_close(torch_pallas.rms_norm(x, 10), F.rms_norm(x, (10,)))
    empty = torch.randn(0, 10, requires_grad=True)
    out = torch_pallas.rms_norm(empty, (10,))
    assert out.shape == (0, 10)
    out.sum().backward()
    assert empty.grad.shape == (0, 10)


@pytest.mark.parametrize("call, error, match", [
    (lambda: torch_pallas.rms_norm(torch.randn(3, 5), (4,)), RuntimeError, r"normalized_shape=\[4\]"),
    (lambda: torch_pallas.rms_norm(torch.randn(3, 5), (5,), torch.randn(4)), RuntimeError,
     r"weight.shape=\(4,\)"),
    (lambda: torch_pallas.rms_norm(torch.randn(3, 5).double(), (5,)), TypeError, "float64"),
    (lambda: torch_pallas.rms_norm(torch.ones(3, 5, dtype=torch.int32), (5,)), TypeError, "int32"),
    (lambda: torch_pallas.rms_norm(torch.randn(3, 5), ()), RuntimeError, "not empty"),
], ids=["shape", "weight", "float64", "int", "empty"])
def test_bad_arguments_are_refused_naming_them(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert "pallas::rms_norm" in str(info.value)


def test_torch_sample_inputs():
    """PyTorch's own samples for nn.functional.rms_norm (its OpInfo)."""
    from torch.testing._internal.common_methods_invocations import op_db

    (opinfo,) = [op for op in op_db if op.name == "nn.functional.rms_norm"]
    checked = 0
    for dtype in FLOAT_DTYPES:
        for sample in opinfo.sample_inputs("cpu", dtype, requires_grad=False):
            normalized, *rest = sample.args
            weight = rest[0] if rest else sample.kwargs.get("weight")
            eps = sample.kwargs.get("eps")
            if sample.input.numel() == 0:
                continue
            check(sample.input, tuple(normalized), weight, eps,
                  f"sample {tuple(sample.input.shape)} {normalized} {dtype}")
            checked += 1
    assert checked >= 6


def test_the_layer_is_a_drop_in_for_torch_s():
    torch_layer = torch.nn.RMSNorm((3, 17), eps=1e-6)
    with torch.no_grad():
        torch_layer.weight.uniform_(0.5, 1.5)
    ours = torch_pallas.nn.RMSNorm((3, 17), eps=1e-6)
    ours.load_state_dict(torch_layer.state_dict())
    assert isinstance(ours, torch.nn.RMSNorm)
    x = torch.randn(4, 3, 17)
    torch.testing.assert_close(ours(x), torch_layer(x), rtol=1e-5, atol=1e-5)
    ours(x).square().sum().backward()
    torch_layer(x).square().sum().backward()
    torch.testing.assert_close(ours.weight.grad, torch_layer.weight.grad, rtol=1e-4, atol=1e-4)
    unweighted = torch_pallas.nn.RMSNorm(17, elementwise_affine=False)
    torch.testing.assert_close(unweighted(x), F.rms_norm(x, (17,)), rtol=1e-5, atol=1e-5)


def test_torch_compile_on_cuda_traces_the_triton_kernels():
    """On fake CUDA tensors (no GPU needed), AOTAutograd traces the forward
    and the backward op into their Triton kernels: no opaque call is left."""
    from helpers import fake_cuda_trace

    model = """
    class Model(torch.nn.Module):
        def forward(self, x, w, dy):
            out = torch_pallas.rms_norm(x, (x.shape[-1],), w)
            rows = x.reshape(-1, x.shape[-1])
            _, rstd = torch.ops.pallas.rms_norm_forward(rows, w, 1e-6)
            dx, dw = torch.ops.pallas.rms_norm_backward(dy, rows, rstd, w)
            return out, dx, dw
    """
    inputs = """
    x = torch.randn(3, 40, 96, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(96, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(120, 96, device="cuda", dtype=torch.bfloat16)
    inputs = (x, w, dy)
    """
    lines = fake_cuda_trace(model, inputs)
    assert lines["KERNELS"].split() == ["rms_norm_backward_kernel", "rms_norm_kernel"]
    assert lines["OPAQUE"] == "False"
