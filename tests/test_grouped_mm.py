"""torch_pallas.grouped_mm against its float64 definition and torch's
F.grouped_mm: every form (2-D x 3-D, 3-D x 3-D, 2-D x 2-D, 3-D x 2-D),
every dtype and out_dtype, bias, int32 and int64 offs, empty groups in
every position, rows past the last group, M = 0; gradients of mat_a, mat_b
and bias (the incoming gradient NaN past the last group must not leak);
weights read in place as transformers passes them; forward-mode AD;
torch.compile; every CPU backend; bad arguments refused by name. (opcheck
and the fakes: tests/test_opcheck.py; the simulators of each family at
length: tests/test_grouped_mm_mosaic_gpu.py, tests/test_grouped_mm_triton.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_pallas
from helpers import FLOAT_DTYPES, assert_within
from torch_pallas.base import dtypes
from torch_pallas.ops import grouped_mm as op

# Group sizes: ragged, an empty group first, in the middle and last, one
# group holding everything, and rows past the last group.
SIZES = {
    "ragged": [5, 17, 9, 2],
    "empty-first-middle-last": [0, 11, 0, 23, 0],
    "one-group": [40],
    "all-empty": [0, 0, 0],
}


def offs_of(sizes, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(dtype)


def random(shape, dtype, requires_grad=False) -> torch.Tensor:
    return torch.randn(shape).to(dtype).requires_grad_(requires_grad)


def check_values(out, mat_a, mat_b, what, **kwargs):
    ref = op.reference(mat_a.detach(), mat_b.detach(), **kwargs)
    assert out.shape == ref.shape, what
    k = mat_a.shape[-1] if mat_a.dim() == 3 or mat_b.dim() == 3 else mat_a.shape[1]
    assert_within(out, ref, op.error_bound(mat_a, ref, k, kwargs.get("out_dtype")), what)


def check_gradients(mat_a, mat_b, what, tail=0, **kwargs):
    """Gradients of mat_a, mat_b (and bias) against float64 autograd of the
    reference, with an incoming gradient that is NaN on the `tail` rows past
    the last group. The bound: one rounding of each gradient, float32
    accumulation over the terms' magnitudes (the same autograd on |inputs|
    and |grad|), and, for a float32 output of 16-bit inputs, the one
    rounding of the incoming gradient to the inputs' dtype."""
    out = torch_pallas.grouped_mm(mat_a, mat_b, **kwargs)
    grad = torch.randn(out.shape).to(out.dtype)
    if tail:
        grad[-tail:] = float("nan")
    wrt = [t for t in (mat_a, mat_b, kwargs.get("bias")) if t is not None]
    ours = torch.autograd.grad(out, wrt, grad)
    clean = grad.double().nan_to_num(0.0)
    theirs = _reference_gradients(wrt, clean, kwargs, magnitudes=False)
    sizes = _reference_gradients(wrt, clean, kwargs, magnitudes=True)
    narrowed = dtypes.ROUNDING[mat_a.dtype] if out.dtype != mat_a.dtype else 0.0
    for name, g, t, size, x in zip(("mat_a", "mat_b", "bias"), ours, theirs, sizes, wrt):
        assert g.dtype == x.dtype and g.shape == x.shape, f"{what} d{name}"
        if tail and name == "mat_a" and mat_a.dim() == 2 and mat_b.dim() == 3:
            assert (g[-tail:] == 0).all(), f"{what}: rows past the last group get zero gradient"
        terms = max(out.shape[0] if name != "mat_a" else out.shape[-1], 1)
        bound = (dtypes.ROUNDING[x.dtype] * t.abs()
                 + (narrowed + 4 * terms * 2.0**-24) * size + 1e-6)
        assert_within(g, t, bound, f"{what} d{name}")


