"""Grouped matmul over ragged rows on Hopper Tensor Cores: out[rows of g] =
lhs[rows of g] @ rhs[g] (+ bias[g]) for the groups of rows that `ends`
(torch's `offs`) delimits, the forward of a mixture of experts; rows past
the last group are zero. The algorithm is megablox's and JAX's Mosaic GPU
ragged dot's (jax/experimental/pallas/ops/tpu/megablox/gmm.py,
jax/experimental/pallas/ops/gpu/ragged_dot_mgpu.py); the schedule and the
store are our own.

- Grid: one CUDA block per (row tile, N tile) of the output, so each block
  owns its output tile outright: a row tile that two groups share is never
  written by two blocks (no race, no read-modify-write in GMEM).
- The tile-to-group map is computed on the device by XLA from `ends`
  (`tile_groups`: the first and last group with rows in each row tile) and
  read by each block from GMEM with the groups' bounds; the grid's size is
  static (cdiv(M, tile_m) x cdiv(N, tile_n)), no host sync.
- Per group with rows in the tile (usually one; a straddled tile visits
  each of its groups in turn, megablox's bound cdiv(M, tile_m) + G - 1
  visits in all), K is pipelined GMEM -> SMEM by TMA with
  `plgpu.emit_pipeline` and multiplied by `wgmma` into a float32 `plgpu.ACC`,
  as kernels/mosaic_gpu/matmul.py does; the expert's weight is
  `rhs_gmem.at[g]`.
- Epilogue per group: the accumulator (+ the group's float32 bias row,
  copied to SMEM by TMA while the product runs), rounded once, replaces the rows of the group in an SMEM output tile (a
  select on the row index: the other rows keep what the tile held). The
  tile starts as zeros, so rows of no group come out zero; rows outside
  the group never reach it, NaN included (the product's rows are
  independent). One TMA store writes the finished tile.

Operands: lhs (M, K); rhs (G, K, N), or (G, N, K) with `transpose_rhs` (a
weight stored (out, in), read in place on the hardware: wgmma reads 16-bit
B either way); ends (G,) int32; optional bias (G, N) float32. Ragged M, N, K
are zero-padded to whole tiles outside the kernel (the simulator raises on
a block past an array's edge). float32 would run on the Tensor Cores as
TF32, which the op does not ask for: the hardware refuses it (`unsupported`),
the simulator multiplies float32 exactly. The simulator cannot run
transposed SMEM refs (jax 0.10), so there XLA transposes a (G, N, K) rhs
first; tests/test_grouped_mm_mosaic_gpu.py lowers the hardware's layouts for
sm_90a.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels.grouped_mm_groups import starts
from torch_pallas.kernels.mosaic_gpu import compat
from torch_pallas.kernels.mosaic_gpu.attention_blocks import Target
from torch_pallas.kernels.mosaic_gpu.tiles import SWIZZLE_BYTES, smem_transforms
from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.shapes import round_up
from torch_pallas.kernels.spec import KernelSpec

ROW_AXIS, COL_AXIS = "m", "n"


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    """tile_m, tile_n: the output tile a block owns (tile_m rows of lhs,
    the wgmma M, a multiple of 64); tile_k_bytes: one K step's row of a
    16-bit tile (one 128-byte swizzle row); max_concurrent_steps: K steps in
    flight."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k_bytes: int = SWIZZLE_BYTES
    max_concurrent_steps: int = 2

    @classmethod
    def default(cls, backend: str) -> "GroupedMatmulConfig":
        return cls()

    def tile_k(self, dtype) -> int:
        return self.tile_k_bytes // jnp.dtype(dtype).itemsize


def load_tile(target: Target, ref):
    """An SMEM tile in registers, in the WGMMA layout on the hardware."""
    if target.hardware:
        return compat.load(ref, layout=plgpu.Layout.WGMMA)
    return ref[...]


def rows_within(target: Target, shape, first_row, start, end, axis: int = 0):
    """A `shape` tile's mask of the rows (along `axis`) first_row + i that
    lie in [start, end)."""
    row = target.tile(jax.lax.broadcasted_iota(jnp.int32, shape, axis)) + first_row
    return (row >= start) & (row < end)


