"""The Triton grouped_mm kernels (kernels/triton/grouped_mm.py, ragged rows,
and grouped_mm_backward.py, the ragged contraction), in Triton's CPU
interpreter where there is no GPU (conftest.py): values and gradients of the
op on the triton backend against the float64 definition (ragged groups,
empty groups first, in the middle and last, rows past the last group with a
NaN incoming gradient, weights stored (G, K, N) or (G, N, K), a bias,
every dtype, out_dtype float32, the 2-D x 2-D form); small tiles, so groups
span and share many row tiles; the visit table; both kernels compiled for
sm_90; and their launches as torch.compile records them on CUDA tensors."""

from __future__ import annotations

import pytest
import torch

import torch_pallas
from helpers import FLOAT_DTYPES, assert_within, fake_cuda_trace
from test_grouped_mm import check_gradients, check_values, offs_of, random
from torch_pallas.base import torch_compat
from torch_pallas.kernels.triton import grouped_mm as forward_kernel
from torch_pallas.kernels.triton import grouped_mm_backward as backward_kernel
from torch_pallas.kernels.triton import interpreting
from torch_pallas.ops import grouped_mm as op

# Where the kernels run: Triton's CPU interpreter (conftest.py sets it where
# there is no GPU), else the GPU.
DEVICE = torch.device("cpu" if interpreting() else "cuda")

# Group sizes with rows past the last group: groups within one 64-row tile,
# a group over three tiles, empty groups first, in the middle and last.
SIZES = {
    "ragged": [5, 17, 70, 2],
    "empty-first-middle-last": [0, 11, 0, 80, 0],
    "all-empty": [0, 0],
}
TAIL = 6  # rows past the last group

# Tiles of 16: every group spans or shares several row tiles.
SMALL = forward_kernel.GroupedMatmulConfig(autotune=False, block_m=16, block_n=16, block_k=16)


@pytest.fixture(autouse=True)
def _triton():
    with torch_pallas.backend("triton"):
        yield


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("sizes", list(SIZES.values()), ids=list(SIZES))
@pytest.mark.parametrize("stored", ["GNK", "GKN"])
def test_experts_form_values_and_gradients(stored, sizes, dtype):
    """2-D x 3-D with a bias: weights stored (G, N, K) and passed transposed
    (transpose_rhs, read in place) or stored (G, K, N); rows past the last
    group zero, their NaN gradient kept out of dB and dbias."""
    m, k, n, groups = sum(sizes) + TAIL, 40, 33, len(sizes)
    mat_a = random((m, k), dtype, True)
    mat_b = (random((groups, n, k), dtype).mT if stored == "GNK"
             else random((groups, k, n), dtype)).requires_grad_()
    bias = random((groups, n), dtype, True)
    offs = offs_of(sizes)
    what = f"triton {stored} {sizes} {dtype}"
    out = torch_pallas.grouped_mm(mat_a, mat_b, offs=offs, bias=bias)
    assert out.dtype == dtype
    check_values(out, mat_a, mat_b, what, offs=offs, bias=bias)
    assert (out[-TAIL:] == 0).all(), f"{what}: rows past the last group are zero"
    check_gradients(mat_a, mat_b, what, tail=TAIL, offs=offs, bias=bias)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float32_output_of_16_bit_inputs(dtype):
    mat_a, mat_b = random((50, 40), dtype, True), random((3, 40, 20), dtype, True)
    bias = random((3, 20), torch.float32, True)
    offs = offs_of([20, 0, 25], torch.int64)
    out = torch_pallas.grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    check_values(out, mat_a, mat_b, f"triton {dtype} -> float32", offs=offs, bias=bias,
                 out_dtype=torch.float32)
    check_gradients(mat_a, mat_b, f"triton {dtype} -> float32", tail=5, offs=offs, bias=bias,
                    out_dtype=torch.float32)


