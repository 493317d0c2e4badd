"""Grouped matmul over ragged rows in Triton: out[rows of g] = lhs[rows of
g] @ rhs[g] (+ bias[g]) for the groups of rows that `ends` (torch's `offs`)
delimits, the forward of a mixture of experts; the torch.compile path on
CUDA (Inductor launches the kernel itself) and the eager path on GPUs
before Hopper.

The schedule is megablox's (JAX's pallas/ops/tpu/megablox, see
../shared/notes/grouped_matmul.md): every BLOCK_M row tile is visited once
per group with rows in it, so there are at most cdiv(M, BLOCK_M) + G - 1
visits; the rows past the last group are one more group (G) whose visits
store zeros, which gives the bound cdiv(M, BLOCK_M) + G. The visit table,
one (group, first row, end row) per visit, is computed on the device with
torch ops from `ends` (no read of it on the host: torch.compile traces the
launcher as it is); visits past the count hold an empty row range. The grid
is (visits, N tiles): a program loads its visit, runs the K loop with tl.dot
into float32 (skipped where the group is the rows past the last or the
visit is empty), adds the group's float32 bias and stores only its rows, so
two groups sharing a row tile write disjoint rows and no program reads
another's output.

Operands: lhs (M, K); rhs (G, K, N), or (G, N, K) with `transpose_rhs` (a
weight stored (out, in), read in place through its strides); ends (G,)
int32; optional bias (G, N) float32. float32 products are full float32
(input_precision "ieee", as torch's); 16-bit ones accumulate in float32.
The output, in `out_dtype`, is rounded once.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.triton import direct, interpreter_safe_dtype, interpreting

# Autotuning space on CUDA: BLOCK_M is not tuned (the visit table is built
# for one row tile before the launch); the N and K tiles, warps and stages
# are. Configs that do not fit in shared memory are skipped by the autotuner.
AUTOTUNE_CONFIGS = [
    triton.Config({"BLOCK_N": 128, "BLOCK_K": 64}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_N": 256, "BLOCK_K": 64}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_N": 128, "BLOCK_K": 32}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_N": 64, "BLOCK_K": 64}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_N": 64, "BLOCK_K": 32}, num_stages=5, num_warps=2),
]


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """The tiles of both kernels (grouped_mm_backward.py too). block_m: the
    forward's rows per visit (the visit table's row tile, never tuned), the
    backward's rows per step; block_n, block_k: the N and K tiles (the
    backward's output blocks) when not autotuning."""

    autotune: bool  # True: pick among each kernel's AUTOTUNE_CONFIGS per (N, K)
    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    # tl.dot's precision for float32 operands: "ieee" (full float32, as
    # torch's) or "tf32".
    precision: str = "ieee"

    @classmethod
    def default(cls, backend: str) -> "GroupedMatmulConfig":
        # The CPU interpreter would spend minutes timing configs.
        return cls(autotune=not interpreting())


@triton.jit
def grouped_mm_kernel(
    lhs_ptr, rhs_ptr, visits_ptr, bias_ptr, out_ptr, N, K, G,
    stride_lm, stride_lk, stride_rg, stride_rk, stride_rn, stride_bg, stride_om, stride_on,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    visit = tl.program_id(0)
    pid_n = tl.program_id(1)
    # This visit's group (G: the rows past the last group) and rows [lo, hi).
    g = tl.load(visits_ptr + 3 * visit)
    lo = tl.load(visits_ptr + 3 * visit + 1)
    hi = tl.load(visits_ptr + 3 * visit + 2)
    rows = lo + tl.arange(0, BLOCK_M)
    row_ok = rows < hi
    rows = rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    computes = (g < G) & (hi > lo)

    a_ptrs = lhs_ptr + rows[:, None] * stride_lm + offs_k[None, :] * stride_lk
    b_ptrs = (rhs_ptr + g.to(tl.int64) * stride_rg + offs_k[:, None] * stride_rk
              + offs_n[None, :] * stride_rn)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.where(computes, tl.cdiv(K, BLOCK_K), 0)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & col_ok[None, :], other=0.0)
        if UPCAST:  # only under Triton's interpreter; exact for bfloat16
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_lk
        b_ptrs += BLOCK_K * stride_rk
    if HAS_BIAS:  # none for the rows past the last group: they stay zero
        bias_g = tl.minimum(g, G - 1).to(tl.int64)
        bias = tl.load(bias_ptr + bias_g * stride_bg + offs_n, mask=col_ok, other=0.0)
        acc += tl.where(g < G, bias, 0.0)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# Full-precision float32 products (input_precision "ieee") run on the FMA
