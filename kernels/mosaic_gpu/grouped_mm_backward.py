"""Grouped matmul contracting over ragged rows on Hopper Tensor Cores:
out[g] = lhs[rows of g].T @ rhs[rows of g], (G, K, N), the weight gradient
of a mixture of experts (and the 2-D x 2-D form of torch's grouped_mm);
after megablox's tgmm and JAX's Mosaic GPU transposed ragged dot
(jax/experimental/pallas/ops/tpu/megablox/gmm.py,
jax/experimental/pallas/ops/gpu/transposed_ragged_dot_mgpu.py).

- Grid: one CUDA block per (group, K tile, N tile) of the output; each
  block writes its whole output tile once, so every group's block is
  written, an empty group's as exact zeros (its pipeline is skipped).
- The contraction walks the group's row tiles, from the tile holding its
  first row to the one holding its last (a count known on the device only:
  the pipeline's grid is dynamic), staged GMEM -> SMEM by TMA with
  `plgpu.emit_pipeline` and multiplied by `wgmma` into a float32
  `plgpu.ACC`: lhs's (rows, K) tile read transposed as wgmma's A (16-bit A
  is read either way), rhs's (rows, N) tile as B.
- A group's first and last row tiles may hold rows of other groups (or rows
  past the last group, a gradient's padding): on those steps both operands'
  rows outside the group are zeroed in SMEM with a select, not a multiply,
  so NaN there never reaches the sums, then fenced for wgmma's async reads.
  Tiles wholly inside the group go to wgmma untouched.

Ragged M, N, K are zero-padded to whole tiles outside the kernel. As in
grouped_mm.py: the simulator cannot run transposed SMEM refs (jax 0.10), so
there XLA hands lhs over transposed, (K, M), and the mask applies to its
columns; float32 (TF32 on the Tensor Cores) is refused on the hardware and
exact in the simulator.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels.grouped_mm_groups import starts
from torch_pallas.kernels.mosaic_gpu.attention_blocks import Target
from torch_pallas.kernels.mosaic_gpu.grouped_mm import (
    checked_target,
    load_tile,
    out_tile,
    rows_within,
    unsupported,
)
from torch_pallas.kernels.mosaic_gpu.tiles import smem_transforms
from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.shapes import round_up
from torch_pallas.kernels.spec import KernelSpec

GROUP_AXIS, K_AXIS, N_AXIS = "g", "k", "n"


@dataclasses.dataclass(frozen=True)
class ContractionConfig:
    """tile_rows: the rows contracted per step (wgmma's K, a multiple of
    16); tile_k, tile_n: the output tile a block owns (tile_k is wgmma's M,
    a multiple of 64); max_concurrent_steps: row tiles in flight."""

    tile_rows: int = 64
    tile_k: int = 128
    tile_n: int = 128
    max_concurrent_steps: int = 2

    @classmethod
    def default(cls, backend: str) -> "ContractionConfig":
        return cls()


def _spec(shape, index, dtype):
    return plgpu.BlockSpec(shape, index, transforms=smem_transforms(dtype), delay_release=1)


def grouped_mm_backward_kernel(lhs_gmem, rhs_gmem, bounds_gmem, out_gmem, o_smem, *,
                               tile_rows: int, max_concurrent_steps: int, target: Target):
    """lhs_gmem (Mp, Kp), or (Kp, Mp) in the simulator; rhs_gmem (Mp, Np);
    bounds_gmem (2, G): each group's [start, end); out (G, Kp, Np)."""
    tile_k, tile_n = o_smem.shape
    g = jax.lax.axis_index(GROUP_AXIS)
    ki, ni = jax.lax.axis_index(K_AXIS), jax.lax.axis_index(N_AXIS)
    start, end = bounds_gmem[0, g], bounds_gmem[1, g]
    first_tile = start // tile_rows
    steps = (end + tile_rows - 1) // tile_rows - first_tile
    dtype = lhs_gmem.dtype
    if target.hardware:  # (rows, K) tiles, read transposed
        lhs_spec = _spec((tile_rows, tile_k), lambda s: (first_tile + s, ki), dtype)
    else:
        lhs_spec = _spec((tile_k, tile_rows), lambda s: (ki, first_tile + s), dtype)
    rhs_spec = _spec((tile_rows, tile_n), lambda s: (first_tile + s, ni), dtype)

    def keep_group_rows(smem, first_row, axis):
        x = load_tile(target, smem)
        mine = rows_within(target, x.shape, first_row, start, end, axis)
        smem[...] = jnp.where(mine, x, jnp.zeros_like(x))

    def scoped(acc):
        def step(indices, lhs_smem, rhs_smem):
            (s,) = indices
            first_row = (first_tile + s) * tile_rows

            @pl.when((first_row < start) | (first_row + tile_rows > end))
            def _():
                keep_group_rows(lhs_smem, first_row, 0 if target.hardware else 1)
                keep_group_rows(rhs_smem, first_row, 0)
                plgpu.commit_smem()  # visible to wgmma's async reads

            lhs_op = lhs_smem.transpose((1, 0)) if target.hardware else lhs_smem
            plgpu.wgmma(acc, lhs_op, rhs_smem)
            plgpu.wgmma_wait(1)  # keep one wgmma in flight

        @pl.when(end > start)
        def _():
            plgpu.emit_pipeline(step, grid=(steps,), in_specs=[lhs_spec, rhs_spec],
                                max_concurrent_steps=max_concurrent_steps)(lhs_gmem, rhs_gmem)

        return acc[...]

    o_smem[...] = pl.run_scoped(scoped, plgpu.ACC((tile_k, tile_n), jnp.float32)
                                ).astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[g, pl.ds(ki * tile_k, tile_k),
                                                 pl.ds(ni * tile_n, tile_n)])
    plgpu.wait_smem_to_gmem(0)


