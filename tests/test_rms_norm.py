"""torch_pallas.rms_norm against torch.nn.functional.rms_norm in float64:
values and both gradients, every dtype, ragged rows and widths, one and two
normalized dimensions, with and without a weight (of the input's dtype or
float32), eps given or torch's default; inputs in any layout; PyTorch's own
sample inputs; bad arguments refused before any kernel runs; the layer
torch_pallas.nn.RMSNorm. The casting modes ("llama", "gemma"): rounded bit
for bit as the modules' formulas on the op's own normalization, against
transformers' LlamaRMSNorm and GemmaRMSNorm, gradients against float64, on
every backend. (opcheck, compile on model layouts and the backends' fakes:
tests/test_opcheck.py and tests/test_layouts.py.)"""

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
    (lambda: torch_pallas.rms_norm(torch.randn(3, 5), (5,), casting_mode="Llama"), ValueError,
     "casting_mode='Llama'"),
    (lambda: torch_pallas.rms_norm(torch.randn(3, 5), (5,), casting_mode="gemma"), ValueError,
     "casting_mode='gemma' .* needs a weight"),
    (lambda: torch.ops.pallas.rms_norm_forward(torch.randn(3, 5), None, 1e-6, "t5"), ValueError,
     "rms_norm_forward: casting_mode='t5'"),
    (lambda: torch.ops.pallas.rms_norm_backward(torch.randn(3, 5), torch.randn(3, 5),
                                                torch.rand(3), None, "gemma"), ValueError,
     "rms_norm_backward: casting_mode='gemma' .* needs a weight"),
], ids=["shape", "weight", "float64", "int", "empty", "casting_mode", "gemma without weight",
        "forward op casting_mode", "backward op without weight"])
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
            _, rstd = torch.ops.pallas.rms_norm_forward(rows, w, 1e-6, "gemma")
            dx, dw = torch.ops.pallas.rms_norm_backward(dy, rows, rstd, w, "gemma")
            llama = torch_pallas.rms_norm(x, (x.shape[-1],), w.float(), casting_mode="llama")
            return out, dx, dw, llama
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


def test_compiled_casting_mode_equals_eager():
    """torch.compile(fullgraph) of "llama", forward and backward: its fakes'
    dtypes (a bfloat16 input with a float32 weight gives float32) and the
    backward's mode, through AOTAutograd."""
    x = torch.randn(2, 3, 40).to(torch.bfloat16)
    w = random_weight(40, torch.float32, "llama")

    def run(fn):
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        out = fn(xg, wg)
        return (out, *torch.autograd.grad(out.square().sum(), (xg, wg)))

    def norm(x, w):
        return torch_pallas.rms_norm(x, (40,), w, 1e-6, casting_mode="llama")

    eager, traced = run(norm), run(torch.compile(norm, backend="aot_eager", fullgraph=True))
    assert eager[0].dtype == torch.float32
    for e, t in zip(eager, traced):
        assert e.dtype == t.dtype and torch.equal(e, t)


# --- casting modes -------------------------------------------------------------

CASTING_MODES = ("none", "llama", "gemma")


def random_weight(shape, dtype, casting_mode):
    """Random, neither ones nor zeros: about 1, or about 0 for Gemma's
    weight (an offset from one)."""
    return (torch.randn(shape) * 0.5 + (0.0 if casting_mode == "gemma" else 1.0)).to(dtype)


def rounded_as_the_module(normalized, x_dtype, weight, casting_mode):
    """The mode's rounding applied to a float32 normalization, as the module
    writes it in torch (F.rms_norm's fused kernel rounds once: "none")."""
    if casting_mode == "llama":
        return normalized.to(x_dtype) if weight is None else weight * normalized.to(x_dtype)
    if casting_mode == "gemma":
        return (normalized * (1.0 + weight.float())).to(x_dtype)
    return (normalized if weight is None else normalized * weight.float()).to(x_dtype)


def check_rounding(x, weight, casting_mode, what):
    """The op's output equals, bit for bit and dtype, the mode's formula on
    the op's own float32 normalization (x * rstd, as its kernel has it),
    which does not depend on the mode. (It may on x's dtype: the Mosaic GPU
    simulator sums a bfloat16 tile's squares in another order than the same
    values' in float32.)"""
    eps = 1e-6
    out, rstd = torch.ops.pallas.rms_norm_forward(x, weight, eps, casting_mode)
    normalized = x.float() * rstd.unsqueeze(-1)
    expected = rounded_as_the_module(normalized, x.dtype, weight, casting_mode)
    assert out.dtype == expected.dtype, f"{what}: dtype {out.dtype}, the module's {expected.dtype}"
    bad = out != expected
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {out.numel()} differ, first at "
                           f"{bad.nonzero()[0].tolist()}: {out[bad][0]!r} != {expected[bad][0]!r}")
    composite = torch_pallas.rms_norm(x, (x.shape[-1],), weight, eps, casting_mode=casting_mode)
    assert torch.equal(composite, out), what
    unweighted, rstd_none = torch.ops.pallas.rms_norm_forward(x, None, eps, "none")
    assert torch.equal(rstd_none, rstd), f"{what}: 'none' normalizes otherwise"
    assert torch.equal(unweighted, normalized.to(x.dtype)), f"{what}: 'none' rounds otherwise"


