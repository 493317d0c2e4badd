"""Batched matrix multiplication on Hopper Tensor Cores, fast: the Mosaic GPU
quickstart's matmul (matmul.py) with the techniques the Mosaic GPU
pipelining guide names next.

- Warp specialization (`plgpu.emit_pipeline_warp_specialized`): a memory
  warpgroup with few registers issues the TMA copies; two compute warpgroups
  each own half of the output tile's columns and share the A tile.
- A deep pipeline (`max_concurrent_steps` 4-6) instead of `delay_release`.
- A tiled TMA epilogue: the accumulator leaves through small SMEM tiles (two
  slots per warpgroup), so the main loop keeps the SMEM.
- A persistent grid: one program per SM (`num_programs`) loops
  (`plgpu.nd_loop`) over the output tiles of every batch in an L2-friendly
  order (`plgpu.planar_snake`).

Operands come staged as for the quickstart's kernel (tiles.py), ragged
sizes zero-padded to whole tiles. Configurations are chosen per (device,
dtype, shape bucket) by matmul_tuning.py; the GPU's SM count is set by
matmul.py's `select_config`, since a kernel is handed no device.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels.mosaic_gpu.tiles import (
    HOPPER_SMEM_BYTES,
    SWIZZLE_BYTES,
    as_row_tiles,
    smem_transforms,
)


@dataclasses.dataclass(frozen=True)
class WarpSpecializedConfig:
    """Knobs of `warp_specialized_kernel`. The program's output tile is
    tile_m x (2 * tile_n): each compute warpgroup accumulates tile_m x tile_n."""

    tile_m: int
    tile_n: int
    max_concurrent_steps: int
    grid_tile_width: int = 4  # output tiles per planar-snake stripe
    grid_minor_n: bool = True  # stripes advance along N (else along M)
    epi_tile_m: int = 64
    epi_tile_n: int = 64
    tile_k_bytes: int = SWIZZLE_BYTES
    num_programs: int | None = None  # one per SM of the GPU; None: not known yet

    def tile_k(self, dtype) -> int:
        return self.tile_k_bytes // jnp.dtype(dtype).itemsize

    def smem_bytes(self, dtype) -> int:
        """Shared memory the kernel allocates: the pipeline's A and B tiles
        for every concurrent step, and the epilogue's slots."""
        size = jnp.dtype(dtype).itemsize
        per_step = (self.tile_m + 2 * self.tile_n) * self.tile_k(dtype) * size
        epilogue = 2 * self.epilogue_slots() * self.epi_tile_m * self.epi_tile_n * size
        return self.max_concurrent_steps * per_step + epilogue

    def epilogue_slots(self) -> int:
        return min(2, (self.tile_m * self.tile_n) // (self.epi_tile_m * self.epi_tile_n))

    def check(self, dtype) -> None:
        if self.tile_m % self.epi_tile_m or self.tile_n % self.epi_tile_n:
            raise ValueError(f"{self}: epilogue tiles must divide the warpgroup tile")
        if self.tile_m % 64:
            raise ValueError(f"{self.tile_m=} must be a multiple of 64 for wgmma")
        if self.smem_bytes(dtype) > HOPPER_SMEM_BYTES:
            raise ValueError(
                f"{self} needs {self.smem_bytes(dtype)} bytes of shared memory, "
                f"more than the {HOPPER_SMEM_BYTES} a Hopper block has"
            )


def warp_specialized_kernel(a_gmem, b_gmem, o_gmem, *, config, dtype, batch, m_tiles,
                            n_tiles, k_tiles, a_batched, b_batched, a_m_major, b_k_major):
    """a_gmem (Ba*Mp, Kp), or (Ba*Kp, Mp) if a_m_major; b_gmem (Bb*Kp, Np),
    or (Bb*Np, Kp) if b_k_major; o_gmem (B*Mp, Np): batches stacked along
    the rows, each padded to whole tiles."""
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k(dtype)
    cta_n = 2 * tile_n  # two compute warpgroups side by side along N
    epi_m, epi_n = config.epi_tile_m, config.epi_tile_n
    slots = config.epilogue_slots()
    operand_transforms = smem_transforms(dtype)
    size = jnp.dtype(dtype).itemsize

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_tiles,),
            memory_registers=40,  # the memory warpgroup only issues copies
            in_specs=[
                plgpu.BlockSpec((tile_k, tile_m) if a_m_major else (tile_m, tile_k),
                                (lambda k: (k, 0)) if a_m_major else (lambda k: (0, k)),
                                transforms=operand_transforms, memory_space=plgpu.SMEM),
                plgpu.BlockSpec((cta_n, tile_k) if b_k_major else (tile_k, cta_n),
                                (lambda k: (0, k)) if b_k_major else (lambda k: (k, 0)),
                                transforms=operand_transforms, memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=compute_context,
        )

    def ignore(*args, **kwargs):  # the bodies do not change the allocations
        return None

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
        out_smem=plgpu.SMEM((2, slots, epi_m, epi_n), dtype,
                            transforms=smem_transforms(dtype, epi_n * size)),
        collective_axes="wg",
    )
    def scope(allocations, out_smem):
        wg = jax.lax.axis_index("wg")
        wg_cols = pl.ds(wg * tile_n, tile_n)

        @plgpu.nd_loop((batch * m_tiles * n_tiles,), collective_axes="programs")
        def tile_loop(loop):
            (linear,) = loop.index
            b_idx = linear // (m_tiles * n_tiles)
            m_idx, n_idx = plgpu.planar_snake(
                linear % (m_tiles * n_tiles), (m_tiles, n_tiles),
                1 if config.grid_minor_n else 0, config.grid_tile_width,
            )
            out_rows = pl.ds((b_idx * m_tiles + m_idx) * tile_m, tile_m)
            cols = pl.ds(n_idx * cta_n, cta_n)
            a_first, b_first = (b_idx if a_batched else 0), (b_idx if b_batched else 0)
            if a_m_major:  # this tile's tile_m columns of A^T
                a_tile = a_gmem.at[pl.ds(a_first * k_tiles * tile_k, k_tiles * tile_k),
                                   pl.ds(m_idx * tile_m, tile_m)]
            else:
                a_tile = a_gmem.at[pl.ds((a_first * m_tiles + m_idx) * tile_m, tile_m), :]
            if b_k_major:  # this tile's cta_n rows of B^T
                b_tile = b_gmem.at[pl.ds((b_first * n_tiles + n_idx) * cta_n, cta_n), :]
            else:
                b_tile = b_gmem.at[pl.ds(b_first * k_tiles * tile_k, k_tiles * tile_k), cols]

            def compute_context(run_pipeline):
                @functools.partial(pl.run_scoped, acc=plgpu.ACC((tile_m, tile_n), jnp.float32))
                def _(acc):
                    run_pipeline(acc)
                    result = acc[...].astype(dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # slots free
                    for i in range(tile_m // epi_m):
                        for j in range(tile_n // epi_n):
                            slot = (i * (tile_n // epi_n) + j) % slots
                            plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
                            out_smem[wg, slot] = result[i * epi_m:(i + 1) * epi_m,
                                                        j * epi_n:(j + 1) * epi_n]
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(
                                out_smem.at[wg, slot],
                                o_gmem.at[out_rows, cols].at[:, wg_cols]
                                .at[pl.ds(i * epi_m, epi_m), pl.ds(j * epi_n, epi_n)],
                            )

            def step(indices, a_smem, b_smem, acc):
                if a_m_major:
                    a_smem = a_smem.transpose((1, 0))
                if b_k_major:
                    b_operand = b_smem.at[wg_cols, :].transpose((1, 0))
                else:
                    b_operand = b_smem.at[:, wg_cols]
                plgpu.wgmma(acc, a_smem, b_operand)
                plgpu.wgmma_wait(0)
                return acc

            pipeline(step, compute_context)(a_tile, b_tile, allocations=allocations)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def matmul_warp_specialized(a, b, *, a_m_major: bool, b_k_major: bool,
                            config: WarpSpecializedConfig, interpret):
    """Batched a @ b with `warp_specialized_kernel`; operands as for
    `as_row_tiles`, on `config.num_programs` programs."""
    config.check(a.dtype)
    if config.num_programs is None:
        raise ValueError(
            f"matmul (warp-specialized): {config} has num_programs=None; its persistent grid "
            "runs one program per SM of the target GPU (e.g. device.core_count), which "
            "matmul.select_config sets"
        )
    tile_k = config.tile_k(a.dtype)
    (batch, m, n, _), (mp, np_, kp), a_rows, b_rows = as_row_tiles(
        a, b, a_m_major, b_k_major, config.tile_m, 2 * config.tile_n, tile_k
    )
    out = plgpu.kernel(
        functools.partial(
            warp_specialized_kernel, config=config, dtype=a.dtype, batch=batch,
            m_tiles=mp // config.tile_m, n_tiles=np_ // (2 * config.tile_n),
            k_tiles=kp // tile_k, a_batched=a.shape[0] > 1, b_batched=b.shape[0] > 1,
            a_m_major=a_m_major, b_k_major=b_k_major,
        ),
        out_type=jax.ShapeDtypeStruct((batch * mp, np_), a.dtype),
        grid=(config.num_programs,),
        grid_names=("programs",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup
        ),
        interpret=interpret,
    )(a_rows, b_rows)
    return out.reshape(batch, mp, np_)[:, :m, :n]
