"""Grouped matmul over ragged rows on TPU: out[rows of g] = lhs[rows of g]
@ rhs[g] for the groups of rows that `ends` (torch's `offs`) delimits, the
forward of a mixture of experts (after megablox's gmm, JAX's
pallas/ops/tpu/megablox; the schedule is our own, see
kernels/grouped_mm_groups.py).

On a TPU (and its simulator) `pl.kernel` runs on a TensorCore mesh and
`pltpu.emit_pipeline` walks a grid (N tiles, visits, K tiles) whose middle
axis is a dynamic list of (group, row tile) visits read from SMEM: every
row tile is visited once per group it holds rows of, consecutively, so the
output block stays in VMEM across a tile's visits and each visit stores
only its group's rows (a select). The rows past the last group are one more
group that stores zeros, so every output row is written. N tiles are
PARALLEL, split across the TensorCores (visits of one tile must stay on one
core); K is ARBITRARY with a float32 accumulator.

On the CPU (`interpret`, one core) JAX's interpreter pays per grid step, so
the kernel has no grid: its body walks each group's rows in tiles of static
sizes (`grouped_mm_groups.walk_rows`: whole chunks, then the rest's binary
digits), one XLA dot each, which costs the groups' rows plus at most 8 per
group, not the G - 1 extra tiles of a fixed tiling.

Operands: lhs (M, K); rhs (G, K, N), or (G, N, K) with `transpose_rhs` (a
weight stored (out, in), read in place); ends (G,) int32; optional bias (G,
N) float32, added in float32 before the one rounding.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels import gridless
from torch_pallas.kernels.grouped_mm_groups import starts, walk_rows
from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.shapes import cdiv, fitted_block, round_up
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu import chip
from torch_pallas.kernels.tpu.cores import pipeline_core_split, tensorcore_mesh
from torch_pallas.kernels.tpu.matmul import ONEDNN_16BIT_DOT, onednn_takes_16bit


# (rows, N, K) per tile on a chip, at most, by operand dtype, each cut to
# divide its dimension where it can (chip_config). 128-tiles (the
# simulator's) ran at 9.4-9.7 TFLOP/s on v5e where megablox's 512 x 1024 x
# 1024 took 57-75; a tile's rows past its group are computed and dropped, so
# rows stay at 512. 8 groups of 16384 x 4096 x 1792 bfloat16 on v5e, the
# forward / dA / dW kernels (ms; 2026-12-06, 64 MiB of scoped VMEM, each
# tiling cut to divide 1792): 512 x 1024 x 1024 1.80 / 1.92 / 1.86; 512 x
# 1024 x 2048 1.73 / 1.77 / 1.77; 512 x 2048 x 1024 1.72 / 1.78 / 1.77; 256
# rows 2.08 / 2.22 / 1.86; 1024 rows 2.01 / 2.08 / 2.05; 512 x 1024 x 1024
# padded to 2048 columns (before fitting) 2.58 / 2.67 / 2.56. megablox's gmm
# 1.77, gmm + tgmm 3.65. float32 at HIGHEST splits its blocks into bfloat16
# parts in VMEM: 512 x 1024 x 512 overflowed Mosaic's 16 MiB on v5e, 512^3
# fits (float16 runs as float32: chip.widening_float16).
CHIP_BLOCKS = {"bfloat16": (512, 1024, 2048), "float32": (512, 512, 512)}


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """block_m: rows per tile (the pipeline's row tile; on the CPU the
    largest tile of a group's walk). block_n, block_k: the pipeline's N and K
    tiles; None on the CPU, whose tiles take all of N and K."""

    block_m: int
    block_n: int | None
    block_k: int | None
    # The CPU's 16-bit GEMM (oneDNN, see matmul.cpu_library): each tile's dot
    # yields the output's dtype itself, accumulating in float32 and rounding
    # once (a row of the output is one dot over all of K).
    dot_in_output_dtype: bool = False
    # On a chip: the scoped VMEM asked of Mosaic (chip.vmem_limit); None:
    # its default.
    vmem_limit: int | None = None

    @classmethod
    def default(cls, backend: str) -> "GroupedMatmulConfig":
        if backend == "interpret":
            return cls(block_m=512, block_n=None, block_k=None)
        if backend == "tpu":  # megablox's best tiling on v5e is of this size
            return cls(*CHIP_BLOCKS["float32"])
        return cls(block_m=128, block_n=128, block_k=128)  # the simulator's: quick, many

    @property
    def gridless(self) -> bool:
        return self.block_n is None


def contract(x, w, transpose_w: bool, dtype=jnp.float32):
    """x @ w (or x @ w.T) in `dtype` (float32 accumulation); bfloat16 at
    the MXU's own precision, float32 in full (chip.precision)."""
    dims = (((1,), (1 if transpose_w else 0,)), ((), ()))
    return jax.lax.dot_general(x, w, dims, precision=chip.precision(x.dtype),
                               preferred_element_type=dtype)


# --- the CPU's form: no grid, each group's rows walked in static tiles ----

def walked_kernel(lhs_ref, rhs_ref, ends_ref, *rest, transpose_rhs: bool, chunk: int,
                  in_output_dtype: bool):
    *bias_ref, out_ref = rest
    m = lhs_ref.shape[0]
    lhs, rhs, ends = lhs_ref[...], rhs_ref[...], ends_ref[...]
    bias = bias_ref[0][...] if bias_ref else None
    first = starts(ends)

    def group(g, out):
        w = rhs[g]
        b = None if bias is None else bias[g]

        def visit(out, row, size, mask):
            y = contract(jax.lax.dynamic_slice_in_dim(lhs, row, size), w, transpose_rhs,
                         out.dtype if in_output_dtype else jnp.float32)
            if b is not None:
                y = y + b
            y = y.astype(out.dtype)
            if mask is not None:
                kept = jax.lax.dynamic_slice_in_dim(out, row, size)
                y = jnp.where(mask[:, None], y, kept)
            return jax.lax.dynamic_update_slice_in_dim(out, y, row, 0)

        return walk_rows(visit, out, first[g], ends[g], rows=m, chunk=chunk)

    # Rows past the last group stay zero.
    out = jnp.zeros(out_ref.shape, out_ref.dtype)
    out_ref[...] = jax.lax.fori_loop(0, ends.shape[0], group, out)


# --- the TPU's form: a pipeline over (N tiles, visits, K tiles) ----------

def row_tile_visits(ends, rows: int, block_m: int):
    """(group of each visit, row tile of each visit, visit count): every
    row tile once per group with rows in it, in order, the rows past the
    last group as group G (one more visit list entry per tile they touch).
    Sized for the most visits (row tiles + G), the count on device."""
    groups = ends.shape[0]
    all_ends = jnp.concatenate([ends, jnp.full((1,), rows, ends.dtype)])
    first = starts(all_ends)
    sizes = all_ends - first
    first_tile = first // block_m
    last_tile = (all_ends - 1) // block_m
    tiles = jnp.where(sizes > 0, last_tile - first_tile + 1, 0)
    bound = cdiv(rows, block_m) + groups
    group_of = jnp.repeat(jnp.arange(groups + 1, dtype=jnp.int32), tiles,
                          total_repeat_length=bound)
    before = jnp.cumsum(tiles) - tiles
    tile_of = first_tile[group_of] + jnp.arange(bound, dtype=jnp.int32) - before[group_of]
    return group_of, tile_of.astype(jnp.int32), jnp.sum(tiles).astype(jnp.int32)


def pipelined_kernel(lhs_hbm, rhs_hbm, bounds_hbm, visits_hbm, *rest, transpose_rhs: bool,
                     blocks, num_cores: int, has_bias: bool):
    """bounds_hbm (G + 1, 2): each group's [start, end), the last the rows
    past every group; visits_hbm (2, V + 1): each visit's group and row tile,
    then the visit count in [0, V]."""
    if has_bias:
        bias_hbm, out_hbm, bounds, visits, acc = rest
    else:
        bias_hbm, (out_hbm, bounds, visits, acc) = None, rest
    bm, bn, bk = blocks
    m, k = lhs_hbm.shape
    n = out_hbm.shape[1]
    groups = rhs_hbm.shape[0]
    pltpu.sync_copy(bounds_hbm, bounds)
    pltpu.sync_copy(visits_hbm, visits)
    count = visits[0, visits.shape[1] - 1]
    k_steps = k // bk

    def weight_group(i):  # the rows past every group read group G - 1's weight, unused
        return jnp.minimum(visits[0, i], groups - 1)

    def body(lhs_vmem, rhs_vmem, *refs):
        *bias_vmem, out_vmem = refs
        i, kk = pl.program_id(1), pl.program_id(2)
        g, tile = visits[0, i], visits[1, i]

        @pl.when(kk == 0)
        def _():
            acc[...] = jnp.zeros_like(acc)

        @pl.when(g < groups)
        def _():
            acc[...] += contract(lhs_vmem[...], rhs_vmem[0], transpose_rhs)

        @pl.when(kk == k_steps - 1)
        def _():
            row = tile * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
            mine = (row >= bounds[g, 0]) & (row < bounds[g, 1])
            y = acc[...]
            if bias_vmem:
                y = y + bias_vmem[0][0]
            y = jnp.where(g < groups, y, 0.0).astype(out_vmem.dtype)
            first_visit = (i == 0) | (visits[1, jnp.maximum(i - 1, 0)] != tile)
            kept = jnp.where(first_visit, jnp.zeros_like(y), out_vmem[...])
            out_vmem[...] = jnp.where(mine, y, kept)

    rhs_block = (1, bn, bk) if transpose_rhs else (1, bk, bn)

    def rhs_index(j, i, kk):
        return (weight_group(i), j, kk) if transpose_rhs else (weight_group(i), kk, j)

    in_specs = [pl.BlockSpec((bm, bk), lambda j, i, kk: (visits[1, i], kk)),
                pl.BlockSpec(rhs_block, rhs_index)]
    inputs = [lhs_hbm, rhs_hbm]
    if has_bias:
        in_specs.append(pl.BlockSpec((1, 1, bn), lambda j, i, kk: (weight_group(i), 0, j)))
        inputs.append(bias_hbm)
    pltpu.emit_pipeline(
        body,
        grid=(n // bn, count, k_steps),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda j, i, kk: (visits[1, i], j)),
        **pipeline_core_split(num_cores, parallel_dims=1, sequential_dims=2),
    )(*inputs, out_hbm)


def pipelined(lhs, rhs, ends, bias, *, transpose_rhs, out_dtype, config, num_cores, interpret):
    m, k = lhs.shape
    groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    mp, np_, kp = round_up(m, bm), round_up(n, bn), round_up(k, bk)
    group_of, tile_of, count = row_tile_visits(ends, mp, bm)
    visits = jnp.stack([group_of, tile_of])
    visits = jnp.concatenate([visits, jnp.stack([count, count])[:, None]], axis=1)
    all_ends = jnp.concatenate([ends, jnp.full((1,), mp, ends.dtype)])
    bounds = jnp.stack([starts(all_ends), all_ends], axis=1).astype(jnp.int32)
    inputs = [pad_to(lhs, (mp, kp)),
              pad_to(rhs, (groups, np_, kp) if transpose_rhs else (groups, kp, np_)),
              bounds, visits]
    if bias is not None:
        inputs.append(pad_to(bias, (groups, np_)).reshape(groups, 1, np_))
    out = chip.kernel(
        functools.partial(pipelined_kernel, transpose_rhs=transpose_rhs, blocks=(bm, bn, bk),
                          num_cores=num_cores, has_bias=bias is not None),
        out_type=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        mesh=tensorcore_mesh(num_cores),
        scratch_types=[pltpu.SMEM(bounds.shape, jnp.int32), pltpu.SMEM(visits.shape, jnp.int32),
                       pltpu.VMEM((bm, bn), jnp.float32)],
        vmem_limit=config.vmem_limit,
        interpret=interpret,
    )(*inputs)
    return out[:m, :n]


def grouped_mm(lhs, rhs, ends, bias=None, *, transpose_rhs: bool, out_dtype: str,
               config: GroupedMatmulConfig, num_cores: int, interpret):
    """(M, N) in `out_dtype`: each group's rows of lhs times its rhs (+ its
    bias), float32 accumulation, one rounding; rows past ends[-1] zero."""
    m = lhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    ends = ends.astype(jnp.int32)
    if config.gridless and num_cores == 1:
        kernel = functools.partial(walked_kernel, transpose_rhs=transpose_rhs,
                                   chunk=config.block_m,
                                   in_output_dtype=config.dot_in_output_dtype)
        inputs = (lhs, rhs, ends) + (() if bias is None else (bias,))
        return gridless.call(kernel, jax.ShapeDtypeStruct((m, n), jnp.dtype(out_dtype)),
                             *inputs, interpret=interpret)
    if config.gridless:  # the CPU's config on a mesh of several cores
        config = GroupedMatmulConfig.default("tpu_interpret")
    return pipelined(lhs, rhs, ends, bias, transpose_rhs=transpose_rhs,
                     out_dtype=jnp.dtype(out_dtype), config=config, num_cores=num_cores,
                     interpret=interpret)


def flops(avals, params) -> float:
    (lhs_shape, _), (rhs_shape, _), *_ = avals
    m, k = lhs_shape
    n = rhs_shape[1] if params["transpose_rhs"] else rhs_shape[2]
    return 2.0 * m * k * n


# --- the CPU's GEMM library for the tiles' dots ---------------------------
# The Qwen3-MoE-shaped product (8192 x 1024) @ (8, 1024, 1536)^T, 2-core AMD
# EPYC (AVX-512, AVX512-BF16), medians of interleaved rounds: float32 in 145
# ms with XLA's default library against 173 with oneDNN (torch's F.grouped_mm
# 146); bfloat16 in 164 ms as float32 dots against 204 with oneDNN's 16-bit
# dots in float32 out, and 117 in bfloat16 out (torch 71; rough figures,
# other jobs were running).

def cpu_16bit_dot(backend: str, avals, params) -> bool:
    """Whether the `interpret` backend's tiles take oneDNN's 16-bit dot:
    16-bit inputs, their own dtype out, no bias, and a CPU and XLA that
    give oneDNN such dots (matmul.onednn_takes_16bit)."""
    (_, dtype), *_ = avals
    return (backend == "interpret" and len(avals) == 3 and params["out_dtype"] == dtype
            and dtype in ("bfloat16", "float16") and onednn_takes_16bit(dtype))


def compiler_options(backend: str, avals, params) -> dict:
    return ONEDNN_16BIT_DOT if cpu_16bit_dot(backend, avals, params) else {}


def chip_config(m: int, n: int, k: int, dtype: str, device=None) -> GroupedMatmulConfig:
    """CHIP_BLOCKS, each cut to its dimension rounded up to the tile (16
    rows, 128 lanes): small operands are one tile, not padded to 512; N and
    K tiles that divide their dimension where one of at least half the size
    does (shapes.fitted_block): Mixtral's 1792 columns per expert in two
    tiles of 896, not padded to 2048, which copied the weight into a padded
    one on every call and computed 14% more."""
    bm, bn, bk = CHIP_BLOCKS["bfloat16" if dtype == "bfloat16" else "float32"]
    return GroupedMatmulConfig(block_m=min(bm, round_up(m, 16)), block_n=fitted_block(n, bn, 128),
                               block_k=fitted_block(k, bk, 128),
                               vmem_limit=chip.vmem_limit(device))


def select_config(backend: str, avals, params, device=None) -> GroupedMatmulConfig:
    if backend == "tpu":
        (lhs, dtype), (rhs, _), *_ = avals
        n = rhs[1] if params["transpose_rhs"] else rhs[2]
        return chip_config(lhs[0], n, lhs[1], dtype, device)
    config = GroupedMatmulConfig.default(backend)
    if cpu_16bit_dot(backend, avals, params):
        return dataclasses.replace(config, dot_in_output_dtype=True)
    return config


KERNEL = KernelSpec(run=chip.widening_float16(grouped_mm), default_config=GroupedMatmulConfig.default,
                    select_config=select_config, compiler_options=compiler_options, flops=flops)