def test_weight_gradient_and_batched_forms():
    """2-D x 2-D (the ragged contraction forward, the rows kernel backward)
    and 3-D x 3-D."""
    sizes = [7, 0, 19, 4]
    k = sum(sizes) + 3
    mat_a, mat_b = random((9, k), torch.float16, True), random((k, 13), torch.float16, True)
    offs = offs_of(sizes)
    out = torch_pallas.grouped_mm(mat_a, mat_b, offs=offs)
    check_values(out, mat_a, mat_b, "triton 2-D x 2-D", offs=offs)
    check_gradients(mat_a, mat_b, "triton 2-D x 2-D", offs=offs)
    a3, b3 = random((3, 13, 29), torch.bfloat16, True), random((3, 29, 11), torch.bfloat16, True)
    check_values(torch_pallas.grouped_mm(a3, b3), a3, b3, "triton 3-D x 3-D")
    check_gradients(a3, b3, "triton 3-D x 3-D")


# --- the kernels themselves, with tiles of 16 -------------------------------

def random_ends(rows: int, groups: int) -> torch.Tensor:
    """Ragged cumulative ends over fewer than `rows` rows, some groups empty."""
    sizes = torch.randint(0, 2 * rows // groups, (groups,))
    sizes[torch.randperm(groups)[: groups // 3]] = 0
    ends = sizes.cumsum(0).clamp(max=rows - 3)
    return ends.to(torch.int32)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_rows_kernel_with_small_tiles(transpose_rhs):
    """Groups spanning and sharing 16-row tiles, K and N past several tiles
    (not multiples of 16): each tile's groups write their own rows."""
    m, k, n, groups = 101, 37, 45, 7
    ends = random_ends(m, groups)
    lhs = torch.randn(m, k).to(torch.float16)
    rhs = torch.randn(groups, n, k) if transpose_rhs else torch.randn(groups, k, n)
    rhs = rhs.to(torch.float16)
    bias = torch.randn(groups, n)
    out = forward_kernel.grouped_mm(lhs.to(DEVICE), rhs.to(DEVICE), ends.to(DEVICE),
                                    bias.to(DEVICE), transpose_rhs=transpose_rhs,
                                    out_dtype="float32", config=SMALL).cpu()
    ref = op.reference(lhs, rhs.mT if transpose_rhs else rhs, offs=ends, bias=bias)
    assert_within(out, ref, op.error_bound(lhs, ref, k, torch.float32), f"ends={ends.tolist()}")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_contraction_kernel_with_small_tiles(dtype):
    """Each group's rows walked in 16-row steps from its (unaligned) start;
    NaN in both operands past the last group never reaches a sum; empty
    groups exactly zero."""
    m, k, n, groups = 101, 37, 45, 7
    ends = random_ends(m, groups)
    lhs, rhs = torch.randn(m, k).to(dtype), torch.randn(m, n).to(dtype)
    last = int(ends[-1])
    lhs[last:], rhs[last:] = float("nan"), float("nan")
    out = backward_kernel.grouped_mm_backward(lhs.to(DEVICE), rhs.to(DEVICE), ends.to(DEVICE),
                                              out_dtype=str(dtype).removeprefix("torch."),
                                              config=SMALL).cpu()
    assert out.dtype == dtype
    clean_lhs, clean_rhs = lhs.nan_to_num(0.0), rhs.nan_to_num(0.0)
    ref = op.reference(clean_lhs.mT, clean_rhs, offs=ends)
    assert_within(out, ref, op.error_bound(lhs, ref, m), f"ends={ends.tolist()}")
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    assert (out[sizes == 0] == 0).all(), "empty groups give exact zeros"


def test_visit_table_covers_every_row_once():
    """Every row of [0, M) in exactly one visit, of its own group (G for the
    rows past the last), each visit within one row tile; the table's length
    is the bound cdiv(M, block_m) + G; ends past M are clamped."""
    for rows, block_m, groups in ((101, 16, 7), (64, 64, 3), (5, 64, 4), (200, 32, 12)):
        ends = random_ends(rows, groups)
        if groups == 12:
            ends[-1] = rows + 50  # not checked under torch.compile: clamped, not followed
        table = forward_kernel.row_tile_visits(ends, rows, block_m)
        assert table.shape == (-(-rows // block_m) + groups, 3) and table.dtype == torch.int32
        group_of_row = torch.bucketize(torch.arange(rows), ends.clamp(max=rows).long(),
                                       right=True)
        seen = torch.zeros(rows, dtype=torch.int64)
        for g, lo, hi in table.tolist():
            assert 0 <= lo <= hi <= rows and (hi == lo or lo // block_m == (hi - 1) // block_m)
            assert (group_of_row[lo:hi] == g).all(), (g, lo, hi)
            seen[lo:hi] += 1
        assert (seen == 1).all(), (rows, block_m, ends.tolist())


def test_wrap_triton_runs_the_same_kernels():
    """Each kernel object is one torch.library.wrap_triton accepts, through
    the launch the ops use under a trace (torch_compat.wrap_triton: the
    interpreter's kernels, which torch 2.11 refuses, as they are): launched
    through it (eagerly, as outside a trace) they give the launchers'
    results bit for bit."""
    ends = random_ends(40, 3).to(DEVICE)
    lhs, rhs = torch.randn(40, 24, device=DEVICE), torch.randn(3, 24, 20, device=DEVICE)
    dy = torch.randn(40, 20, device=DEVICE)
    results = []
    for wrap in (forward_kernel.direct, torch_compat.wrap_triton):
        out = forward_kernel.grouped_mm(lhs, rhs, ends, transpose_rhs=False, out_dtype="float32",
                                        config=SMALL, wrap=wrap)
        dw = backward_kernel.grouped_mm_backward(lhs, dy, ends, out_dtype="float32",
                                                 config=SMALL, wrap=wrap)
        results.append((out.cpu(), dw.cpu()))
    for direct, wrapped in zip(*results):
        assert torch.equal(direct, wrapped)


@pytest.mark.slow
def test_kernels_compile_for_the_gpu():
    """Both kernels compile for a Hopper GPU as the launchers call them
    (tests/triton_builds.py; the interpreter type-checks nothing), forward
    and backward: 16-bit with a bias and weights stored (G, N, K), float32
    IEEE; the smallest autotune config fits any GPU's shared memory."""
    import triton_builds

    result = triton_builds.run_subprocess(None, check="grouped_mm_forms", timeout=600)
    assert triton_builds.launched(result) == {
        (name, dtype) for dtype in ("bfloat16", "float32")
        for name in ("grouped_mm_kernel", "grouped_mm_backward_kernel")}, result["kernels"]
    shared = [(k["kernel"], k["dtype"], k["shared"]) for k in result["kernels"]]
    assert all(size <= 99 * 1024 for *_, size in shared), shared  # shared memory of any GPU


# The op and its backward traced on fake CUDA tensors (no GPU needed)
# through AOTAutograd: each launch recorded as a Triton kernel, no call into
# JAX left. (The backward op is called directly: tracing autograd on CUDA
# tensors needs a CUDA torch.)
TRACED_MODEL = """
class Model(torch.nn.Module):
    def forward(self, x, w, bias, offs, dy):
        y = torch.ops.pallas.grouped_mm(x, w.mT, offs, bias)
        dx, dw, dbias = torch.ops.pallas.grouped_mm_backward(dy, x, w.mT, offs, True,
                                                             [True, True, True])
        return y, dx, dw, dbias
"""
TRACED_INPUTS = """
x = torch.randn(100, 64, device="cuda", dtype=torch.bfloat16)
w = torch.randn(4, 48, 64, device="cuda", dtype=torch.bfloat16)  # (G, N, K), read in place
bias = torch.randn(4, 48, device="cuda", dtype=torch.bfloat16)
offs = torch.tensor([10, 10, 60, 90], device="cuda", dtype=torch.int32)
dy = torch.randn(100, 48, device="cuda", dtype=torch.bfloat16)
inputs = (x, w, bias, offs, dy)
"""


def test_tracing_on_cuda_tensors_reaches_the_triton_kernels():
    lines = fake_cuda_trace(TRACED_MODEL, TRACED_INPUTS)
    assert lines["KERNELS"].split() == ["grouped_mm_backward_kernel", "grouped_mm_kernel"]
    assert int(lines["WRAPPERS"]) == 3  # the forward; dA (rows) and dB (contraction)
    assert lines["OPAQUE"] == "False"  # no call into JAX left in the graph
