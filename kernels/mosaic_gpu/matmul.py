"""Batched matrix multiplication on Hopper Tensor Cores: the Mosaic GPU
quickstart's pipelined `wgmma` kernel, and the op's entry point, which runs
it or the fast warp-specialized kernel (matmul_warp_specialized.py),
whichever the config names.

The quickstart's kernel:
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

Operand layouts on the hardware, for both kernels (tiles.staged_layouts):
wgmma reads 16-bit operands either way, so a transposed operand
(`x @ w.t()`, `a.mT @ b`) is staged as it lies in memory, (N, K) tiles of B
or (K, M) tiles of A, and handed to wgmma through `ref.transpose`: no
copy. float32 runs on the Tensor Cores as TF32, which reads both operands
K-major only: B is always staged (N, K) (read in place when transposed,
copied once otherwise) and A (M, K). The op asks for TF32 only when torch
allows it (`unsupported`). The simulator multiplies float32 exactly and
cannot run transposed SMEM refs (jax 0.10), so there XLA transposes
operands to (M, K) and (K, N) first; `tests/test_mosaic_gpu_lowering.py`
lowers every hardware layout for sm_90a.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels.mosaic_gpu import matmul_tuning
from torch_pallas.kernels.mosaic_gpu.matmul_warp_specialized import (
    WarpSpecializedConfig,
    matmul_warp_specialized,
)
from torch_pallas.kernels.mosaic_gpu.tiles import (
    SWIZZLE_BYTES,
    as_row_tiles,
    smem_transforms,
    staged_layouts,
)
from torch_pallas.kernels.shapes import matmul_dims
from torch_pallas.kernels.spec import KernelSpec


class Precision(enum.Enum):
    """How float32 products may be computed (the op passes the value)."""

    IEEE = "ieee"  # full float32: not on wgmma
    TF32 = "tf32"  # the Tensor Cores' float32


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Knobs of `matmul_kernel`: one (tile_m, tile_n) output tile per block."""

    tile_m: int
    tile_n: int
    tile_k_bytes: int  # tile_k = tile_k_bytes // element size (one swizzle row)
    max_concurrent_steps: int

    @classmethod
    def default(cls, backend: str) -> "MatmulConfig":
        return cls(tile_m=128, tile_n=128, tile_k_bytes=SWIZZLE_BYTES, max_concurrent_steps=2)

    def tile_k(self, dtype) -> int:
        return self.tile_k_bytes // jnp.dtype(dtype).itemsize


def matmul_kernel(a_gmem, b_gmem, o_gmem, o_smem, *, k_tiles, a_batched, b_batched,
                  tile_k, max_concurrent_steps, a_m_major, b_k_major):
    """a_gmem (Ba*Mp, Kp), or (Ba*Kp, Mp) if a_m_major; b_gmem (Bb*Kp, Np),
    or (Bb*Np, Kp) if b_k_major; o_gmem (B*Mp, Np): batches stacked along
    the rows, each padded to whole tiles."""
    tile_m, tile_n = o_smem.shape
    m_tiles = o_gmem.shape[0] // tile_m // jax.lax.axis_size("b")
    n_tiles = jax.lax.axis_size("n")
    pid_b = jax.lax.axis_index("b")
    pid_m = jax.lax.axis_index("m")
    pid_n = jax.lax.axis_index("n")
    transforms = smem_transforms(a_gmem.dtype)
    if a_m_major:
        a_row = (pid_b if a_batched else 0) * k_tiles
        a_spec = plgpu.BlockSpec((tile_k, tile_m), lambda ki: (a_row + ki, pid_m),
                                 transforms=transforms, delay_release=1)
    else:
        a_row = (pid_b if a_batched else 0) * m_tiles + pid_m
        a_spec = plgpu.BlockSpec((tile_m, tile_k), lambda ki: (a_row, ki),
                                 transforms=transforms, delay_release=1)
    if b_k_major:
        b_row = (pid_b if b_batched else 0) * n_tiles + pid_n
        b_spec = plgpu.BlockSpec((tile_n, tile_k), lambda ki: (b_row, ki),
                                 transforms=transforms, delay_release=1)
    else:
        b_row = (pid_b if b_batched else 0) * k_tiles
        b_spec = plgpu.BlockSpec((tile_k, tile_n), lambda ki: (b_row + ki, pid_n),
                                 transforms=transforms, delay_release=1)

    def accumulate(acc):
        def step(_, a_smem, b_smem):
            if a_m_major:
                a_smem = a_smem.transpose((1, 0))
            if b_k_major:
                b_smem = b_smem.transpose((1, 0))
            plgpu.wgmma(acc, a_smem, b_smem)
            plgpu.wgmma_wait(1)  # keep one wgmma in flight

        plgpu.emit_pipeline(
            step,
            grid=(k_tiles,),
            in_specs=[a_spec, b_spec],
            max_concurrent_steps=max_concurrent_steps,
        )(a_gmem, b_gmem)
        return acc[...]

    result = pl.run_scoped(accumulate, plgpu.ACC((tile_m, tile_n), jnp.float32))
    o_smem[...] = result.astype(o_smem.dtype)
    plgpu.commit_smem()
    out_rows = pl.ds((pid_b * m_tiles + pid_m) * tile_m, tile_m)
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[out_rows, pl.ds(pid_n * tile_n, tile_n)])
    plgpu.wait_smem_to_gmem(0)


