"""Batched matrix multiplication in Triton: float32 accumulation, masked
ragged edges, strides passed in (transposed or broadcast operands are read
in place), grouped tile ordering for L2 reuse, autotuned on CUDA.

Program (pid, batch) computes one BLOCK_M x BLOCK_N tile of one batch. Tiles
are visited in groups of GROUP_M rows of tiles, so consecutive programs
share A rows and B columns while they are still in L2.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch_pallas.kernels.shapes import matmul_dims
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.triton import direct, interpreter_safe_dtype, interpreting

# Autotuning space: Hopper-friendly large tiles with deep pipelines first,
# smaller tiles for small or skinny problems. Configs that do not fit in
# shared memory are skipped by the autotuner.
AUTOTUNE_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_stages=5, num_warps=2),
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
]


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    autotune: bool  # True: pick among AUTOTUNE_CONFIGS per (M, N, K)
    block_m: int = 64  # the fixed tiles used when not autotuning
    block_n: int = 64
    block_k: int = 32
    group_m: int = 4

    @classmethod
    def default(cls, backend: str) -> "MatmulConfig":
        # The CPU interpreter would spend minutes timing configs.
        return cls(autotune=not interpreting())


@triton.jit
def matmul_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    batch = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * tiles_n
    first_m = (pid // tiles_per_group) * GROUP_M
    group_size = min(tiles_m - first_m, GROUP_M)  # the last group may be short
    pid_m = first_m + (pid % tiles_per_group) % group_size
    pid_n = (pid % tiles_per_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + batch * stride_ab + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + batch * stride_bb + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if UPCAST:  # only under Triton's interpreter; exact for bfloat16
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    c_ptrs = c_ptr + batch * stride_cb + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# Full-precision float32 products (input_precision "ieee") run on the FMA
# units, not the tensor cores: both operand tiles and the accumulator sit in
# registers, and the tensor-core tiles above spill there (an sm90 build of
# 128 x 256 x 64: 255 registers and a 6.5 KB stack; tests/triton_builds.py).
# Those products get tiles of their own, 32 accumulator values a thread.
FLOAT32_IEEE_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "GROUP_M": 8}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_stages=3, num_warps=4),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_stages=4, num_warps=4),
]


def configs_for_operands(configs, named_args, **kwargs):
    """The autotuner's candidates for this call: FLOAT32_IEEE_CONFIGS for
    float32 operands multiplied in full precision, AUTOTUNE_CONFIGS (the
    tensor cores' tiles) for the rest."""
    fma = named_args["a_ptr"].element_size() == 4 and kwargs.get("INPUT_PRECISION") == "ieee"
    return [c for c in configs if any(c is f for f in FLOAT32_IEEE_CONFIGS) == fma]


matmul_kernel_autotuned = triton.autotune(
    configs=AUTOTUNE_CONFIGS + FLOAT32_IEEE_CONFIGS, key=["M", "N", "K", "INPUT_PRECISION"],
    prune_configs_by={"early_config_prune": configs_for_operands})(matmul_kernel)


def matmul(a, b, *, transpose_a: bool, transpose_b: bool, config: MatmulConfig, wrap=direct,
           precision: str = "ieee"):
    """Batched a @ b for torch tensors, accumulated in float32, in a's dtype.

    a: (Ba, M, K), or (Ba, K, M) with transpose_a; b: (Bb, K, N), or
    (Bb, N, K) with transpose_b; Ba and Bb are 1 or the batch B. Returns a
    new (B, M, N) tensor. Transposes are strides, read in place. float32
    products are full float32 (`precision` "ieee") or TF32 ("tf32");
    16-bit ones are exact either way.
    """
    batch, m, n, k = matmul_dims(a.shape, b.shape, transpose_a, transpose_b)
    if transpose_a:  # strides: read in place
        a = a.mT
    if transpose_b:
        b = b.mT
    c = torch.empty((batch, m, n), dtype=interpreter_safe_dtype(a.dtype), device=a.device)
    # A batch of 1 is broadcast: its batch stride is 0.
    a_batch_stride = a.stride(0) if a.shape[0] > 1 else 0
    b_batch_stride = b.stride(0) if b.shape[0] > 1 else 0
    args = (
        a, b, c, m, n, k,
        a_batch_stride, a.stride(1), a.stride(2),
        b_batch_stride, b.stride(1), b.stride(2),
        c.stride(0), c.stride(1), c.stride(2),
    )

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), batch)

    # Upcasting bfloat16 operands to float32 is exact (see interpreter_safe_dtype).
    upcast = interpreter_safe_dtype(a.dtype) != a.dtype
    if config.autotune:
        wrap(matmul_kernel_autotuned)[grid](*args, UPCAST=upcast, INPUT_PRECISION=precision)
    else:
        wrap(matmul_kernel)[grid](
            *args, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, GROUP_M=config.group_m, UPCAST=upcast,
            INPUT_PRECISION=precision,
        )
    return c.to(a.dtype)


KERNEL = KernelSpec(run=matmul, default_config=MatmulConfig.default)
