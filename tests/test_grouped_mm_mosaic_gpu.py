"""The Hopper grouped matmul kernels (kernels/mosaic_gpu/grouped_mm.py over
ragged rows, grouped_mm_backward.py contracting over them).

- Simulated (Mosaic GPU interpret mode, `mosaic_gpu_interpret`): every form
  of the op, values and gradients against the float64 reference
  (test_grouped_mm.check_values / check_gradients), on small ragged calls
  that still span several row, K and N tiles, with empty groups first, in
  the middle and last, rows past the last group (their incoming gradient
  NaN), a row tile shared by several groups, weights read in place; and the
  kernels called directly with small tiles, NaN in the rows past the last
  group of both operands.
- Lowered for sm_90a (no GPU): both kernels in both 16-bit dtypes, weights
  either way, with and without a bias, 16-bit and float32 outputs, ragged
  M, N, K, several configs: what the simulator skips (wgmma layouts and
  transposes, TMA and swizzles, register layouts of the masks, the SMEM
  budget, the MLIR verifier). float32 (TF32 on the Tensor Cores) is refused
  by name on the hardware.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import torch_pallas
from test_grouped_mm import check_gradients, check_values, offs_of, random
from test_mosaic_gpu_lowering import aval, lower_for_hopper
from torch_pallas.base import jax_env
from torch_pallas.kernels.mosaic_gpu import grouped_mm as forward
from torch_pallas.kernels.mosaic_gpu import grouped_mm_backward as backward

SIMULATOR = "mosaic_gpu_interpret"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture(autouse=True)
def simulated():
    with torch_pallas.backend(SIMULATOR):
        yield


# --- the op's forms, simulated ---------------------------------------------

@pytest.mark.parametrize("dtype", [BF16, pytest.param(F16, marks=pytest.mark.exhaustive)])
def test_experts_form_spanning_tiles(dtype):
    """M past one 128-row tile, K three 64-wide steps, N two 128 tiles;
    weights stored (G, N, K) and passed transposed, a bias, empty groups
    first, in the middle and last, a row tile shared by four groups, rows
    past the last group (zero out, zero gradient)."""
    sizes, tail = [0, 3, 2, 0, 90, 41, 0], 5
    m, k, n, groups = sum(sizes) + tail, 150, 140, len(sizes)
    mat_a = random((m, k), dtype, True)
    weight = random((groups, n, k), dtype, True)
    bias = random((groups, n), dtype, True)
    offs = offs_of(sizes)
    out = torch_pallas.grouped_mm(mat_a, weight.mT, offs=offs, bias=bias)
    check_values(out, mat_a, weight.mT, f"{dtype}", offs=offs, bias=bias)
    assert (out[-tail:] == 0).all(), "rows past the last group are zero"
    check_gradients(mat_a, weight.mT, f"{dtype}", tail=tail, offs=offs, bias=bias)


def test_contiguous_weights_int64_offs_float32_out():
    """Weights (G, K, N) as they lie, int64 offs, out_dtype float32."""
    sizes = [20, 0, 25, 1]
    mat_a, mat_b = random((50, 40), BF16, True), random((4, 40, 20), BF16, True)
    bias = random((4, 20), F32, True)
    offs = offs_of(sizes, torch.int64)
    kwargs = dict(offs=offs, bias=bias, out_dtype=F32)
    out = torch_pallas.grouped_mm(mat_a, mat_b, **kwargs)
    assert out.dtype == F32
    check_values(out, mat_a, mat_b, "bfloat16 -> float32", **kwargs)
    check_gradients(mat_a, mat_b, "bfloat16 -> float32", tail=4, **kwargs)


def test_float32_is_exact_in_the_simulator():
    """float32 (refused on the hardware: TF32) multiplies exactly here."""
    mat_a, weight = random((30, 17), F32, True), random((3, 9, 17), F32, True)
    offs = offs_of([11, 0, 16])
    out = torch_pallas.grouped_mm(mat_a, weight.mT, offs=offs)
    check_values(out, mat_a, weight.mT, "float32", offs=offs)
    check_gradients(mat_a, weight.mT, "float32", tail=3, offs=offs)


def test_batched_weight_gradient_and_columns_forms():
    """3-D x 3-D with a bias, 2-D x 2-D with an empty group and K past the
    last, 3-D x 2-D: each on the two kernels, gradients included."""
    a3, b3, bias3 = random((3, 13, 29), F16, True), random((3, 29, 11), F16, True), \
        random((3, 11), F16, True)
    out = torch_pallas.grouped_mm(a3, b3, bias=bias3)
    check_values(out, a3, b3, "3-D x 3-D", bias=bias3)
    check_gradients(a3, b3, "3-D x 3-D", bias=bias3)
    sizes = [7, 0, 19]
    a2, b2 = random((9, 30), BF16, True), random((30, 13), BF16, True)
    offs = offs_of(sizes)
    out = torch_pallas.grouped_mm(a2, b2, offs=offs)
    check_values(out, a2, b2, "2-D x 2-D", offs=offs)
    assert (out[1] == 0).all(), "an empty group's block is exact zero"
    check_gradients(a2, b2, "2-D x 2-D", offs=offs)
    ac, bc = random((3, 6, 10), BF16, True), random((10, 25), BF16, True)
    offs = offs_of([4, 0, 16])
    out = torch_pallas.grouped_mm(ac, bc, offs=offs)
    check_values(out, ac, bc, "3-D x 2-D", offs=offs)
    check_gradients(ac, bc, "3-D x 2-D", offs=offs)


def test_every_group_empty():
    """offs all 0: the output zero, mat_b's and bias's gradients exact zero."""
    mat_a, weight = random((12, 16), BF16, True), random((3, 8, 16), BF16, True)
    bias = random((3, 8), BF16, True)
    offs = offs_of([0, 0, 0])
    out = torch_pallas.grouped_mm(mat_a, weight.mT, offs=offs, bias=bias)
    assert (out == 0).all()
    grads = torch.autograd.grad(out, (mat_a, weight, bias), torch.randn(out.shape).to(BF16))
    assert all((g == 0).all() for g in grads)


# --- the kernels, simulated with small tiles -------------------------------

def _interpret():
    return jax_env.gpu_interpret_params(detect_races=False)


SMALL_FORWARD = forward.GroupedMatmulConfig(tile_m=64, tile_n=64, max_concurrent_steps=3)
SMALL_BACKWARD = backward.ContractionConfig(tile_rows=64, tile_k=64, tile_n=64)


def _ends(sizes):
    return np.cumsum(sizes).astype(np.int32)


def _group_rows(ends, rows):
    bounds = [0, *ends.tolist()]
    return [(s, e) for s, e in zip(bounds[:-1], bounds[1:])] + [(bounds[-1], rows)]


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_forward_kernel_with_small_tiles(transpose_rhs):
    """Tiles of 64 rows: groups spanning three row tiles, tiles shared by
    two and three groups, NaN in lhs past the last group (zero out)."""
    sizes = [10, 0, 100, 7, 3, 0]
    m, k, n, groups = 140, 70, 100, len(sizes)
    ends = _ends(sizes)
    lhs = torch.randn(m, k).numpy()
    lhs[ends[-1]:] = np.nan
    rhs = torch.randn(groups, *((n, k) if transpose_rhs else (k, n))).numpy()
    bias = torch.randn(groups, n).numpy()
    out = jax.device_get(forward.grouped_mm(
        jax.numpy.asarray(lhs, "bfloat16"), jax.numpy.asarray(rhs, "bfloat16"), ends, bias,
        transpose_rhs=transpose_rhs, out_dtype="float32", config=SMALL_FORWARD,
        interpret=_interpret()))
    a = np.asarray(jax.numpy.asarray(lhs, "bfloat16"), np.float64)
    w = np.asarray(jax.numpy.asarray(rhs, "bfloat16"), np.float64)
    w = w.transpose(0, 2, 1) if transpose_rhs else w
    for g, (s, e) in enumerate(_group_rows(ends, m)):
        want = a[s:e] @ w[g] + bias[g] if g < groups else np.zeros((e - s, n))
        np.testing.assert_allclose(out[s:e], want, rtol=1e-5, atol=1e-4, err_msg=f"group {g}")


def test_backward_kernel_with_small_tiles():
    """Row tiles of 64: a group spanning three tiles, groups sharing edge
    tiles, empty groups, NaN in both operands past the last group (never in
    the sums)."""
    sizes = [0, 10, 100, 0, 7, 3]
    m, k, n = 140, 100, 70
    ends = _ends(sizes)
    lhs, rhs = torch.randn(m, k).numpy(), torch.randn(m, n).numpy()
    lhs[ends[-1]:] = np.nan
    rhs[ends[-1] + 2:] = np.nan
    lhs16, rhs16 = (jax.numpy.asarray(x, "float16") for x in (lhs, rhs))
    out = jax.device_get(backward.grouped_mm_backward(
        lhs16, rhs16, ends, out_dtype="float32", config=SMALL_BACKWARD, interpret=_interpret()))
    a, b = (np.asarray(x, np.float64) for x in (lhs16, rhs16))
    for g, (s, e) in enumerate(_group_rows(ends, m)[:-1]):
        np.testing.assert_allclose(out[g], a[s:e].T @ b[s:e], rtol=1e-5, atol=1e-4,
                                   err_msg=f"group {g}")
        if s == e:
            assert (out[g] == 0).all(), f"empty group {g} is exact zero"


def test_tile_groups():
    """Each row tile's first and last group (first > last: none)."""
    ends = jax.numpy.asarray([3, 3, 9, 12], jax.numpy.int32)  # sizes 3, 0, 6, 3
    got = np.asarray(forward.tile_groups(ends, 16, 4))
    # tile 0 (rows 0-3): groups 0..2; tile 1 (4-7): 2; tile 2 (8-11): 2..3; tile 3: none
    np.testing.assert_array_equal(got, [[0, 2, 2, 4], [2, 2, 3, 3]])


