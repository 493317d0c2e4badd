"""Grouped matmul contracting over ragged rows in Triton: out[g] = lhs[rows
of g].T @ rhs[rows of g], (G, K, N), the weight gradient of a mixture of
experts (and the 2-D x 2-D form of torch's grouped_mm); after megablox's
tgmm (JAX's pallas/ops/tpu/megablox), on a grid of our own.

The grid is (K tiles x N tiles, groups): a program owns one (BLOCK_K,
BLOCK_N) block of one group's output, reads the group's [start, end) from
`ends` and walks its rows in BLOCK_M chunks from start, tl.dot of the lhs
chunk transposed (loaded as (BLOCK_K, BLOCK_M) through lhs's strides) and
the rhs chunk into a float32 accumulator. Rows outside the group (the chunk
past its end: another group's, or the rows past the last group, a
gradient's padding) are masked out of both loads, so they are never read
and NaN there never reaches a sum. An empty group runs no step and stores
exact zeros: every block of the output is written once.

Operands: lhs (M, K), rhs (M, N), ends (G,) int32. float32 products are full
float32 (input_precision "ieee", as torch's); 16-bit ones accumulate in
float32. The output, in `out_dtype`, is rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.triton import direct, interpreter_safe_dtype
from torch_pallas.kernels.triton.grouped_mm import GroupedMatmulConfig, fma_product

# Autotuning space on CUDA: (BLOCK_K, BLOCK_N) output blocks, BLOCK_M rows
# per step (the forward's config gives the tiles when not autotuning).
# Configs that do not fit in shared memory are skipped by the autotuner.
AUTOTUNE_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "BLOCK_K": 128, "BLOCK_N": 128}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 32, "BLOCK_K": 128, "BLOCK_N": 128}, num_stages=4, num_warps=8),
    triton.Config({"BLOCK_M": 64, "BLOCK_K": 64, "BLOCK_N": 128}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_K": 64, "BLOCK_N": 64}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 32, "BLOCK_K": 64, "BLOCK_N": 64}, num_stages=5, num_warps=2),
]


@triton.jit
def grouped_mm_backward_kernel(
    lhs_ptr, rhs_ptr, ends_ptr, out_ptr, M, K, N,
    stride_lm, stride_lk, stride_rm, stride_rn, stride_og, stride_ok, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    offs_k = (pid // tiles_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = offs_k < K
    n_ok = offs_n < N
    # The group's rows, clamped to [0, M] (offs are checked before an eager
    # launch, not under torch.compile: no read past the operands either way).
    start = tl.minimum(tl.maximum(tl.load(ends_ptr + g - 1, mask=g > 0, other=0), 0), M)
    end = tl.minimum(tl.maximum(tl.load(ends_ptr + g), start), M)

    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for row in range(start, end, BLOCK_M):
        rows = row + tl.arange(0, BLOCK_M)
        mine = rows < end
        rows = rows.to(tl.int64)
        a = tl.load(lhs_ptr + rows[None, :] * stride_lm + offs_k[:, None] * stride_lk,
                    mask=k_ok[:, None] & mine[None, :], other=0.0)  # (BLOCK_K, BLOCK_M)
        b = tl.load(rhs_ptr + rows[:, None] * stride_rm + offs_n[None, :] * stride_rn,
                    mask=mine[:, None] & n_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_N)
        if UPCAST:  # only under Triton's interpreter; exact for bfloat16
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    out_ptrs = (out_ptr + g.to(tl.int64) * stride_og + offs_k[:, None] * stride_ok
                + offs_n[None, :] * stride_on)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


# Full-precision float32 products run on the FMA units: tiles of their own,
# at most 32 accumulator values a thread (grouped_mm.py, FLOAT32_IEEE_CONFIGS).
FLOAT32_IEEE_CONFIGS = [
    triton.Config({"BLOCK_M": 32, "BLOCK_K": 64, "BLOCK_N": 128}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 32, "BLOCK_K": 128, "BLOCK_N": 64}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 32, "BLOCK_K": 64, "BLOCK_N": 64}, num_stages=3, num_warps=4),
    triton.Config({"BLOCK_M": 32, "BLOCK_K": 32, "BLOCK_N": 64}, num_stages=4, num_warps=4),
]


def configs_for_operands(configs, named_args, **kwargs):
    """FLOAT32_IEEE_CONFIGS for float32 operands multiplied in full
    precision, AUTOTUNE_CONFIGS (the tensor cores' tiles) for the rest."""
    fma = fma_product(named_args, kwargs, "lhs_ptr")
    return [c for c in configs if any(c is f for f in FLOAT32_IEEE_CONFIGS) == fma]


grouped_mm_backward_kernel_autotuned = triton.autotune(
    configs=AUTOTUNE_CONFIGS + FLOAT32_IEEE_CONFIGS, key=["K", "N", "INPUT_PRECISION"],
    prune_configs_by={"early_config_prune": configs_for_operands})(grouped_mm_backward_kernel)


def grouped_mm_backward(lhs, rhs, ends, *, out_dtype: str,
                        config: GroupedMatmulConfig, wrap=direct):
    """(G, K, N) in `out_dtype`: lhs[rows of g].T @ rhs[rows of g] per
    group, float32 accumulation, one rounding; empty groups zero, rows past
    ends[-1] never read. lhs (M, K) and rhs (M, N) in any strides; ends (G,)
    int32."""
    m, k = lhs.shape
    n = rhs.shape[1]
    groups = ends.shape[0]
    dtype = getattr(torch, out_dtype)
    out = torch.empty((groups, k, n), dtype=interpreter_safe_dtype(dtype), device=lhs.device)
    args = (lhs, rhs, ends, out, m, k, n, lhs.stride(0), lhs.stride(1), rhs.stride(0),
            rhs.stride(1), *out.stride())

    def grid(meta):
        return (triton.cdiv(k, meta["BLOCK_K"]) * triton.cdiv(n, meta["BLOCK_N"]), groups)

    # Upcasting bfloat16 operands to float32 is exact (see interpreter_safe_dtype).
    upcast = interpreter_safe_dtype(lhs.dtype) != lhs.dtype
    common = dict(UPCAST=upcast, INPUT_PRECISION=config.precision)
    if config.autotune:
        wrap(grouped_mm_backward_kernel_autotuned)[grid](*args, **common)
    else:
        wrap(grouped_mm_backward_kernel)[grid](*args, **common, BLOCK_M=config.block_m,
                                               BLOCK_K=config.block_k, BLOCK_N=config.block_n)
    return out.to(dtype)


def flops(avals, params) -> float:
    (lhs_shape, _), (rhs_shape, _), _ = avals
    return 2.0 * lhs_shape[0] * lhs_shape[1] * rhs_shape[1]


KERNEL = KernelSpec(run=grouped_mm_backward, default_config=GroupedMatmulConfig.default,
                    flops=flops)
