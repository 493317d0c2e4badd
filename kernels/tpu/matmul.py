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
from torch_pallas.kernels.shapes import fitted_block, matmul_dims, round_up
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu import chip
from torch_pallas.kernels.tpu.cores import pipeline_core_split, tensorcore_mesh


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    block_b: int | None  # None: the whole dimension in one block
    block_m: int | None
    block_n: int | None
    block_k: int | None
    # The CPU's 16-bit GEMM (oneDNN, see cpu_library): the dot yields the
    # output's dtype itself, accumulating in float32 and rounding once.
    dot_in_output_dtype: bool = False
    # On a chip: the scoped VMEM asked of Mosaic (chip.vmem_limit); None:
    # its default.
    vmem_limit: int | None = None

    @classmethod
    def default(cls, backend: str) -> "MatmulConfig":
        # JAX's interpreter copies whole buffers per grid step: on CPU one
        # block (one XLA dot, batched) is fastest. TPU-sized blocks elsewhere.
        if backend == "interpret":
            return cls(block_b=None, block_m=None, block_n=None, block_k=None)
        return cls(block_b=1, block_m=128, block_n=128, block_k=128)


def product(a, b, batch: int, transpose_a: bool, transpose_b: bool, dtype=jnp.float32):
    """The product of blocks a and b (a batch of 1 broadcast), accumulated
    in float32 and returned in `dtype`."""
    a = jnp.broadcast_to(a, (batch, *a.shape[1:]))
    b = jnp.broadcast_to(b, (batch, *b.shape[1:]))
    contract = ((1 if transpose_a else 2,), (2 if transpose_b else 1,))
    # bfloat16 at the MXU's own precision, float32 in full (chip.precision).
    return jax.lax.dot_general(
        a, b, (contract, ((0,), (0,))), precision=chip.precision(a.dtype),
        preferred_element_type=dtype,
    )


def one_block_kernel(a_ref, b_ref, o_ref, *, transpose_a, transpose_b, in_output_dtype=False):
    """The whole product as one block: no grid, no pipeline. With
    `in_output_dtype` the dot itself yields the output's dtype (a library
    that accumulates in float32 inside: MatmulConfig.dot_in_output_dtype)."""
    dtype = o_ref.dtype if in_output_dtype else jnp.float32
    o_ref[...] = product(a_ref[...], b_ref[...], o_ref.shape[0], transpose_a,
                         transpose_b, dtype).astype(o_ref.dtype)


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
            functools.partial(one_block_kernel, transpose_a=transpose_a, transpose_b=transpose_b,
                              in_output_dtype=config.dot_in_output_dtype),
            jax.ShapeDtypeStruct((batch, m, n), a.dtype), a, b, interpret=interpret,
        )
    bp, mp, np_, kp = round_up(batch, bb), round_up(m, bm), round_up(n, bn), round_up(k, bk)

    def padded(x, rows, cols, transposed):
        shape = (bp if x.shape[0] > 1 else 1, *((cols, rows) if transposed else (rows, cols)))
        return pad_to(x, shape)

    scratch = {}
    if kp // bk > 1:
        scratch["acc_vmem"] = pltpu.VMEM((bb, bm, bn), jnp.float32)
    out = chip.kernel(
        functools.partial(
            matmul_kernel, blocks=(bb, bm, bn, bk), transpose_a=transpose_a,
            transpose_b=transpose_b, num_cores=num_cores,
        ),
        out_type=jax.ShapeDtypeStruct((bp, mp, np_), a.dtype),
        mesh=tensorcore_mesh(num_cores),
        scratch_types=scratch,
        vmem_limit=config.vmem_limit,
        interpret=interpret,
    )(padded(a, mp, kp, transpose_a), padded(b, kp, np_, transpose_b))
    return out[:batch, :m, :n]


# --- which GEMM library XLA's CPU compiler gives the one-block dot -------
# Measured side by side with torch.matmul in one process, medians of
# interleaved rounds (docs/performance.md has the tables).

# oneDNN beats XLA's default (YNNPACK) for float32 with many rows.
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

