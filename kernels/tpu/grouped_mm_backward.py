"""Grouped matmul contracting over ragged rows on TPU: out[g] =
lhs[rows of g].T @ rhs[rows of g], (G, K, N), the weight gradient of a
mixture of experts (and the 2-D x 2-D form of torch's grouped_mm); after
megablox's tgmm (JAX's pallas/ops/tpu/megablox), the schedule our own.

On a TPU (and its simulator) `pltpu.emit_pipeline` walks (K tiles, N
tiles, visits): the visits, innermost and read from SMEM, are each group's
row tiles in order, and one visit for an empty group, so its block is
written (zeros). A group's output block stays in VMEM while its visits run;
the float32 accumulator is zeroed at a group's first visit and stored at its
last. In a tile the group shares with another (its first and last), both
operands' rows outside the group are masked with a select, so rows past the
last group (a gradient's padding) never reach the sums, NaN included; the
tiles wholly inside a group go to the MXU as they are. K and N tiles are
PARALLEL, split across the TensorCores.

On the CPU (`interpret`) the kernel has no grid: its body walks each group's
rows in static tiles (kernels/grouped_mm_groups.walk_rows), one XLA dot
each into the group's accumulator.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels import gridless
from torch_pallas.kernels.grouped_mm_groups import starts, walk_rows
from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.shapes import cdiv, round_up
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu.cores import pipeline_core_split, tensorcore_mesh
from torch_pallas.kernels.tpu import chip
from torch_pallas.kernels.tpu.grouped_mm import GroupedMatmulConfig, chip_config
from torch_pallas.kernels.tpu.matmul import ONEDNN_16BIT_DOT, ONEDNN_DOT, onednn_takes_16bit


def contract_rows(x, y):
    """x.T @ y over their rows, float32 out (float32 in full)."""
    return jax.lax.dot_general(x, y, (((0,), (0,)), ((), ())), precision=chip.precision(x.dtype),
                               preferred_element_type=jnp.float32)


# --- the CPU's form --------------------------------------------------------

def walked_kernel(lhs_ref, rhs_ref, ends_ref, out_ref, *, chunk: int):
    m, k = lhs_ref.shape
    n = rhs_ref.shape[1]
    lhs, rhs, ends = lhs_ref[...], rhs_ref[...], ends_ref[...]
    first = starts(ends)

    def group(g, out):
        def visit(acc, row, size, mask):
            x = jax.lax.dynamic_slice_in_dim(lhs, row, size)
            y = jax.lax.dynamic_slice_in_dim(rhs, row, size)
            if mask is not None:
                x = jnp.where(mask[:, None], x, jnp.zeros_like(x))
                y = jnp.where(mask[:, None], y, jnp.zeros_like(y))
            return acc + contract_rows(x, y)

        acc = walk_rows(visit, jnp.zeros((k, n), jnp.float32), first[g], ends[g], rows=m,
                        chunk=chunk)
        return out.at[g].set(acc.astype(out.dtype))

    out = jnp.zeros(out_ref.shape, out_ref.dtype)
    out_ref[...] = jax.lax.fori_loop(0, ends.shape[0], group, out)


# --- the TPU's form --------------------------------------------------------

def group_visits(ends, rows: int, block_m: int):
    """(group of each visit, row tile of each visit, visit count): each
    group's row tiles in order, one visit (of its first tile) for an empty
    group. Sized for the most visits (row tiles + 2G), the count on device."""
    groups = ends.shape[0]
    first = starts(ends)
    first_tile = jnp.minimum(first // block_m, cdiv(rows, block_m) - 1)
    last_tile = (ends - 1) // block_m
    tiles = jnp.where(ends > first, last_tile - first_tile + 1, 1)
    bound = cdiv(rows, block_m) + 2 * groups
    group_of = jnp.repeat(jnp.arange(groups, dtype=jnp.int32), tiles, total_repeat_length=bound)
    before = jnp.cumsum(tiles) - tiles
    tile_of = first_tile[group_of] + jnp.arange(bound, dtype=jnp.int32) - before[group_of]
    return group_of, tile_of.astype(jnp.int32), jnp.sum(tiles).astype(jnp.int32)


def pipelined_kernel(lhs_hbm, rhs_hbm, bounds_hbm, visits_hbm, out_hbm, bounds, visits, acc, *,
                     blocks, num_cores: int):
    """bounds_hbm (G, 2): each group's [start, end); visits_hbm (2, V + 1):
    each visit's group and row tile, then the visit count."""
    bm, bk, bn = blocks
    k, n = out_hbm.shape[1:]
    pltpu.sync_copy(bounds_hbm, bounds)
    pltpu.sync_copy(visits_hbm, visits)
    count = visits[0, visits.shape[1] - 1]

    def body(lhs_vmem, rhs_vmem, out_vmem):
        i = pl.program_id(2)
        g, tile = visits[0, i], visits[1, i]
        first_visit = (i == 0) | (visits[0, jnp.maximum(i - 1, 0)] != g)
        last_visit = (i == count - 1) | (visits[0, jnp.minimum(i + 1, count - 1)] != g)

        @pl.when(first_visit)
        def _():
            acc[...] = jnp.zeros_like(acc)

        start, end = bounds[g, 0], bounds[g, 1]
        inside = (tile * bm >= start) & ((tile + 1) * bm <= end)

        @pl.when(inside)  # every row of the tile is the group's
        def _():
            acc[...] += contract_rows(lhs_vmem[...], rhs_vmem[...])

        @pl.when(jnp.logical_not(inside))  # a group's first or last tile
        def _():
            row = tile * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
            mine = (row >= start) & (row < end)
            x, y = lhs_vmem[...], rhs_vmem[...]
            acc[...] += contract_rows(jnp.where(mine, x, jnp.zeros_like(x)),
                                      jnp.where(mine, y, jnp.zeros_like(y)))

        @pl.when(last_visit)
        def _():
            out_vmem[0] = acc[...].astype(out_vmem.dtype)

    pltpu.emit_pipeline(
        body,
        grid=(k // bk, n // bn, count),
        in_specs=[pl.BlockSpec((bm, bk), lambda a, b, i: (visits[1, i], a)),
                  pl.BlockSpec((bm, bn), lambda a, b, i: (visits[1, i], b))],
        out_specs=pl.BlockSpec((1, bk, bn), lambda a, b, i: (visits[0, i], a, b)),
        **pipeline_core_split(num_cores, parallel_dims=2),
    )(lhs_hbm, rhs_hbm, out_hbm)


def pipelined(lhs, rhs, ends, *, out_dtype, config, num_cores, interpret):
    m, k = lhs.shape
    n = rhs.shape[1]
    groups = ends.shape[0]
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    mp, np_, kp = round_up(m, bm), round_up(n, bn), round_up(k, bk)
    group_of, tile_of, count = group_visits(ends, mp, bm)
    visits = jnp.concatenate([jnp.stack([group_of, tile_of]),
                              jnp.stack([count, count])[:, None]], axis=1)
    bounds = jnp.stack([starts(ends), ends], axis=1).astype(jnp.int32)
    out = chip.kernel(
        functools.partial(pipelined_kernel, blocks=(bm, bk, bn), num_cores=num_cores),
        out_type=jax.ShapeDtypeStruct((groups, kp, np_), out_dtype),
        mesh=tensorcore_mesh(num_cores),
        scratch_types=[pltpu.SMEM(bounds.shape, jnp.int32), pltpu.SMEM(visits.shape, jnp.int32),
                       pltpu.VMEM((bk, bn), jnp.float32)],
        vmem_limit=config.vmem_limit,
        interpret=interpret,
    )(pad_to(lhs, (mp, kp)), pad_to(rhs, (mp, np_)), bounds, visits)
    return out[:, :k, :n]


def grouped_mm_backward(lhs, rhs, ends, *, out_dtype: str, config: GroupedMatmulConfig,
                        num_cores: int, interpret):
    """(G, K, N) in `out_dtype`: lhs[rows of g].T @ rhs[rows of g] per
    group, float32 accumulation, one rounding; empty groups zero, rows past
    ends[-1] ignored."""
    ends = ends.astype(jnp.int32)
    out_type = jax.ShapeDtypeStruct((ends.shape[0], lhs.shape[1], rhs.shape[1]),
                                    jnp.dtype(out_dtype))
    if config.gridless and num_cores == 1:
        return gridless.call(functools.partial(walked_kernel, chunk=config.block_m), out_type,
                             lhs, rhs, ends, interpret=interpret)
    if config.gridless:  # the CPU's config on a mesh of several cores
        config = GroupedMatmulConfig.default("tpu_interpret")
    return pipelined(lhs, rhs, ends, out_dtype=out_type.dtype, config=config,
                     num_cores=num_cores, interpret=interpret)


def flops(avals, params) -> float:
    (lhs_shape, _), (rhs_shape, _), _ = avals
    return 2.0 * lhs_shape[0] * lhs_shape[1] * rhs_shape[1]


# The CPU's GEMM library for the walk's dots (lhs^T @ rhs, float32 out):
# oneDNN's, as 16-bit dots for 16-bit operands where XLA hands it those. The
# weight gradient of the Qwen3-MoE gate-and-up product, (8192 x 1536)^T @
# (8192 x 1024) over 8 ragged groups, 2-core AMD EPYC (AVX-512, AVX512-BF16),
# medians of 4 interleaved rounds on an idle machine: float32 167-170 ms with
# XLA's default library, 148-151 with oneDNN (torch's F.grouped_mm backward,
# this and dA together, 291);
# bfloat16 199 against 140.

def compiler_options(backend: str, avals, params) -> dict:
    (_, dtype), *_ = avals
    if backend != "interpret":
        return {}
    if dtype == "float32":
        return ONEDNN_DOT
    return ONEDNN_16BIT_DOT if onednn_takes_16bit(dtype) else {}


def select_config(backend: str, avals, params, device=None) -> GroupedMatmulConfig:
    """On a chip, its tiles cut to (rows, K, N) (grouped_mm.chip_config)."""
    if backend == "tpu":
        (lhs, dtype), (rhs, _), _ = avals
        return chip_config(lhs[0], rhs[1], lhs[1], dtype, device)
    return GroupedMatmulConfig.default(backend)


KERNEL = KernelSpec(run=chip.widening_float16(grouped_mm_backward),
                    default_config=GroupedMatmulConfig.default, select_config=select_config,
                    compiler_options=compiler_options, flops=flops)
