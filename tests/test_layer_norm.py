"""torch_pallas.layer_norm against torch.nn.functional.layer_norm in float64:
values and the three gradients, every dtype, ragged rows and widths, one and
two normalized dimensions, with and without weight and bias (of the input's
dtype or float32), rows far from zero (a variance that E[x^2] - mean^2
would lose); inputs in any layout; PyTorch's own sample inputs; bad
arguments refused before any kernel runs; torch_pallas.nn.LayerNorm.
(opcheck, compile on model layouts and the backends' fakes:
tests/test_opcheck.py and tests/test_layouts.py.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import torch_pallas
from helpers import FLOAT_DTYPES, assert_within, simulators_exhaustive
from torch_pallas.base import dtypes
from torch_pallas.ops import layer_norm as layer_norm_op

SHAPES = [((1, 7), (7,)), ((5, 33), (33,)), ((3, 4, 130), (130,)), ((2, 3, 5, 9), (5, 9))]
SIMULATED_SHAPES = SHAPES[:2]


def check(x, normalized, weight, bias, eps, what):
    x = x.detach().requires_grad_()
    params = [p.detach().requires_grad_() if p is not None else None for p in (weight, bias)]
    out = torch_pallas.layer_norm(x, normalized, *params, eps=eps)
    expected = F.layer_norm(x, normalized, *params, eps=eps)
    assert out.dtype == expected.dtype and out.shape == expected.shape, what
    ref = layer_norm_op.reference(x.detach(), normalized,
                                  *[p.detach() if p is not None else None for p in params], eps)
    assert_within(out, ref, layer_norm_op.error_bound(x, ref, math.prod(normalized)), what)

    grad = torch.randn(out.shape).to(out.dtype)
    inputs = [x] + [p for p in params if p is not None]
    ours = torch.autograd.grad(out, inputs, grad)
    theirs = torch.autograd.grad(expected, inputs, grad)
    inputs64 = [t.detach().double().requires_grad_() for t in inputs]
    it = iter(inputs64[1:])
    params64 = [next(it) if p is not None else None for p in params]
    out64 = F.layer_norm(inputs64[0], normalized, *params64, eps=eps)
    grads64 = torch.autograd.grad(out64, inputs64, grad.double())
    rows = max(1, x.numel() // math.prod(normalized))
    # The backward centres x on the saved float32 mean: off by half its ulp,
    # relative to the row's spread (how far the row lies from zero).
    x_rows = x.detach().double().reshape(rows, -1)
    far = (x_rows.mean(1).abs() / x_rows.std(1, unbiased=False).clamp_min(1e-30)).max().item()
    for i, (g, t, g64) in enumerate(zip(ours, theirs, grads64)):
        assert g.dtype == t.dtype and g.shape == t.shape, f"{what} gradient {i}"
        scale = 1 if i == 0 else math.sqrt(rows)  # the parameters' sum over rows
        rounding = 8 * dtypes.ROUNDING[x.dtype] + 2.0**-23 * far
        bound = 2 * (t.double() - g64).abs() + rounding * (g64.abs() + g64.abs().mean()) * scale
        assert_within(g, g64, bound, f"{what} gradient {i}")


# A weight or a bias alone on one ragged shape; none, both, float32 ones on all.
AFFINE_CASES = [(shape, normalized, affine) for shape, normalized in SHAPES
                for affine in ("none", "both", "float32")] + [
    (SHAPES[1][0], SHAPES[1][1], affine) for affine in ("weight", "bias")]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape,normalized,affine", AFFINE_CASES, ids=str)
def test_values_and_gradients_match_float64(shape, normalized, affine, dtype):
    x = torch.randn(shape).to(dtype)
    param_dtype = torch.float32 if affine == "float32" else dtype
    weight = (torch.rand(normalized) + 0.5).to(param_dtype) if affine != "none" and affine != "bias" else None
    bias = torch.randn(normalized).to(param_dtype) if affine in ("both", "bias", "float32") else None
    check(x, normalized, weight, bias, 1e-5, f"{shape} {dtype} affine={affine}")


@pytest.mark.parametrize("cpu_backend", simulators_exhaustive(), indirect=True)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_every_backend(cpu_backend, dtype):
    for shape, normalized in SIMULATED_SHAPES:
        x = torch.randn(shape).to(dtype) * 3 + 1
        check(x, normalized, (torch.rand(normalized) + 0.5).to(dtype),
              torch.randn(normalized).to(dtype), 1e-5, f"{cpu_backend} {shape} {dtype}")


@pytest.mark.slow
def test_wide_rows_far_from_zero(cpu_backend):
    """Rows wider than a tile, more rows than a block, centred far from
    zero (a hundred standard deviations): the corrected mean and the
    variance of the centred row, on each backend."""
    x = torch.randn(70, 300) + 100.0
    check(x, (300,), torch.rand(300) + 0.5, torch.randn(300), 1e-5, f"{cpu_backend} (70, 300)")


def test_the_forward_keeps_its_precision_far_from_zero():
    """Rows 10^4 standard deviations from zero: the output within a few
    float32 roundings of float64 (torch's own float32 forward loses a
    thousand times more there); the backward works from the saved float32
    mean, as torch's does."""
    x = torch.randn(9, 300) * 0.1 + 1000.0
    ref = layer_norm_op.reference(x, (300,))
    assert_within(torch_pallas.layer_norm(x, (300,)), ref, 1e-5 * (ref.abs() + 1), "far")