def checked_target(op: str, interpret, dtype) -> Target:
    """Where the kernel runs; float32 refused on the hardware (`unsupported`)."""
    target = Target.of(interpret)
    if target.hardware and jnp.dtype(dtype).itemsize == 4:
        raise ValueError(f"{op}: float32 cannot run on wgmma (TF32 only), and the op asks for "
                         "full float32")
    return target


def out_tile(shape, dtype):
    """The SMEM tile a block's output leaves through (by TMA), swizzled so
    WGMMA-layout registers store to and load from it without bank
    conflicts."""
    dtype = jnp.dtype(dtype)
    return plgpu.SMEM(shape, dtype, transforms=smem_transforms(dtype, shape[1] * dtype.itemsize))


def grouped_mm_kernel(lhs_gmem, rhs_gmem, bounds_gmem, tiles_gmem, *rest, transpose_rhs: bool,
                      has_bias: bool, tile_k: int, max_concurrent_steps: int, target: Target):
    """lhs_gmem (Mp, Kp); rhs_gmem (G, Kp, Np), or (G, Np, Kp) read
    transposed; bounds_gmem (2, G): each group's [start, end); tiles_gmem
    (2, Mp / tile_m): each row tile's first and last group with rows in it
    (first > last: none); bias_gmem (G, Np) float32 if `has_bias`; out
    (Mp, Np)."""
    if has_bias:
        bias_gmem, out_gmem, o_smem, bias_smem, bias_barrier = rest
    else:
        out_gmem, o_smem = rest
    tile_m, tile_n = o_smem.shape
    k_steps = lhs_gmem.shape[1] // tile_k
    mi, ni = jax.lax.axis_index(ROW_AXIS), jax.lax.axis_index(COL_AXIS)
    transforms = smem_transforms(lhs_gmem.dtype)
    lhs_spec = plgpu.BlockSpec((tile_m, tile_k), lambda k: (mi, k), transforms=transforms,
                               delay_release=1)
    if transpose_rhs and target.hardware:
        rhs_spec = plgpu.BlockSpec((tile_n, tile_k), lambda k: (ni, k), transforms=transforms,
                                   delay_release=1)
    else:
        rhs_spec = plgpu.BlockSpec((tile_k, tile_n), lambda k: (k, ni), transforms=transforms,
                                   delay_release=1)

    def product(g):
        """lhs's row tile @ rhs[g]'s column tile, float32."""
        def scoped(acc):
            def step(_, lhs_smem, rhs_smem):
                rhs_op = rhs_smem.transpose((1, 0)) if transpose_rhs and target.hardware \
                    else rhs_smem
                plgpu.wgmma(acc, lhs_smem, rhs_op)
                plgpu.wgmma_wait(1)  # keep one wgmma in flight

            plgpu.emit_pipeline(step, grid=(k_steps,), in_specs=[lhs_spec, rhs_spec],
                                max_concurrent_steps=max_concurrent_steps,
                                )(lhs_gmem, rhs_gmem.at[g])
            return acc[...]

        return pl.run_scoped(scoped, plgpu.ACC((tile_m, tile_n), jnp.float32))

    def group(g, carry):
        start, end = bounds_gmem[0, g], bounds_gmem[1, g]

        @pl.when(end > start)
        def _():
            if has_bias:  # in flight while the product runs
                plgpu.commit_smem()  # after the previous group's reads of bias_smem
                plgpu.copy_gmem_to_smem(bias_gmem.at[g, pl.ds(ni * tile_n, tile_n)], bias_smem,
                                        bias_barrier)
            y = product(g)
            if has_bias:
                plgpu.barrier_wait(bias_barrier)
                y = y + by_column(target, bias_smem, y.shape)
            mine = rows_within(target, y.shape, mi * tile_m, start, end)
            o_smem[...] = jnp.where(mine, y.astype(o_smem.dtype), load_tile(target, o_smem))

        return carry

    # Rows of no group stay zero.
    o_smem[...] = target.tile(jnp.zeros(o_smem.shape, o_smem.dtype))
    jax.lax.fori_loop(tiles_gmem[0, mi], tiles_gmem[1, mi] + 1, group, None)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[pl.ds(mi * tile_m, tile_m),
                                                 pl.ds(ni * tile_n, tile_n)])
    plgpu.wait_smem_to_gmem(0)