def _reference_gradients(wrt, grad, kwargs, magnitudes: bool):
    """float64 autograd of the reference (of |inputs| and |grad| when
    `magnitudes`: each gradient's sum of its terms' magnitudes)."""
    leaves = [(t.detach().double().abs() if magnitudes else t.detach().double())
              .requires_grad_() for t in wrt]
    ref_kwargs = dict(kwargs, bias=leaves[2] if len(leaves) == 3 else None)
    ref = op.reference(leaves[0], leaves[1], **ref_kwargs)
    return torch.autograd.grad(ref, leaves, grad.abs() if magnitudes else grad)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("sizes", list(SIZES.values()), ids=list(SIZES))
def test_experts_form_values_and_gradients(sizes, dtype):
    """2-D x 3-D with weights stored (G, N, K), passed transposed as
    transformers passes them, a bias, and 6 rows past the last group."""
    tail = 6
    m, k, n, groups = sum(sizes) + tail, 24, 19, len(sizes)
    mat_a = random((m, k), dtype, True)
    weight = random((groups, n, k), dtype, True)
    bias = random((groups, n), dtype, True)
    offs = offs_of(sizes)
    out = torch_pallas.grouped_mm(mat_a, weight.mT, offs=offs, bias=bias)
    assert out.dtype == dtype
    check_values(out, mat_a, weight.mT, f"{sizes} {dtype}", offs=offs, bias=bias)
    assert (out[-tail:] == 0).all(), "rows past the last group are zero"
    check_gradients(mat_a, weight.mT, f"{sizes} {dtype}", tail=tail, offs=offs, bias=bias)


@pytest.mark.parametrize("layout", ["contiguous", "transposed-view"])
def test_experts_form_without_bias_int64_offs(layout):
    sizes = [7, 0, 30, 1]
    mat_a = random((40, 33), torch.float32, True)
    mat_b = (random((4, 33, 21), torch.float32) if layout == "contiguous"
             else random((4, 21, 33), torch.float32).mT).requires_grad_()
    offs = offs_of(sizes, torch.int64)
    out = torch_pallas.grouped_mm(mat_a, mat_b, offs=offs)
    check_values(out, mat_a, mat_b, layout, offs=offs)
    check_gradients(mat_a, mat_b, layout, tail=2, offs=offs)


def test_batched_form():
    for dtype in FLOAT_DTYPES:
        mat_a, mat_b = random((3, 13, 29), dtype, True), random((3, 29, 11), dtype, True)
        bias = random((3, 11), dtype, True)
        out = torch_pallas.grouped_mm(mat_a, mat_b, bias=bias)
        check_values(out, mat_a, mat_b, f"3-D x 3-D {dtype}", bias=bias)
        check_gradients(mat_a, mat_b, f"3-D x 3-D {dtype}", bias=bias)


@pytest.mark.parametrize("sizes", [[7, 0, 19, 4], [0, 0], [30]], ids=str)
def test_weight_gradient_form(sizes):
    """2-D x 2-D: offs over the shared K, result (G, M, N); K past the last
    group ignored."""
    k = sum(sizes) + 3
    mat_a, mat_b = random((9, k), torch.float32, True), random((k, 13), torch.float32, True)
    offs = offs_of(sizes)
    bias = random((len(sizes), 13), torch.float32, True)
    out = torch_pallas.grouped_mm(mat_a, mat_b, offs=offs, bias=bias)
    check_values(out, mat_a, mat_b, f"2-D x 2-D {sizes}", offs=offs, bias=bias)
    check_gradients(mat_a, mat_b, f"2-D x 2-D {sizes}", offs=offs, bias=bias)