def grouped_mm_backward(lhs, rhs, ends, *, out_dtype: str, config: ContractionConfig, interpret):
    """(G, K, N) in `out_dtype`: lhs[rows of g].T @ rhs[rows of g] per
    group, float32 accumulation, one rounding; empty groups zero, rows past
    ends[-1] ignored."""
    target = checked_target("grouped_mm_backward", interpret, lhs.dtype)
    m, k = lhs.shape
    n = rhs.shape[1]
    ends = ends.astype(jnp.int32)
    groups = ends.shape[0]
    tile_rows, tile_k, tile_n = config.tile_rows, config.tile_k, config.tile_n
    mp, kp, np_ = round_up(m, tile_rows), round_up(k, tile_k), round_up(n, tile_n)
    lhs = pad_to(lhs, (mp, kp))
    if not target.hardware:
        lhs = lhs.T  # see the module's doc
    out_dtype = jnp.dtype(out_dtype)
    out = plgpu.kernel(
        functools.partial(grouped_mm_backward_kernel, tile_rows=tile_rows,
                          max_concurrent_steps=config.max_concurrent_steps, target=target),
        out_type=jax.ShapeDtypeStruct((groups, kp, np_), out_dtype),
        scratch_types=[out_tile((tile_k, tile_n), out_dtype)],
        grid=(groups, kp // tile_k, np_ // tile_n),
        grid_names=(GROUP_AXIS, K_AXIS, N_AXIS),
        interpret=interpret,
    )(lhs, pad_to(rhs, (mp, np_)), jnp.stack([starts(ends), ends]))
    return out[:, :k, :n]


def flops(avals, params) -> float:
    (lhs_shape, _), (rhs_shape, _), _ = avals
    return 2.0 * lhs_shape[0] * lhs_shape[1] * rhs_shape[1]


KERNEL = KernelSpec(run=grouped_mm_backward, default_config=ContractionConfig.default,
                    unsupported=unsupported, flops=flops)