def by_column(target: Target, row_smem, shape):
    """A (tile_n,) SMEM row broadcast over a tile's rows (read in the
    WGMMA layout's column vector on the hardware, which loads it from SMEM
    only: the bias is staged there by TMA)."""
    if target.hardware:
        row = compat.load(row_smem, layout=plgpu.Layout.WGMMA.reduce(0))
    else:
        row = row_smem[...]
    return jax.lax.broadcast_in_dim(row, shape, (1,))


def tile_groups(ends, rows: int, tile_m: int):
    """(2, rows / tile_m) int32: each row tile's first and last group that
    may hold rows in it (empty groups between them hold none; first > last
    where no group does). Groups are contiguous runs of rows in order, so the
    groups of a tile are those ending past its first row and starting before
    its end."""
    first_rows = jnp.arange(0, rows, tile_m, dtype=jnp.int32)
    first = jnp.searchsorted(ends, first_rows, side="right")
    last = jnp.searchsorted(starts(ends), first_rows + tile_m, side="left") - 1
    return jnp.stack([first, last]).astype(jnp.int32)


def grouped_mm(lhs, rhs, ends, bias=None, *, transpose_rhs: bool, out_dtype: str,
               config: GroupedMatmulConfig, interpret):
    """(M, N) in `out_dtype`: each group's rows of lhs times its rhs (+ its
    bias), float32 accumulation, one rounding; rows past ends[-1] zero."""
    target = checked_target("grouped_mm", interpret, lhs.dtype)
    m, k = lhs.shape
    groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k(lhs.dtype)
    mp, np_, kp = round_up(m, tile_m), round_up(n, tile_n), round_up(k, tile_k)
    ends = ends.astype(jnp.int32)
    if transpose_rhs and not target.hardware:
        rhs, transpose_rhs = jnp.swapaxes(rhs, 1, 2), False  # see the module's doc
    rhs = pad_to(rhs, (groups, np_, kp) if transpose_rhs else (groups, kp, np_))
    inputs = [pad_to(lhs, (mp, kp)), rhs, jnp.stack([starts(ends), ends]),
              tile_groups(ends, mp, tile_m)]
    if bias is not None:
        inputs.append(pad_to(bias.astype(jnp.float32), (groups, np_)))
    out = plgpu.kernel(
        functools.partial(grouped_mm_kernel, transpose_rhs=transpose_rhs,
                          has_bias=bias is not None, tile_k=tile_k,
                          max_concurrent_steps=config.max_concurrent_steps, target=target),
        out_type=jax.ShapeDtypeStruct((mp, np_), jnp.dtype(out_dtype)),
        scratch_types=[out_tile((tile_m, tile_n), out_dtype)] + (
            [] if bias is None else [plgpu.SMEM((tile_n,), jnp.float32), plgpu.Barrier()]),
        grid=(mp // tile_m, np_ // tile_n),
        grid_names=(ROW_AXIS, COL_AXIS),
        interpret=interpret,
    )(*inputs)
    return out[:m, :n]


def flops(avals, params) -> float:
    (lhs_shape, _), (rhs_shape, _), *_ = avals
    m, k = lhs_shape
    n = rhs_shape[1] if params["transpose_rhs"] else rhs_shape[2]
    return 2.0 * m * k * n


def unsupported(backend: str, avals, params) -> str | None:
    """float32 on the Tensor Cores is TF32, and the op asks for full
    float32."""
    (_, dtype), *_ = avals
    if backend == "mosaic_gpu" and jnp.dtype(dtype).itemsize == 4:
        return ("multiplies on Tensor Cores, where wgmma reads float32 only as TF32, and "
                "grouped_mm asks for full float32")
    return None


KERNEL = KernelSpec(run=grouped_mm, default_config=GroupedMatmulConfig.default,
                    unsupported=unsupported, flops=flops)