def test_columns_form():
    """3-D x 2-D: offs over mat_b's columns, result (M, N); columns past
    the last group zero."""
    sizes = [4, 0, 16]
    mat_a, mat_b = random((3, 6, 10), torch.bfloat16, True), random((10, 25), torch.bfloat16, True)
    offs = offs_of(sizes)
    out = torch_pallas.grouped_mm(mat_a, mat_b, offs=offs)
    check_values(out, mat_a, mat_b, "3-D x 2-D", offs=offs)
    assert (out[:, 20:] == 0).all()
    check_gradients(mat_a, mat_b, "3-D x 2-D", offs=offs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float32_output_of_16_bit_inputs(dtype):
    """out_dtype=float32: one rounding fewer; differentiable, gradients in
    the inputs' dtype."""
    mat_a, mat_b = random((50, 40), dtype, True), random((3, 40, 20), dtype, True)
    bias = random((3, 20), torch.float32, True)
    offs = offs_of([20, 0, 25])
    out = torch_pallas.grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    check_values(out, mat_a, mat_b, f"{dtype} -> float32", offs=offs, bias=bias,
                 out_dtype=torch.float32)
    grads = torch.autograd.grad(out.sum(), (mat_a, mat_b, bias))
    assert [g.dtype for g in grads] == [dtype, dtype, torch.float32]
    check_gradients(mat_a, mat_b, f"{dtype} -> float32", offs=offs, bias=bias,
                    out_dtype=torch.float32)


def test_equals_torchs_grouped_mm_where_torch_runs():
    """torch's CPU F.grouped_mm: float32, int32 offs, no bias; its rows past
    offs[-1] are unspecified, so compare the groups' rows."""
    offs = offs_of([16, 0, 24, 8])
    mat_a = torch.randn(56, 32)
    weight = torch.randn(4, 48, 32)
    ours = torch_pallas.grouped_mm(mat_a, weight.mT, offs=offs)
    theirs = F.grouped_mm(mat_a, weight.mT, offs=offs)
    torch.testing.assert_close(ours[:48], theirs[:48], rtol=1e-5, atol=1e-5)
    a3, b3 = torch.randn(2, 8, 16), torch.randn(2, 16, 24)
    torch.testing.assert_close(torch_pallas.grouped_mm(a3, b3), F.grouped_mm(a3, b3),
                               rtol=1e-5, atol=1e-5)


def test_empty_rows_and_groups_give_exact_zero_gradients():
    """M = 0, and every group empty: mat_b's and bias's gradients are
    exactly 0 (not NaN, not skipped)."""
    for m, sizes in ((0, [0, 0]), (5, [0, 0])):
        mat_a = random((m, 8), torch.float32, True)
        mat_b, bias = random((2, 8, 3), torch.float32, True), random((2, 3), torch.float32, True)
        out = torch_pallas.grouped_mm(mat_a, mat_b, offs=offs_of(sizes), bias=bias)
        assert out.shape == (m, 3) and (out == 0).all()
        grad = torch.randn(out.shape)
        grad[:] = float("nan")  # every row is past the last group
        da, db, dbias = torch.autograd.grad(out, (mat_a, mat_b, bias), grad)
        assert (db == 0).all() and (dbias == 0).all() and (da == 0).all()


def test_weights_are_read_in_place():
    """The transposed view of (G, N, K) weights reaches the kernel as those
    weights (no copy), and their gradient comes back in their layout."""
    weight = torch.randn(3, 10, 7, requires_grad=True)
    rhs, transposed = op._weights(weight.mT)
    assert transposed and rhs.data_ptr() == weight.data_ptr()
    out = torch_pallas.grouped_mm(torch.randn(12, 7), weight.mT, offs=offs_of([4, 4, 4]))
    out.sum().backward()
    assert weight.grad.is_contiguous()


def test_forward_mode_ad():
    mat_a, mat_b = torch.randn(20, 9), torch.randn(3, 9, 5)
    bias = torch.randn(3, 5)
    offs = offs_of([6, 0, 11])
    tangents = (torch.randn_like(mat_a), torch.randn_like(mat_b), torch.randn_like(bias))

    def ours(a, b, c):
        return torch_pallas.grouped_mm(a, b, offs=offs, bias=c)

    def reference(a, b, c):
        return op.reference(a, b, offs=offs, bias=c)

    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        duals = [fwAD.make_dual(p, t) for p, t in zip((mat_a, mat_b, bias), tangents)]
        tangent = fwAD.unpack_dual(ours(*duals)).tangent
    _, expected = torch.func.jvp(reference, tuple(t.double() for t in (mat_a, mat_b, bias)),
                                 tuple(t.double() for t in tangents))
    torch.testing.assert_close(tangent.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(dynamic):
    """An MoE step's products under torch.compile(fullgraph=True): the
    check of offs' values is not traced; values and gradients as eager."""

    def step(x, w, offs):
        return torch_pallas.grouped_mm(x, w.mT, offs=offs).square().sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
    for m in (30, 45):
        x = torch.randn(m, 16, requires_grad=True)
        w = torch.randn(4, 12, 16, requires_grad=True)
        offs = offs_of([m // 3, 0, m // 3, m - 2 * (m // 3)])
        loss = compiled(x, w, offs)
        grads = torch.autograd.grad(loss, (x, w))
        expected = torch.autograd.grad(step(x, w, offs), (x, w))
        for g, e in zip(grads, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_every_backend(cpu_backend):
    """Each CPU backend on a small ragged experts call with a bias and its
    gradients (each family's simulators at length in its own file)."""
    sizes = [3, 0, 10, 5]
    mat_a = random((21, 20), torch.bfloat16, True)
    weight = random((4, 12, 20), torch.bfloat16, True)
    bias = random((4, 12), torch.bfloat16, True)
    offs = offs_of(sizes)
    out = torch_pallas.grouped_mm(mat_a, weight.mT, offs=offs, bias=bias)
    check_values(out, mat_a, weight.mT, cpu_backend, offs=offs, bias=bias)
    check_gradients(mat_a, weight.mT, cpu_backend, tail=3, offs=offs, bias=bias)


BAD = {
    "offs decreasing": (lambda: (torch.randn(9, 4), torch.randn(2, 4, 3)),
                        dict(offs=torch.tensor([5, 2], dtype=torch.int32)), ValueError, "offs"),
    "offs negative": (lambda: (torch.randn(9, 4), torch.randn(2, 4, 3)),
                      dict(offs=torch.tensor([-1, 2], dtype=torch.int32)), ValueError, "offs"),
    "offs past the rows": (lambda: (torch.randn(9, 4), torch.randn(2, 4, 3)),
                           dict(offs=torch.tensor([3, 10], dtype=torch.int32)), ValueError,
                           "offs"),
    "offs past K": (lambda: (torch.randn(3, 9), torch.randn(9, 2)),
                    dict(offs=torch.tensor([3, 10], dtype=torch.int32)), ValueError, "offs"),
    "offs float": (lambda: (torch.randn(9, 4), torch.randn(2, 4, 3)),
                   dict(offs=torch.tensor([1.0, 2.0])), TypeError, "offs"),
    "offs 2-D": (lambda: (torch.randn(9, 4), torch.randn(2, 4, 3)),
                 dict(offs=torch.tensor([[1, 2]], dtype=torch.int32)), ValueError, "offs"),
    "offs missing": (lambda: (torch.randn(9, 4), torch.randn(2, 4, 3)), {}, ValueError, "offs"),
    "offs for 3-D x 3-D": (lambda: (torch.randn(2, 9, 4), torch.randn(2, 4, 3)),
                           dict(offs=torch.tensor([1, 2], dtype=torch.int32)), ValueError,
                           "offs"),
    "group count": (lambda: (torch.randn(9, 4), torch.randn(3, 4, 3)),
                    dict(offs=torch.tensor([1, 2], dtype=torch.int32)), RuntimeError, "groups"),
    "K mismatch": (lambda: (torch.randn(9, 4), torch.randn(2, 5, 3)),
                   dict(offs=torch.tensor([1, 2], dtype=torch.int32)), RuntimeError, "mat_a"),
    "rank": (lambda: (torch.randn(9), torch.randn(2, 9, 3)),
             dict(offs=torch.tensor([1, 2], dtype=torch.int32)), ValueError, "mat_a"),
    "dtypes differ": (lambda: (torch.randn(9, 4), torch.randn(2, 4, 3).double()),
                      dict(offs=torch.tensor([1, 2], dtype=torch.int32)), TypeError, "mat_b"),
    "float64": (lambda: (torch.randn(9, 4).double(), torch.randn(2, 4, 3).double()),
                dict(offs=torch.tensor([1, 2], dtype=torch.int32)), TypeError, "mat_a"),
    "bias shape": (lambda: (torch.randn(9, 4), torch.randn(2, 4, 3)),
                   dict(offs=torch.tensor([1, 2], dtype=torch.int32), bias=torch.randn(3)),
                   ValueError, "bias"),
    "narrowing out_dtype": (lambda: (torch.randn(9, 4), torch.randn(2, 4, 3)),
                            dict(offs=torch.tensor([1, 2], dtype=torch.int32),
                                 out_dtype=torch.bfloat16), TypeError, "out_dtype"),
}


@pytest.mark.parametrize("case", list(BAD.values()), ids=list(BAD))
def test_bad_arguments_raise_naming_the_op_and_the_argument(case):
    make, kwargs, error, argument = case
    mat_a, mat_b = make()
    with pytest.raises(error, match=rf"grouped_mm.*{argument}|{argument}.*grouped_mm"):
        torch_pallas.grouped_mm(mat_a, mat_b, **kwargs)


def test_offs_values_are_checked_inside_the_op_not_in_its_fake():
    """The fake (what torch.compile traces) checks shapes only; the op checks
    values before its kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.pallas.grouped_mm(torch.randn(9, 4), torch.randn(2, 4, 3),
                                          torch.tensor([5, 2], dtype=torch.int32))
    assert out.shape == (9, 3)
    with pytest.raises(ValueError, match="non-decreasing"):
        torch.ops.pallas.grouped_mm(torch.randn(9, 4), torch.randn(2, 4, 3),
                                    torch.tensor([5, 2], dtype=torch.int32))


def test_rounding_is_once_in_16_bit():
    """bfloat16 results within one rounding of the float64 value (plus
    float32 accumulation), the bound every dtype test above uses."""
    mat_a, mat_b = random((64, 256), torch.bfloat16), random((2, 256, 32), torch.bfloat16)
    out = torch_pallas.grouped_mm(mat_a, mat_b, offs=offs_of([30, 34]))
    ref = op.reference(mat_a, mat_b, offs=offs_of([30, 34]))
    rel = ((out.double() - ref).abs() / ref.abs().clamp_min(1e-3)).median()
    assert rel <= dtypes.ROUNDING[torch.bfloat16]


def test_tpu_pipeline_tiles_inside_and_across_groups():
    """The TPU kernels' pipelines (the simulator's 128-row tiles) where
    groups span whole tiles as well as share them: the weight gradient
    takes a tile wholly inside its group unmasked and masks the others;
    NaN past the last group must reach neither gradient."""
    sizes = [300, 5, 0, 211]
    mat_a = random((526, 40), torch.float32, True)
    weight = random((4, 40, 24), torch.float32, True)
    offs = offs_of(sizes)
    with torch_pallas.backend("tpu_interpret"):
        out = torch_pallas.grouped_mm(mat_a, weight, offs=offs)
        check_values(out, mat_a, weight, "tpu_interpret", offs=offs)
        check_gradients(mat_a, weight, "tpu_interpret", tail=10, offs=offs)


@pytest.mark.parametrize("dim, block, expected", [
    (1792, 1024, 896),   # Mixtral's columns per expert: two tiles, none padded
    (4096, 1024, 1024),
    (300, 1024, 384),    # one tile, rounded up to the lanes
    (11008, 1024, 1024),  # no divisor down to 512: padded to 11264
])
def test_chip_tiles_divide_their_dimension_where_they_can(dim, block, expected):
    from torch_pallas.kernels.shapes import fitted_block

    assert fitted_block(dim, block, 128) == expected