def matmul_pipelined(a, b, *, a_m_major: bool, b_k_major: bool, config: MatmulConfig,
                     interpret):
    """Batched a @ b with `matmul_kernel`; operands as for `as_row_tiles`."""
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k(a.dtype)
    (batch, m, n, _), (mp, np_, kp), a_rows, b_rows = as_row_tiles(
        a, b, a_m_major, b_k_major, tile_m, tile_n, tile_k
    )
    out = plgpu.kernel(
        functools.partial(
            matmul_kernel, k_tiles=kp // tile_k, a_batched=a.shape[0] > 1,
            b_batched=b.shape[0] > 1, tile_k=tile_k,
            max_concurrent_steps=config.max_concurrent_steps, a_m_major=a_m_major,
            b_k_major=b_k_major,
        ),
        out_type=jax.ShapeDtypeStruct((batch * mp, np_), a.dtype),
        scratch_types=dict(o_smem=plgpu.SMEM((tile_m, tile_n), a.dtype)),
        grid=(batch, mp // tile_m, np_ // tile_n),
        grid_names=("b", "m", "n"),
        interpret=interpret,
    )(a_rows, b_rows)
    return out.reshape(batch, mp, np_)[:, :m, :n]


def matmul(a, b, *, transpose_a: bool, transpose_b: bool,
           config: MatmulConfig | WarpSpecializedConfig, interpret,
           precision: Precision | str = Precision.TF32):
    """Batched a @ b, accumulated in float32, in a's dtype, by the kernel
    `config` is for (MatmulConfig: the quickstart's; WarpSpecializedConfig:
    the warp-specialized one).

    a: (Ba, M, K), or (Ba, K, M) with transpose_a; b: (Bb, K, N), or
    (Bb, N, K) with transpose_b; Ba and Bb are 1 or the batch B. Returns
    (B, M, N). On the hardware operands are staged as they lie where wgmma
    can read them so (see the module's doc), else transposed here by XLA
    (one copy). float32 products are TF32 on the hardware (`precision`
    "ieee" raises there; see `unsupported`) and exact in the simulator.
    """
    hardware, precision = interpret is None, Precision(precision)
    if hardware and jnp.dtype(a.dtype).itemsize == 4 and precision is Precision.IEEE:
        raise ValueError(f"matmul: precision {precision.value!r} cannot run on wgmma (TF32 only)")
    a_m_major, b_k_major = (staged_layouts(a.dtype, transpose_a, transpose_b) if hardware
                            else (False, False))
    if transpose_a != a_m_major:
        a = jnp.swapaxes(a, 1, 2)
    if transpose_b != b_k_major:
        b = jnp.swapaxes(b, 1, 2)
    if isinstance(config, WarpSpecializedConfig):
        run = matmul_warp_specialized
    elif isinstance(config, MatmulConfig):
        run = matmul_pipelined
    else:
        raise TypeError(f"matmul: {config=} is neither a MatmulConfig nor a WarpSpecializedConfig")
    return run(a, b, a_m_major=a_m_major, b_k_major=b_k_major, config=config,
               interpret=interpret)


def select_config(backend: str, avals, params, device=None) -> MatmulConfig | WarpSpecializedConfig:
    """On a GPU, the warp-specialized kernel's tuned (or shipped) config for
    this shape on `device` (the JAX GPU the kernel is built for; None: JAX's
    first), with one program per SM of it; the simulator runs the
    quickstart's kernel with its hardware tiles (tests/test_matmul_tuning.py
    simulates every tuned config)."""
    if backend != "mosaic_gpu":
        return MatmulConfig.default(backend)
    (a_shape, dtype), (b_shape, _) = avals
    _, m, n, k = matmul_dims(a_shape, b_shape, params["transpose_a"], params["transpose_b"])
    gpu = device if device is not None else matmul_tuning.default_gpu()
    cache = matmul_tuning.TuningCache(device_kind=gpu.device_kind)
    config = matmul_tuning.config_for(dtype, m, n, k, cache=cache)
    return dataclasses.replace(config, num_programs=gpu.core_count)


def unsupported(backend: str, avals, params) -> str | None:
    """Why this backend cannot run the call as torch asks, or None: float32
    on the Tensor Cores is TF32, which torch does not allow by default."""
    precision = Precision(params.get("precision", Precision.TF32))
    if backend == "mosaic_gpu" and precision is Precision.IEEE:
        return (
            "multiplies float32 on Tensor Cores, where wgmma reads float32 only as "
            "TF32, and torch asks for full float32 (allow TF32 with "
            "torch.backends.cuda.matmul.fp32_precision = 'tf32' or "
            "torch.set_float32_matmul_precision('high'))"
        )
    return None


KERNEL = KernelSpec(run=matmul, default_config=MatmulConfig.default,
                    select_config=select_config, unsupported=unsupported)