def test_inputs_in_any_layout():
    base = torch.randn(6, 40, 8)
    weight, bias = torch.rand(6) + 0.5, torch.randn(6)
    for x in (base.transpose(0, 2), base[:, ::2, :6].transpose(0, 1), torch.randn(6).expand(5, 6)):
        torch.testing.assert_close(torch_pallas.layer_norm(x, (6,), weight, bias),
                                   F.layer_norm(x, (6,), weight, bias), rtol=1e-5, atol=1e-5)


def test_a_single_int_normalized_shape_and_empty_rows():
    x = torch.randn(3, 10)
    torch.testing.assert_close(torch_pallas.layer_norm(x, 10), F.layer_norm(x, (10,)))
    empty = torch.randn(0, 10, requires_grad=True)
    weight = torch.rand(10, requires_grad=True)
    out = torch_pallas.layer_norm(empty, (10,), weight)
    assert out.shape == (0, 10)
    out.sum().backward()
    assert empty.grad.shape == (0, 10) and torch.equal(weight.grad, torch.zeros(10))


@pytest.mark.parametrize("call, error, match", [
    (lambda: torch_pallas.layer_norm(torch.randn(3, 5), (4,)), RuntimeError, r"normalized_shape=\[4\]"),
    (lambda: torch_pallas.layer_norm(torch.randn(3, 5), (5,), None, torch.randn(4)), RuntimeError,
     r"bias.shape=\(4,\)"),
    (lambda: torch_pallas.layer_norm(torch.randn(3, 5).double(), (5,)), TypeError, "float64"),
    (lambda: torch_pallas.layer_norm(torch.randn(3, 5), (5,), torch.randn(5).double()), TypeError,
     "float64"),
], ids=["shape", "bias", "float64", "weight-float64"])
def test_bad_arguments_are_refused_naming_them(call, error, match):
    with pytest.raises(error, match=match) as info:
        call()
    assert "pallas::layer_norm" in str(info.value)


def test_torch_sample_inputs():
    """PyTorch's own samples for nn.functional.layer_norm (its OpInfo)."""
    from torch.testing._internal.common_methods_invocations import op_db

    (opinfo,) = [op for op in op_db if op.name == "nn.functional.layer_norm"]
    checked = 0
    for dtype in FLOAT_DTYPES:
        for sample in opinfo.sample_inputs("cpu", dtype, requires_grad=False):
            normalized, *rest = sample.args
            weight = rest[0] if rest else sample.kwargs.get("weight")
            bias = rest[1] if len(rest) > 1 else sample.kwargs.get("bias")
            if sample.input.numel() == 0 or math.prod(normalized) == 0:
                continue
            check(sample.input, tuple(normalized), weight, bias, sample.kwargs.get("eps", 1e-5),
                  f"sample {tuple(sample.input.shape)} {normalized} {dtype}")
            checked += 1
    assert checked >= 6


def test_the_layer_is_a_drop_in_for_torch_s():
    torch_layer = torch.nn.LayerNorm((3, 17), eps=1e-6)
    with torch.no_grad():
        torch_layer.weight.uniform_(0.5, 1.5)
        torch_layer.bias.normal_()
    ours = torch_pallas.nn.LayerNorm((3, 17), eps=1e-6)
    ours.load_state_dict(torch_layer.state_dict())
    assert isinstance(ours, torch.nn.LayerNorm)
    x = torch.randn(4, 3, 17)
    torch.testing.assert_close(ours(x), torch_layer(x), rtol=1e-5, atol=1e-5)
    ours(x).square().sum().backward()
    torch_layer(x).square().sum().backward()
    for name in ("weight", "bias"):
        torch.testing.assert_close(getattr(ours, name).grad, getattr(torch_layer, name).grad,
                                   rtol=1e-4, atol=1e-4)
    plain = torch_pallas.nn.LayerNorm(17, elementwise_affine=False)
    torch.testing.assert_close(plain(x), F.layer_norm(x, (17,)), rtol=1e-5, atol=1e-5)


def test_torch_compile_on_cuda_traces_the_triton_kernels():
    from helpers import fake_cuda_trace

    model = """
    class Model(torch.nn.Module):
        def forward(self, x, w, b, dy):
            out = torch_pallas.layer_norm(x, (x.shape[-1],), w, b)
            rows = x.reshape(-1, x.shape[-1])
            _, mean, rstd = torch.ops.pallas.layer_norm_forward(rows, w, b, 1e-5)
            return (out, *torch.ops.pallas.layer_norm_backward(dy, rows, mean, rstd, w))
    """
    inputs = """
    x = torch.randn(3, 40, 96, device="cuda", dtype=torch.bfloat16)
    w, b = (torch.rand(96, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dy = torch.randn(120, 96, device="cuda", dtype=torch.bfloat16)
    inputs = (x, w, b, dy)
    """
    lines = fake_cuda_trace(model, inputs)
    assert lines["KERNELS"].split() == ["layer_norm_backward_kernel", "layer_norm_kernel"]
    assert lines["OPAQUE"] == "False"