@pytest.mark.parametrize("casting_mode", CASTING_MODES)
@pytest.mark.parametrize("weight_dtype", [*FLOAT_DTYPES, None], ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_casting_modes_round_as_the_modules_formulas_bit_for_bit(dtype, weight_dtype,
                                                                   casting_mode):
    if casting_mode == "gemma" and weight_dtype is None:
        with pytest.raises(ValueError, match="casting_mode='gemma' .* needs a weight"):
            torch_pallas.rms_norm(torch.randn(3, 8).to(dtype), (8,), None, casting_mode="gemma")
        return
    x = torch.randn(3, 5, 37).to(dtype) * 3
    weight = None if weight_dtype is None else random_weight(37, weight_dtype, casting_mode)
    check_rounding(x, weight, casting_mode, f"{casting_mode} x {dtype} weight {weight_dtype}")


def torch_module(x, weight, eps, casting_mode):
    """transformers' module as it computes, in torch (differentiable):
    LlamaRMSNorm's `weight * hidden.to(input_dtype)`, GemmaRMSNorm's
    `(output * (1.0 + weight.float())).type_as(x)`, F.rms_norm for "none"."""
    if casting_mode == "none":
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    normalized = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return rounded_as_the_module(normalized, x.dtype, weight, casting_mode)


def check_casting_gradients(x, weight, casting_mode, what):
    """dx and dw within twice the module's own error in its dtype (and a few
    roundings) of the float64 formula, the roundings the identity."""
    eps = 1e-6
    x = x.detach().requires_grad_()
    weight = None if weight is None else weight.detach().requires_grad_()
    inputs = (x,) if weight is None else (x, weight)
    out = torch_pallas.rms_norm(x, (x.shape[-1],), weight, eps, casting_mode=casting_mode)
    theirs_out = torch_module(x, weight, eps, casting_mode)
    assert out.dtype == theirs_out.dtype, what
    grad = torch.randn(out.shape).to(out.dtype)
    ours = torch.autograd.grad(out, inputs, grad)
    theirs = torch.autograd.grad(theirs_out, inputs, grad)
    grads64 = rms_norm_op._reference_gradients(x, weight, grad, eps, casting_mode)
    for name, g, t, g64 in zip(("input", "weight"), ours, theirs, grads64):
        assert g.dtype == t.dtype and g.shape == t.shape, f"{what} d{name}"
        scale = 1 if name == "input" else max(1, x.numel() // x.shape[-1]) ** 0.5
        assert_within(g, g64, gradient_bound(scale, t, g64, x.dtype), f"{what} d{name}")


# (input dtype, weight dtype): each dtype with its own, the 16-bit ones with
# a float32 weight ("llama" then returns float32)
WEIGHTINGS = [(dtype, dtype) for dtype in FLOAT_DTYPES] + [
    (torch.bfloat16, torch.float32), (torch.float16, torch.float32)]


@pytest.mark.parametrize("casting_mode", ["llama", "gemma"])
@pytest.mark.parametrize("dtype,weight_dtype", WEIGHTINGS + [(torch.bfloat16, None)], ids=str)
def test_casting_mode_gradients_match_float64(dtype, weight_dtype, casting_mode):
    if casting_mode == "gemma" and weight_dtype is None:
        with pytest.raises(ValueError, match="casting_mode='gemma' .* needs a weight"):
            torch_pallas.rms_norm(torch.randn(3, 8).to(dtype), (8,), None, casting_mode="gemma")
        return
    for shape in ((1, 7), (2, 3, 130)):  # ragged rows and widths, not multiples of 128
        weight = None if weight_dtype is None else random_weight(shape[-1], weight_dtype,
                                                                 casting_mode)
        check_casting_gradients(torch.randn(shape).to(dtype), weight, casting_mode,
                                f"{casting_mode} {shape} {dtype} weight {weight_dtype}")


def test_casting_modes_on_every_backend(cpu_backend):
    """Each kernel family's forward and backward in both models' modes, past
    a tile's width (70 > 64 columns) and with ragged rows."""
    x = torch.randn(5, 70).to(torch.bfloat16) * 3
    for casting_mode, weight_dtype in (("llama", torch.float32), ("gemma", torch.bfloat16)):
        weight = random_weight(70, weight_dtype, casting_mode)
        what = f"{cpu_backend} {casting_mode}"
        check_rounding(x, weight, casting_mode, what)
        check_casting_gradients(x, weight, casting_mode, what)
    check_rounding(x.half(), None, "llama", f"{cpu_backend} llama float16 without weight")


# transformers' modules against the op: bit-equal where the float32
# normalizations are, which is most elements but not all. The op divides,
# adds eps and takes 1 / sqrt as torch's CPU kernels do (the same bits), but
# its sum of squares adds in the kernel's order, and torch's CPU sum in its
# own (SumKernel.cpp's cascade over 8-lane vectors, 4 at a time; emulated in
# NumPy it gives torch's bits at every width tried, 7 to 11008): the float32
# normalizations differ in the last bit or two for 14-28% of elements
# (measured on each CPU backend at widths 64, 257, 4096). A 16-bit rounding
# hides that but where it falls on a rounding boundary: 1 element in 10^4 to
# 10^5 then differs by one unit of the input's dtype in the rounded
# normalization, which the weight carries into the output (up to two units
# of a 16-bit output, one of x's dtype scaled by |w| in a float32 one).
FLOAT32_EQUAL = 0.6  # measured 0.72-0.86
SIXTEEN_BIT_EQUAL = 0.999  # measured 0.99985-1


def units_in_the_last_place(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at each value of t (float64)."""
    tiny = torch.finfo(dtype).tiny
    exponent = torch.floor(torch.log2(t.double().abs().clamp_min(tiny)))
    return torch.exp2(exponent) * torch.finfo(dtype).eps


@pytest.mark.parametrize("width", [64, 257])
@pytest.mark.parametrize("dtype,weight_dtype", WEIGHTINGS, ids=str)
@pytest.mark.parametrize("casting_mode", ["llama", "gemma"])
def test_transformers_modules_bit_for_bit_but_the_sum_s_order(casting_mode, dtype, weight_dtype,
                                                                width):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    eps = 1e-6
    module = (LlamaRMSNorm if casting_mode == "llama" else GemmaRMSNorm)(width, eps=eps)
    with torch.no_grad():
        module.weight.copy_(random_weight(width, torch.float32, casting_mode))
    module = module.to(weight_dtype)
    x = (torch.randn(48, width) * 3).to(dtype)
    with torch.no_grad():
        expected = module(x)
        out = torch_pallas.rms_norm(x, (width,), module.weight, eps, casting_mode=casting_mode)
        h = x.float()
        normalized = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)  # the module's
    what = f"{casting_mode} x {dtype} weight {weight_dtype} width {width}"
    assert out.dtype == expected.dtype, what
    equal = (out == expected).double().mean().item()
    wanted = FLOAT32_EQUAL if dtype == torch.float32 else SIXTEEN_BIT_EQUAL
    assert equal >= wanted, f"{what}: {equal:.5f} of the elements equal"
    # How far the rest may be: the normalization a few float32 units apart
    # (1e-6 relative covers the sum's order at these widths), then, where x
    # is 16-bit, one unit of x's dtype in "llama"'s rounded normalization,
    # times the weight; and the output's own rounding.
    factor = module.weight.detach().double()
    factor = 1 + factor if casting_mode == "gemma" else factor
    bound = (1e-6 * (normalized.double() * factor).abs()
             + units_in_the_last_place(expected, out.dtype))
    if casting_mode == "llama" and dtype != torch.float32:
        bound = bound + units_in_the_last_place(normalized, dtype) * factor.abs()
    assert_within(out, expected, bound, what)


@pytest.mark.slow
def test_triton_kernels_compile_for_the_gpu_in_every_casting_mode():
    """The Triton kernels compile for a Hopper GPU as the launchers call them
    (tests/triton_builds.py; the interpreter type-checks nothing), forward
    and backward, in each casting mode: the bfloat16 rounding by bits, the
    constexpr dtype it is given, the weight's offset."""
    import triton_builds

    result = triton_builds.run_subprocess(None, check="rms_norm_casting_modes", timeout=600)
    assert triton_builds.launched(result) == {
        (kernel, dtype) for kernel in ("rms_norm_kernel", "rms_norm_backward_kernel")
        for dtype in ("bfloat16", "float16")}, result["kernels"]