# --- the hardware: lowered for sm_90a, float32 refused --------------------

FORWARD_CONFIGS = [forward.GroupedMatmulConfig(),
                   forward.GroupedMatmulConfig(tile_m=64, tile_n=128, max_concurrent_steps=4),
                   forward.GroupedMatmulConfig(tile_m=128, tile_n=64, max_concurrent_steps=3)]
BACKWARD_CONFIGS = [backward.ContractionConfig(),
                    backward.ContractionConfig(tile_rows=128, tile_k=64, tile_n=128,
                                               max_concurrent_steps=3),
                    backward.ContractionConfig(tile_rows=64, tile_k=128, tile_n=64,
                                               max_concurrent_steps=4)]
SHAPES = [(1000, 999, 1001, 8), (4096, 1024, 768, 8), (37, 24, 20, 4)]  # M, K, N, G


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("config", FORWARD_CONFIGS, ids=str)
def test_forward_lowers(dtype, config):
    for i, (m, k, n, groups) in enumerate(SHAPES):
        for transpose_rhs in (False, True):
            has_bias = (i + transpose_rhs) % 2 == 0
            out_dtype = "float32" if i == 1 else dtype

            def run(lhs, rhs, ends, *bias, transpose_rhs=transpose_rhs, out_dtype=out_dtype):
                return forward.grouped_mm(lhs, rhs, ends, *bias, transpose_rhs=transpose_rhs,
                                          out_dtype=out_dtype, config=config, interpret=None)

            rhs_shape = (groups, n, k) if transpose_rhs else (groups, k, n)
            avals = [aval((m, k), dtype), aval(rhs_shape, dtype), aval((groups,), "int32")]
            lower_for_hopper(run, *avals, *([aval((groups, n), "float32")] if has_bias else []))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("config", BACKWARD_CONFIGS, ids=str)
