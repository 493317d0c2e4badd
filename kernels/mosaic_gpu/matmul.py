"""Batched matrix multiplication on Hopper Tensor Cores: the Mosaic GPU
quickstart's pipelined `wgmma` kernel.

- Parallel grid: one CUDA block per (tile_m, tile_n) output tile of each
  batch (`grid=(B, M/tile_m, N/tile_n)`, `grid_names=('b', 'm', 'n')`); the
  batches are stacked along the rows of 2-D operands, so every TMA copy is
  a plain 2-D tile.
- Sequential pipeline over K: `plgpu.emit_pipeline` stages (tile_m, tile_k)
  and (tile_k, tile_n) tiles GMEM -> SMEM with TMA, `max_concurrent_steps`
  copies in flight, SMEM laid out for wgmma (128-byte swizzle).
- Each step issues `plgpu.wgmma` into a float32 `plgpu.ACC` and waits until
  at most one is in flight (`wgmma_wait(1)`); `delay_release=1` keeps a
  step's SMEM tiles alive while its wgmma may still read them.
- Drain: the accumulator, cast to the output dtype, goes to SMEM,
  `commit_smem` makes it visible to TMA, `copy_smem_to_gmem` writes the
  output tile and `wait_smem_to_gmem(0)` waits for it.

The accumulator lives in its own `pl.run_scoped` (Mosaic GPU interpret mode
cannot place it in one allocation with the SMEM scratch). Ragged M, N, K are
zero-padded to whole tiles once, outside the kernel. A batch of 1 is
broadcast against the other operand's by its tile index.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels.blocking import pad_to, round_up

SWIZZLE_BYTES = 128


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    tile_m: int
    tile_n: int
    tile_k_bytes: int  # tile_k = tile_k_bytes // element size (one swizzle row)
    max_concurrent_steps: int

    @classmethod
    def default(cls, backend: str) -> "MatmulConfig":
        return cls(tile_m=128, tile_n=128, tile_k_bytes=SWIZZLE_BYTES, max_concurrent_steps=2)

    def tile_k(self, dtype) -> int:
        return self.tile_k_bytes // jnp.dtype(dtype).itemsize


def default_config(backend: str) -> MatmulConfig:
    return MatmulConfig.default(backend)


def smem_transforms(dtype):
    """The SMEM tiling and swizzle wgmma reads its operands in."""
    swizzle_elems = SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(SWIZZLE_BYTES))


def matmul_kernel(a_gmem, b_gmem, o_gmem, o_smem, *, k_tiles, a_batched, b_batched,
                  tile_k, max_concurrent_steps):
    """a_gmem (Ba*Mp, Kp), b_gmem (Bb*Kp, Np), o_gmem (B*Mp, Np): batches
    stacked along the rows, each padded to whole tiles."""
    tile_m, tile_n = o_smem.shape
    m_tiles = o_gmem.shape[0] // tile_m // jax.lax.axis_size("b")
    pid_b = jax.lax.axis_index("b")
    pid_m = jax.lax.axis_index("m")
    pid_n = jax.lax.axis_index("n")
    a_row = (pid_b if a_batched else 0) * m_tiles + pid_m
    b_row = (pid_b if b_batched else 0) * k_tiles
    transforms = smem_transforms(a_gmem.dtype)

    def accumulate(acc):
        def step(_, a_smem, b_smem):
            plgpu.wgmma(acc, a_smem, b_smem)
            plgpu.wgmma_wait(1)  # keep one wgmma in flight

        plgpu.emit_pipeline(
            step,
            grid=(k_tiles,),
            in_specs=[
                plgpu.BlockSpec((tile_m, tile_k), lambda ki: (a_row, ki),
                                transforms=transforms, delay_release=1),
                plgpu.BlockSpec((tile_k, tile_n), lambda ki: (b_row + ki, pid_n),
                                transforms=transforms, delay_release=1),
            ],
            max_concurrent_steps=max_concurrent_steps,
        )(a_gmem, b_gmem)
        return acc[...]

    result = pl.run_scoped(accumulate, plgpu.ACC((tile_m, tile_n), jnp.float32))
    o_smem[...] = result.astype(o_smem.dtype)
    plgpu.commit_smem()
    out_rows = pl.ds((pid_b * m_tiles + pid_m) * tile_m, tile_m)
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[out_rows, pl.ds(pid_n * tile_n, tile_n)])
    plgpu.wait_smem_to_gmem(0)


def matmul(a, b, *, transpose_a: bool, transpose_b: bool, config: MatmulConfig, interpret):
    """Batched a @ b, accumulated in float32, in a's dtype.

    a: (Ba, M, K), or (Ba, K, M) with transpose_a; b: (Bb, K, N), or
    (Bb, N, K) with transpose_b; Ba and Bb are 1 or the batch B. Returns
    (B, M, N). Transposed operands are transposed here, by XLA (one copy).
    """
    if transpose_a:
        a = jnp.swapaxes(a, 1, 2)
    if transpose_b:
        b = jnp.swapaxes(b, 1, 2)
    batch = max(a.shape[0], b.shape[0])
    _, m, k = a.shape
    n = b.shape[2]
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k(a.dtype)
    mp, np_, kp = round_up(m, tile_m), round_up(n, tile_n), round_up(k, tile_k)
    a_rows = pad_to(a, (a.shape[0], mp, kp)).reshape(-1, kp)
    b_rows = pad_to(b, (b.shape[0], kp, np_)).reshape(-1, np_)
    out = plgpu.kernel(
        functools.partial(
            matmul_kernel, k_tiles=kp // tile_k, a_batched=a.shape[0] > 1,
            b_batched=b.shape[0] > 1, tile_k=tile_k,
            max_concurrent_steps=config.max_concurrent_steps,
        ),
        out_type=jax.ShapeDtypeStruct((batch * mp, np_), a.dtype),
        scratch_types=dict(o_smem=plgpu.SMEM((tile_m, tile_n), a.dtype)),
        grid=(batch, mp // tile_m, np_ // tile_n),
        grid_names=("b", "m", "n"),
        interpret=interpret,
    )(a_rows, b_rows)
    return out.reshape(batch, mp, np_)[:, :m, :n]


def matmul_reference(a, b, *, transpose_a: bool, transpose_b: bool):
    if transpose_a:
        a = jnp.swapaxes(a, 1, 2)
    if transpose_b:
        b = jnp.swapaxes(b, 1, 2)
    return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(a.dtype)