# 16-bit dots. XLA widens a bfloat16 dot to float32 (its float-normalization
# pass) unless a library takes it in bfloat16, and YNNPACK, the only one
# that does by default, takes it only with A's rows contiguous: X^T @ dY, a
# weight's gradient, ran as a float32 Eigen dot at 0.16-0.30x torch's
# speed. oneDNN takes a 16-bit dot whose operands and result share the
# dtype, in any layout, where the CPU has the instructions (AVX512-BF16,
# AVX512-FP16); it accumulates in float32 and rounds once, as torch's CPU
# matmul does (oneDNN too, the same errors). So the dot yields the output
# dtype (MatmulConfig.dot_in_output_dtype) and the pass is off: 2-core Xeon
# with AMX, bfloat16 2048^3 in 10.3 ms against YNNPACK's 15.0 and torch's
# 9.6; X^T @ dY 2048^3 in 16.3 ms against 116 (torch 19.0); (512 x 64)^T @
# (512 x 1376) 0.46 ms against 1.17 (torch 0.31). Below the limits YNNPACK
# (or its float32 fallback) is faster: oneDNN costs ~0.3 ms more a call
# ((8 x 512) @ (512 x 1376)^T: 0.67 ms against 0.27).
ONEDNN_16BIT_DOT = {**ONEDNN_DOT, "xla_disable_hlo_passes": "float-normalization-bf16"}
ONEDNN_16BIT_MIN_FLOPS = 2.5e8
ONEDNN_16BIT_MIN_ROWS_TRANSPOSED = 64  # X^T @ dY: its M
_CPU_FLAGS = {"bfloat16": "avx512_bf16", "float16": "avx512_fp16"}  # XLA's own test