def test_backward_lowers(dtype, config):
    for i, (m, k, n, groups) in enumerate(SHAPES):
        out_dtype = "float32" if i == 1 else dtype

        def run(lhs, rhs, ends, out_dtype=out_dtype):
            return backward.grouped_mm_backward(lhs, rhs, ends, out_dtype=out_dtype,
                                                config=config, interpret=None)

        lower_for_hopper(run, aval((m, k), dtype), aval((m, n), dtype), aval((groups,), "int32"))


def test_float32_is_refused_on_the_hardware_by_name():
    for kernel in (forward, backward):
        avals = (((64, 32), "float32"), ((2, 32, 16), "float32"), ((2,), "int32"))
        assert "TF32" in kernel.KERNEL.refusal("mosaic_gpu", avals, {"transpose_rhs": False})
        assert kernel.KERNEL.refusal(SIMULATOR, avals, {"transpose_rhs": False}) is None
        assert kernel.KERNEL.refusal("mosaic_gpu", (((64, 32), "bfloat16"),) + avals[1:],
                                     {"transpose_rhs": False}) is None
    with pytest.raises(ValueError, match="grouped_mm: float32 cannot run on wgmma"):
        lower_for_hopper(lambda a, b, e: forward.grouped_mm(
            a, b, e, transpose_rhs=False, out_dtype="float32",
            config=forward.GroupedMatmulConfig(), interpret=None),
            aval((64, 32), "float32"), aval((2, 32, 16), "float32"), aval((2,), "int32"))
    with pytest.raises(ValueError, match="grouped_mm_backward: float32 cannot run on wgmma"):
        lower_for_hopper(lambda a, b, e: backward.grouped_mm_backward(
            a, b, e, out_dtype="float32", config=backward.ContractionConfig(), interpret=None),
            aval((64, 32), "float32"), aval((64, 16), "float32"), aval((2,), "int32"))



def test_no_races():
    """JAX's race detector on both kernels, their pipelines longer than
    their slots (K, and a group's row tiles, in 4 steps of 2 slots) with
    the masked edge tiles of the backward, a bias staged per group and a
    row tile shared by three groups."""
    sizes = [3, 150, 0, 50]
    mat_a = random((210, 200), BF16, True)
    weight = random((4, 20, 200), BF16, True)
    bias = random((4, 20), BF16, True)
    with torch_pallas.race_detection():
        out = torch_pallas.grouped_mm(mat_a, weight.mT, offs=offs_of(sizes), bias=bias)
        grads = torch.autograd.grad(out, (mat_a, weight, bias), torch.randn(out.shape).to(BF16))
    assert all(g.isfinite().all() for g in grads)