# units, not the tensor cores: both operand tiles and the accumulator sit in
# registers, and the tensor-core tiles above spill there (sm90 builds of
# the 64 x 256 x 64 tile: a stack of kilobytes; tests/triton_builds.py), as
# matmul's did (kernels/triton/matmul.py). Those products get tiles of their
# own: at most 32 accumulator values a thread, 32-deep K steps.
FLOAT32_IEEE_CONFIGS = [
    triton.Config({"BLOCK_N": 128, "BLOCK_K": 32}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_N": 64, "BLOCK_K": 32}, num_stages=3, num_warps=4),
    triton.Config({"BLOCK_N": 64, "BLOCK_K": 32}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_N": 32, "BLOCK_K": 32}, num_stages=4, num_warps=4),
]


# Operands whose sizes or row strides are not multiples of 16 elements (no
# 16-byte aligned vector loads: Triton specializes on that) load element by
# element, each with a 64-bit address in registers: there the tensor-core
# tiles above spilled 24 B-1.2 KB (the 16-bit examples, K 12-24), all but
# these, which did not (and keep HGMMA).
UNALIGNED_CONFIGS = [
    triton.Config({"BLOCK_N": 128, "BLOCK_K": 32}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_N": 64, "BLOCK_K": 32}, num_stages=3, num_warps=4),
]
ALIGNED_ARGUMENTS = ("N", "K", "stride_lm", "stride_lk", "stride_rk", "stride_rn", "stride_om")


def aligned(named_args) -> bool:
    """Whether the sizes and strides a tile's loads and stores step by are
    1 or multiples of 16 (as Triton's specialization sees them)."""
    return all(named_args[name] == 1 or named_args[name] % 16 == 0
               for name in ALIGNED_ARGUMENTS)


def fma_product(named_args, kwargs, operand: str) -> bool:
    """Whether this call multiplies float32 operands in full precision (on
    the FMA units)."""
    return (named_args[operand].element_size() == 4
            and kwargs.get("INPUT_PRECISION", "ieee") == "ieee")


def configs_for_operands(configs, named_args, **kwargs):
    """The autotuner's candidates for this call: FLOAT32_IEEE_CONFIGS for
    float32 operands multiplied in full precision, UNALIGNED_CONFIGS for
    other operands not aligned to 16 elements (`aligned`), AUTOTUNE_CONFIGS
    (the tensor cores' tiles) for the rest."""
    if fma_product(named_args, kwargs, "lhs_ptr"):
        chosen = FLOAT32_IEEE_CONFIGS
    elif not aligned(named_args):
        chosen = UNALIGNED_CONFIGS
    else:
        chosen = AUTOTUNE_CONFIGS
    return [c for c in configs if any(c is f for f in chosen)]


# (Triton's autotuner keys on the operands' dtypes too; the stride
# alignment's choice follows N and K in every contiguous layout.)
grouped_mm_kernel_autotuned = triton.autotune(
    configs=AUTOTUNE_CONFIGS + FLOAT32_IEEE_CONFIGS + UNALIGNED_CONFIGS,
    key=["N", "K", "INPUT_PRECISION", "stride_lm", "stride_rk", "stride_rn"],
    prune_configs_by={"early_config_prune": configs_for_operands})(grouped_mm_kernel)


def row_tile_visits(ends: torch.Tensor, rows: int, block_m: int) -> torch.Tensor:
    """The visit table, (cdiv(rows, block_m) + G, 3) int32 on ends' device:
    each visit's group (G for the rows past the last group), first row and
    end row, every row tile once per group with rows in it, in order; then
    empty visits (group G, rows [0, 0)). Torch ops only, no host sync.
    ends are clamped to [0, rows], so no visit reaches past the rows."""
    groups = ends.shape[0]
    device = ends.device
    ends = ends.to(torch.int64).clamp(0, rows)
    all_ends = torch.cat([ends, ends.new_full((1,), rows)])
    all_starts = torch.cat([ends.new_zeros(1), ends])
    first_tile = all_starts // block_m
    tiles = torch.where(all_ends > all_starts, (all_ends - 1) // block_m - first_tile + 1, 0)
    last = torch.cumsum(tiles, 0)  # one past each group's last visit
    bound = triton.cdiv(rows, block_m) + groups
    visit = torch.arange(bound, dtype=torch.int64, device=device)
    group = torch.searchsorted(last, visit, right=True)  # G + 1 past the last visit
    owner = group.clamp(max=groups)

    def of_owner(per_group):  # (index_select: fake CUDA tensors take it, not indexing)
        return per_group.index_select(0, owner)

    tile = of_owner(first_tile) + visit - of_owner(last - tiles)
    used = group <= groups
    lo = torch.where(used, torch.maximum(tile * block_m, of_owner(all_starts)), 0)
    hi = torch.where(used, torch.minimum(tile * block_m + block_m, of_owner(all_ends)), 0)
    return torch.stack([owner, lo, hi], dim=1).to(torch.int32)


def grouped_mm(lhs, rhs, ends, bias=None, *, transpose_rhs: bool, out_dtype: str,
               config: GroupedMatmulConfig, wrap=direct):
    """(M, N) in `out_dtype`: each group's rows of lhs times its rhs (+ its
    bias), float32 accumulation, one rounding; rows past ends[-1] zero.

    lhs (M, K); rhs (G, K, N), or (G, N, K) with transpose_rhs, read in
    place through its strides; ends (G,) int32; bias (G, N) float32 or None.
    """
    m, k = lhs.shape
    groups = rhs.shape[0]
    rhs_kn = rhs.mT if transpose_rhs else rhs  # a view: (G, K, N) strides
    n = rhs_kn.shape[2]
    dtype = getattr(torch, out_dtype)
    out = torch.empty((m, n), dtype=interpreter_safe_dtype(dtype), device=lhs.device)
    visits = row_tile_visits(ends, m, config.block_m)
    has_bias = bias is not None
    bias_arg = bias if has_bias else lhs  # never read without a bias
    args = (lhs, rhs_kn, visits, bias_arg, out, n, k, groups,
            lhs.stride(0), lhs.stride(1), *rhs_kn.stride(),
            bias.stride(0) if has_bias else 0, out.stride(0), out.stride(1))
    bound = visits.shape[0]

    def grid(meta):
        return (bound, triton.cdiv(n, meta["BLOCK_N"]))

    # Upcasting bfloat16 operands to float32 is exact (see interpreter_safe_dtype).
    upcast = interpreter_safe_dtype(lhs.dtype) != lhs.dtype
    common = dict(HAS_BIAS=has_bias, BLOCK_M=config.block_m, UPCAST=upcast,
                  INPUT_PRECISION=config.precision)
    if config.autotune:
        wrap(grouped_mm_kernel_autotuned)[grid](*args, **common)
    else:
        wrap(grouped_mm_kernel)[grid](*args, **common, BLOCK_N=config.block_n,
                                      BLOCK_K=config.block_k)
    return out.to(dtype)


def flops(avals, params) -> float:
    (lhs_shape, _), (rhs_shape, _), *_ = avals
    m, k = lhs_shape
    n = rhs_shape[1] if params["transpose_rhs"] else rhs_shape[2]
    return 2.0 * m * k * n


KERNEL = KernelSpec(run=grouped_mm, default_config=GroupedMatmulConfig.default, flops=flops)
