"""Matrix multiplication on Hopper Tensor Cores: the Mosaic GPU quickstart's
pipelined `wgmma` kernel.

- Parallel grid: one CUDA block per (tile_m, tile_n) output tile
  (`grid=(M/tile_m, N/tile_n)`, `grid_names=('m', 'n')`).
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
zero-padded to whole tiles once, outside the kernel.
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


def matmul_kernel(a_gmem, b_gmem, o_gmem, o_smem, *, tile_k, max_concurrent_steps):
    tile_m, tile_n = o_smem.shape
    k = a_gmem.shape[1]
    pid_m = jax.lax.axis_index("m")
    pid_n = jax.lax.axis_index("n")
    transforms = smem_transforms(a_gmem.dtype)

    def accumulate(acc):
        def step(_, a_smem, b_smem):
            plgpu.wgmma(acc, a_smem, b_smem)
            plgpu.wgmma_wait(1)  # keep one wgmma in flight

        plgpu.emit_pipeline(
            step,
            grid=(k // tile_k,),
            in_specs=[
                plgpu.BlockSpec((tile_m, tile_k), lambda ki: (pid_m, ki),
                                transforms=transforms, delay_release=1),
                plgpu.BlockSpec((tile_k, tile_n), lambda ki: (ki, pid_n),
                                transforms=transforms, delay_release=1),
            ],
            max_concurrent_steps=max_concurrent_steps,
        )(a_gmem, b_gmem)
        return acc[...]

    result = pl.run_scoped(accumulate, plgpu.ACC((tile_m, tile_n), jnp.float32))
    o_smem[...] = result.astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(
        o_smem, o_gmem.at[pl.ds(pid_m * tile_m, tile_m), pl.ds(pid_n * tile_n, tile_n)]
    )
    plgpu.wait_smem_to_gmem(0)


def matmul(a, b, *, config: MatmulConfig, interpret):
    """a @ b for 2-D a (M, K) and b (K, N), accumulated in float32."""
    m, k = a.shape
    _, n = b.shape
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k(a.dtype)
    mp, np_, kp = round_up(m, tile_m), round_up(n, tile_n), round_up(k, tile_k)
    out = plgpu.kernel(
        functools.partial(
            matmul_kernel, tile_k=tile_k, max_concurrent_steps=config.max_concurrent_steps
        ),
        out_type=jax.ShapeDtypeStruct((mp, np_), a.dtype),
        scratch_types=dict(o_smem=plgpu.SMEM((tile_m, tile_n), a.dtype)),
        grid=(mp // tile_m, np_ // tile_n),
        grid_names=("m", "n"),
        interpret=interpret,
    )(pad_to(a, (mp, kp)), pad_to(b, (kp, np_)))
    return out[:m, :n]


def matmul_reference(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)