@functools.cache
def cpu_has_16bit_instructions(dtype: str) -> bool:
    """Whether this CPU has the instructions XLA requires before it gives
    oneDNN a `dtype` dot (read from /proc/cpuinfo: Linux; elsewhere JAX's
    CPU wheels have no oneDNN to ask)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), [])
    except OSError:
        return False
    return _CPU_FLAGS[dtype] in flags


@functools.cache
def onednn_takes_16bit(dtype: str) -> bool:
    """Whether this XLA hands a `dtype` dot to oneDNN on this CPU, asked of
    XLA itself (one small compile, once a process) where the CPU has the
    instructions: with the float-normalization pass off, a 16-bit dot that
    no library takes fails to compile."""
    if not cpu_has_16bit_instructions(dtype):
        return False
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    x = jax.ShapeDtypeStruct((16, 16), jnp.dtype(dtype), sharding=cpu)
    try:
        compiled = jax.jit(jnp.matmul).lower(x, x).compile(ONEDNN_16BIT_DOT)
        return "__onednn_fusion" in compiled.as_text()
    except Exception:
        return False


def cpu_library(backend: str, avals, params) -> str | None:
    """The GEMM library for the `interpret` backend's one-block dot:
    "onednn", "onednn_16bit", "eigen", or None (XLA's default)."""
    if backend != "interpret":
        return None
    (a_shape, dtype), (b_shape, _) = avals
    transpose_a = params["transpose_a"]
    batch, m, n, k = matmul_dims(a_shape, b_shape, transpose_a, params["transpose_b"])
    if dtype in _CPU_FLAGS:
        large = (m >= ONEDNN_16BIT_MIN_ROWS_TRANSPOSED if transpose_a
                 else 2.0 * batch * m * n * k >= ONEDNN_16BIT_MIN_FLOPS)
        return "onednn_16bit" if large and onednn_takes_16bit(dtype) else None
    # A transposed float32 A keeps XLA's default: with oneDNN the (1024x1376)^T
    # @ (1024x512) product ran at 0.92x torch's speed, without it 0.99x
    # (2-core AMD EPYC, medians of 40 interleaved rounds, 2026-12-01).
    if transpose_a or dtype != "float32":
        return None
    if m >= ONEDNN_MIN_ROWS:
        return "onednn"
    if m == 1 and batch == 1:
        return "eigen"
    return None


_LIBRARY_OPTIONS = {"onednn": ONEDNN_DOT, "onednn_16bit": ONEDNN_16BIT_DOT, "eigen": EIGEN_DOT,
                    None: {}}


def compiler_options(backend: str, avals, params) -> dict:
    """XLA options for this kernel's compilation: on `interpret`, the CPU
    GEMM library for this dtype and shape (cpu_library)."""
    return _LIBRARY_OPTIONS[cpu_library(backend, avals, params)]


# The chip's blocks (bm, bn, bk) by operand dtype, largest first: JAX's
# Pallas TPU matmul guide reaches 91.5% of v5e's peak at 8192^3 in bfloat16
# with 512 x 1024 x 1024 blocks and ~6% with 128-blocks. bfloat16 on v5e
# with 64 MiB of scoped VMEM (bench/tpu_check.py sweep_matmul, 2026-12-06,
# ms at 4096^3 / 8192^3): 1024 x 1024 x 4096 0.851 / 5.868 (a whole K of
# 4096 in one step: 36 MiB), 512 x 1024 x 4096 0.848 / 5.885, 1024 x 1024 x
# 2048 0.864 / 5.883, 1024^3 0.863 / 5.944, 512 x 1024 x 2048 0.866 / 5.935,
# 512 x 1024 x 1024 0.892 / 6.094, 1024 x 1024 x 512 0.882 / 6.071, 256 x
# 1024 x 1024 1.087 / 7.516; jnp.dot 0.854 / 6.04. float32 at HIGHEST splits
# each block into bfloat16 parts in VMEM: 512 x 1024 x 512 blocks overflowed
# Mosaic's 16 MiB on v5e (CompileTimeScopedVmemOom), 512^3 fit.
CHIP_BLOCKS = {
    "bfloat16": ((1024, 1024, 4096), (1024, 1024, 1024), (512, 1024, 1024), (512, 512, 512),
                 (256, 256, 256), (128, 128, 128)),
    "float32": ((512, 512, 512), (256, 512, 512), (256, 256, 256), (128, 128, 128)),
}


def vmem_bytes(bm: int, bn: int, bk: int, itemsize: int, k_steps: int) -> int:
    """VMEM a pipelined step takes: A, B and output blocks double-buffered,
    and the float32 accumulator where K takes several steps."""
    blocks = 2 * (bm * bk + bk * bn + bm * bn) * itemsize
    return blocks + (bm * bn * 4 if k_steps > 1 else 0)


def k_block(k: int, block: int) -> int:
    """The K block for a `block`: fitted_block's, looking for a divisor of K
    (rounded to 128) down to 256 rather than half the block. A padded K is a
    padded copy of both operands at every call (linear_cross_entropy's
    d_input, K the vocabulary: a 128256 x 4096 weight copied into 131072
    rows, 1 GiB more memory, for 4096-blocks; 768 divides it), where a
    smaller block only adds K steps."""
    return fitted_block(k, block, 128, smallest=256)


def chip_config(avals, params, device) -> MatmulConfig:
    """The largest blocks of CHIP_BLOCKS that fit the scoped VMEM asked of
    Mosaic (chip.vmem_limit), each cut to its dimension rounded up to the tile
    ((8 or 16 rows, 128 lanes): a small matrix is one block, not padded to
    512); N blocks that divide their dimension where one of at least half
    the size does (shapes.fitted_block: no padded copy of an operand), K
    blocks where one of at least 256 does (k_block)."""
    (a_shape, dtype), (b_shape, _) = avals
    _, m, n, k = matmul_dims(a_shape, b_shape, params["transpose_a"], params["transpose_b"])
    itemsize = 2 if dtype in ("bfloat16", "float16") else 4
    rows = 16 if itemsize == 2 else 8
    limit = chip.vmem_limit(device)
    # (float16 runs in float32 on the chip: chip.widening_float16)
    for bm, bn, bk in CHIP_BLOCKS["bfloat16" if dtype == "bfloat16" else "float32"]:
        bm, bn, bk = min(bm, round_up(m, rows)), fitted_block(n, bn, 128), k_block(k, bk)
        # a transposed operand's blocks put M or N on the lanes
        if params["transpose_a"]:
            bm = min(max(bm, 128), round_up(m, 128))
        wide = 4 if dtype == "float16" else itemsize
        if vmem_bytes(bm, bn, bk, wide, round_up(k, bk) // bk) <= limit * 3 // 4:
            return MatmulConfig(block_b=1, block_m=bm, block_n=bn, block_k=bk, vmem_limit=limit)
    return MatmulConfig.default("tpu")


def select_config(backend: str, avals, params, device=None) -> MatmulConfig:
    if backend == "tpu":
        return chip_config(avals, params, device)
    config = MatmulConfig.default(backend)
    if cpu_library(backend, avals, params) == "onednn_16bit":
        return dataclasses.replace(config, dot_in_output_dtype=True)
    return config


def flops(avals, params) -> float:
    (a_shape, _), (b_shape, _) = avals
    batch, m, n, k = matmul_dims(a_shape, b_shape, params["transpose_a"], params["transpose_b"])
    return 2.0 * batch * m * n * k


KERNEL = KernelSpec(run=chip.widening_float16(matmul), default_config=MatmulConfig.default, select_config=select_config,
                    compiler_options=compiler_options, flops=flops)
