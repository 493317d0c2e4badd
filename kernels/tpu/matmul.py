"""Batched matrix multiplication on TPU, pipelined over K with a float32
accumulator in VMEM (after the Pallas TPU matmul guide).

`pl.kernel` runs on a TensorCore mesh; `pltpu.emit_pipeline` walks the grid
(B/bb, M/bm, N/bn, K/bk), copying A and B blocks HBM -> VMEM while the
previous step computes. Batch, M and N are PARALLEL (split across the
TensorCores), K is ARBITRARY (sequential): at k == 0 the accumulator is
zeroed, every step adds `dot(a, b)` in float32, and the last step writes the
accumulator, cast to the output dtype, into the output block.

Operands are 3-D, (batch, rows, cols); a batch of 1 is broadcast against the
other operand's. A transposed operand (`transpose_a`: a is (B, K, M)) is read
in place: its blocks are contracted along their other axis, no copy. Ragged
M, N, K (and batch) are zero-padded to whole blocks once, outside the kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels import gridless
from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.shapes import matmul_dims, round_up
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu.cores import pipeline_core_split, tensorcore_mesh


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    block_b: int | None  # None: the whole dimension in one block
    block_m: int | None
    block_n: int | None
    block_k: int | None

    @classmethod
    def default(cls, backend: str) -> "MatmulConfig":
        # JAX's interpreter copies whole buffers per grid step: on CPU one
        # block (one XLA dot, batched) is fastest. TPU-sized blocks elsewhere.
        if backend == "interpret":
            return cls(block_b=None, block_m=None, block_n=None, block_k=None)
        return cls(block_b=1, block_m=128, block_n=128, block_k=128)


def product(a, b, batch: int, transpose_a: bool, transpose_b: bool):
    """The float32 product of blocks a and b (a batch of 1 broadcast)."""
    a = jnp.broadcast_to(a, (batch, *a.shape[1:]))
    b = jnp.broadcast_to(b, (batch, *b.shape[1:]))
    contract = ((1 if transpose_a else 2,), (2 if transpose_b else 1,))
    # float32 at HIGHEST: the MXU's default for float32 is one bfloat16
    # pass, less than torch allows at any float32 matmul precision.
    return jax.lax.dot_general(
        a, b, (contract, ((0,), (0,))), precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def one_block_kernel(a_ref, b_ref, o_ref, *, transpose_a, transpose_b):
    """The whole product as one block: no grid, no pipeline."""
    o_ref[...] = product(a_ref[...], b_ref[...], o_ref.shape[0], transpose_a,
                         transpose_b).astype(o_ref.dtype)


def matmul_kernel(a_hbm, b_hbm, o_hbm, acc_vmem=None, *, blocks, transpose_a, transpose_b,
                  num_cores):
    """blocks: (bb, bm, bn, bk); a_hbm (Ba, M, K) or (Ba, K, M), b_hbm
    (Bb, K, N) or (Bb, N, K), o_hbm (B, M, N), with Ba, Bb in {1, B}. The
    accumulator exists only when K takes several steps."""
    bb, bm, bn, bk = blocks
    batch, m, n = o_hbm.shape  # its batch padded to whole blocks, unlike a 1 of a or b
    *_, k = matmul_dims(a_hbm.shape, b_hbm.shape, transpose_a, transpose_b)
    k_steps = k // bk
    a_batched, b_batched = a_hbm.shape[0] > 1, b_hbm.shape[0] > 1

    def block_product(a_vmem, b_vmem):
        return product(a_vmem[...], b_vmem[...], bb, transpose_a, transpose_b)

    def body(a_vmem, b_vmem, o_vmem):
        if k_steps == 1:  # the whole K in one block: no accumulator round trip
            o_vmem[...] = block_product(a_vmem, b_vmem).astype(o_vmem.dtype)
            return
        k_step = pl.program_id(3)

        @pl.when(k_step == 0)
        def _():
            acc_vmem[...] = jnp.zeros_like(acc_vmem)

        acc_vmem[...] += block_product(a_vmem, b_vmem)

        @pl.when(k_step == k_steps - 1)
        def _():
            o_vmem[...] = acc_vmem[...].astype(o_vmem.dtype)

    def a_index(bi, i, j, kk):
        bi = bi if a_batched else 0
        return (bi, kk, i) if transpose_a else (bi, i, kk)

    def b_index(bi, i, j, kk):
        bi = bi if b_batched else 0
        return (bi, j, kk) if transpose_b else (bi, kk, j)

    a_block = (bb if a_batched else 1, *((bk, bm) if transpose_a else (bm, bk)))
    b_block = (bb if b_batched else 1, *((bn, bk) if transpose_b else (bk, bn)))
    pltpu.emit_pipeline(
        body,
        grid=(batch // bb, m // bm, n // bn, k_steps),
        in_specs=[pl.BlockSpec(a_block, a_index), pl.BlockSpec(b_block, b_index)],
        out_specs=pl.BlockSpec((bb, bm, bn), lambda bi, i, j, kk: (bi, i, j)),
        **pipeline_core_split(num_cores, parallel_dims=3),
    )(a_hbm, b_hbm, o_hbm)


def matmul(a, b, *, transpose_a: bool, transpose_b: bool, config: MatmulConfig,
           num_cores: int, interpret, precision: str = "ieee"):
    """Batched a @ b, accumulated in float32, in a's dtype. float32 is
    multiplied in full whatever `precision` allows (see block_product).

    a: (Ba, M, K), or (Ba, K, M) with transpose_a; b: (Bb, K, N), or
    (Bb, N, K) with transpose_b; Ba and Bb are 1 or the batch B. Returns
    (B, M, N).
    """
    batch, m, n, k = matmul_dims(a.shape, b.shape, transpose_a, transpose_b)
    bb, bm, bn, bk = (config.block_b or batch, config.block_m or m,
                      config.block_n or n, config.block_k or k)
    if (bb, bm, bn, bk) == (batch, m, n, k) and num_cores == 1:
        # One block on one core (the CPU's configuration): a kernel without
        # a grid (kernels/gridless.py), built in a fraction of the pipelined
        # form's time (a kernel is built per new shape) into the same dot.
        return gridless.call(
            functools.partial(one_block_kernel, transpose_a=transpose_a, transpose_b=transpose_b),
            jax.ShapeDtypeStruct((batch, m, n), a.dtype), a, b, interpret=interpret,
        )
    bp, mp, np_, kp = round_up(batch, bb), round_up(m, bm), round_up(n, bn), round_up(k, bk)

    def padded(x, rows, cols, transposed):
        shape = (bp if x.shape[0] > 1 else 1, *((cols, rows) if transposed else (rows, cols)))
        return pad_to(x, shape)

    scratch = {}
    if kp // bk > 1:
        scratch["acc_vmem"] = pltpu.VMEM((bb, bm, bn), jnp.float32)
    out = pl.kernel(
        functools.partial(
            matmul_kernel, blocks=(bb, bm, bn, bk), transpose_a=transpose_a,
            transpose_b=transpose_b, num_cores=num_cores,
        ),
        out_type=jax.ShapeDtypeStruct((bp, mp, np_), a.dtype),
        mesh=tensorcore_mesh(num_cores),
        scratch_types=scratch,
        interpret=interpret,
    )(padded(a, mp, kp, transpose_a), padded(b, kp, np_, transpose_b))
    return out[:batch, :m, :n]


# On the CPU (one block, one XLA dot) oneDNN beats XLA's YNNPACK only for float32 with many rows.
ONEDNN_DOT = {
    "xla_cpu_experimental_ynn_fusion_type": "",
    "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
    "xla_cpu_use_onednn": True,
}
ONEDNN_MIN_ROWS = 1024
# ... and Eigen (no library) beats YNNPACK for one row, a decode step's
# vector-matrix product: (1 x 512) @ (512 x 1376) in 140 us against 163,
# (1 x 1376) @ (1376 x 512) 124 against 157, (1 x 512) @ (512 x 4096) 280
# against 399 (torch 156, 136, 565; medians of 40 interleaved rounds, the
# 2-core AMD EPYC, 2026-12-01). At two rows Eigen is 5x slower.
EIGEN_DOT = {"xla_cpu_experimental_ynn_fusion_type": ""}


def compiler_options(backend: str, avals, params) -> dict:
    """XLA options for this kernel's compilation: on `interpret`, the CPU
    GEMM library for this dtype and shape. A transposed A (a weight's
    gradient, X^T @ dY) keeps XLA's default: with oneDNN the (1024x1376)^T @
    (1024x512) float32 product ran at 0.92x torch's speed, without it 0.99x
    (2-core AMD EPYC, medians of 40 interleaved rounds, 2026-12-01)."""
    if backend != "interpret" or params["transpose_a"]:
        return {}
    (a_shape, dtype), (b_shape, _) = avals
    batch, m, _, _ = matmul_dims(a_shape, b_shape, params["transpose_a"], params["transpose_b"])
    if dtype == "float32" and m >= ONEDNN_MIN_ROWS:
        return ONEDNN_DOT
    if dtype == "float32" and m == 1 and batch == 1:
        return EIGEN_DOT
    return {}


def flops(avals, params) -> float:
    (a_shape, _), (b_shape, _) = avals
    batch, m, n, k = matmul_dims(a_shape, b_shape, params["transpose_a"], params["transpose_b"])
    return 2.0 * batch * m * n * k


KERNEL = KernelSpec(run=matmul, default_config=MatmulConfig.default,
                    compiler_options=compiler_options, flops=flops)
