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

Operand layouts on the hardware: wgmma reads 16-bit operands either way, so
a transposed operand (`x @ w.t()`, `a.mT @ b`) is staged as it lies in
memory, (N, K) tiles of B or (K, M) tiles of A, and handed to wgmma through
`plgpu.transpose_ref`: no copy. float32 runs on the Tensor Cores as TF32,
which reads both operands K-major only: B is always staged (N, K) (read in
place when transposed, copied once otherwise) and A (M, K). The op asks for
TF32 only when torch allows it (`unsupported`). The simulator multiplies
float32 exactly and cannot run transposed SMEM refs (jax 0.10), so there
XLA transposes operands to (M, K) and (K, N) first; `tests/
test_mosaic_gpu_lowering.py` lowers every hardware layout for sm_90a.

`warp_specialized_kernel` is the fast Hopper kernel, after the techniques
the Mosaic GPU pipelining guide names next:
- warp specialization (`plgpu.emit_pipeline_warp_specialized`): a memory
  warpgroup with few registers issues the TMA copies, two compute warpgroups
  each own half of the output tile's columns and share the A tile;
- a deep pipeline (`max_concurrent_steps` 4-6) instead of `delay_release`;
- a tiled TMA epilogue: the accumulator leaves through small SMEM tiles
  (two slots per warpgroup), so the main loop keeps the SMEM;
- a persistent grid: one program per SM loops (`plgpu.nd_loop`) over the
  output tiles of every batch in an L2-friendly order (`plgpu.planar_snake`).
Its configurations are chosen per (device, dtype, shape bucket) by
kernels/mosaic_gpu/matmul_tuning.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels.blocking import pad_to, round_up
from torch_pallas.kernels.spec import KernelSpec

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



def select_config(backend: str, avals, params) -> MatmulConfig | WarpSpecializedConfig:
    """On a GPU, the warp-specialized kernel's tuned (or shipped) config for
    this shape; the simulator runs the quickstart's kernel with its hardware
    tiles (tests/test_matmul_tuning.py simulates every tuned config)."""
    if backend != "mosaic_gpu":
        return MatmulConfig.default(backend)
    from torch_pallas.kernels.mosaic_gpu import matmul_tuning

    (a_shape, dtype), (b_shape, _) = avals
    m, k = a_shape[1:][::-1] if params["transpose_a"] else a_shape[1:]
    n = b_shape[1] if params["transpose_b"] else b_shape[2]
    return matmul_tuning.config_for(dtype, m, n, k)


def smem_transforms(dtype, row_bytes: int = SWIZZLE_BYTES):
    """The SMEM tiling and swizzle for tiles whose rows hold `row_bytes`
    (wgmma operands: 128 bytes; epilogue tiles: their width)."""
    swizzle = plgpu.find_swizzle(row_bytes * 8)
    swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))


# Shared memory a block may use on Hopper (227 KiB).
HOPPER_SMEM_BYTES = 227 * 1024


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
    num_programs: int | None = None  # None: one per SM of the device

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
                a_smem = plgpu.transpose_ref(a_smem, (1, 0))
            if b_k_major:
                b_smem = plgpu.transpose_ref(b_smem, (1, 0))
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
                    a_smem = plgpu.transpose_ref(a_smem, (1, 0))
                if b_k_major:
                    b_operand = plgpu.transpose_ref(b_smem.at[wg_cols, :], (1, 0))
                else:
                    b_operand = b_smem.at[:, wg_cols]
                plgpu.wgmma(acc, a_smem, b_operand)
                plgpu.wgmma_wait(0)
                return acc

            pipeline(step, compute_context)(a_tile, b_tile, allocations=allocations)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def num_sms() -> int:
    return jax.devices()[0].core_count


def as_row_tiles(a, b, a_m_major: bool, b_k_major: bool, tile_m: int, tile_n: int,
                 tile_k: int):
    """(m, n, k, padded sizes, a rows, b rows): a (Ba, M, K), or (Ba, K, M)
    if a_m_major, and b (Bb, K, N), or (Bb, N, K) if b_k_major, zero-padded
    to whole tiles and stacked along the rows as 2-D arrays."""
    k, m = a.shape[1:] if a_m_major else a.shape[:0:-1]
    n = b.shape[1] if b_k_major else b.shape[2]
    mp, np_, kp = round_up(m, tile_m), round_up(n, tile_n), round_up(k, tile_k)
    if a_m_major:
        a_rows = pad_to(a, (a.shape[0], kp, mp)).reshape(-1, mp)
    else:
        a_rows = pad_to(a, (a.shape[0], mp, kp)).reshape(-1, kp)
    if b_k_major:
        b_rows = pad_to(b, (b.shape[0], np_, kp)).reshape(-1, kp)
    else:
        b_rows = pad_to(b, (b.shape[0], kp, np_)).reshape(-1, np_)
    return (m, n, k), (mp, np_, kp), a_rows, b_rows


def matmul_warp_specialized(a, b, *, a_m_major: bool, b_k_major: bool,
                            config: WarpSpecializedConfig, interpret):
    """Batched a @ b with `warp_specialized_kernel`; operands as for
    `as_row_tiles`."""
    config.check(a.dtype)
    batch = max(a.shape[0], b.shape[0])
    tile_k = config.tile_k(a.dtype)
    (m, n, _), (mp, np_, kp), a_rows, b_rows = as_row_tiles(
        a, b, a_m_major, b_k_major, config.tile_m, 2 * config.tile_n, tile_k
    )
    programs = config.num_programs or num_sms()
    out = plgpu.kernel(
        functools.partial(
            warp_specialized_kernel, config=config, dtype=a.dtype, batch=batch,
            m_tiles=mp // config.tile_m, n_tiles=np_ // (2 * config.tile_n),
            k_tiles=kp // tile_k, a_batched=a.shape[0] > 1, b_batched=b.shape[0] > 1,
            a_m_major=a_m_major, b_k_major=b_k_major,
        ),
        out_type=jax.ShapeDtypeStruct((batch * mp, np_), a.dtype),
        grid=(programs,),
        grid_names=("programs",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup
        ),
        interpret=interpret,
    )(a_rows, b_rows)
    return out.reshape(batch, mp, np_)[:, :m, :n]


def unsupported(backend: str, avals, params) -> str | None:
    """Why this backend cannot run the call as torch asks, or None: float32
    on the Tensor Cores is TF32, which torch does not allow by default."""
    if backend == "mosaic_gpu" and params.get("precision") == "ieee":
        return (
            "multiplies float32 on Tensor Cores, where wgmma reads float32 only as "
            "TF32, and torch asks for full float32 (allow TF32 with "
            "torch.backends.cuda.matmul.fp32_precision = 'tf32' or "
            "torch.set_float32_matmul_precision('high'))"
        )
    return None


def matmul(a, b, *, transpose_a: bool, transpose_b: bool,
           config: MatmulConfig | WarpSpecializedConfig, interpret, precision: str | None = None):
    """Batched a @ b, accumulated in float32, in a's dtype.

    a: (Ba, M, K), or (Ba, K, M) with transpose_a; b: (Bb, K, N), or
    (Bb, N, K) with transpose_b; Ba and Bb are 1 or the batch B. Returns
    (B, M, N). On the hardware operands are staged as they lie where wgmma
    can read them so (see the module's doc), else transposed here by XLA
    (one copy). float32 products are TF32 on the hardware (`precision`
    "tf32"; see `unsupported`) and exact in the simulator.
    """
    hardware, tf32 = interpret is None, jnp.dtype(a.dtype).itemsize == 4
    if hardware and tf32 and precision == "ieee":
        raise ValueError(f"matmul: precision {precision!r} cannot run on wgmma (TF32 only)")
    a_m_major = hardware and transpose_a and not tf32
    b_k_major = hardware and (transpose_b or tf32)
    if transpose_a != a_m_major:
        a = jnp.swapaxes(a, 1, 2)
    if transpose_b != b_k_major:
        b = jnp.swapaxes(b, 1, 2)
    if isinstance(config, WarpSpecializedConfig):
        return matmul_warp_specialized(a, b, a_m_major=a_m_major, b_k_major=b_k_major,
                                       config=config, interpret=interpret)
    batch = max(a.shape[0], b.shape[0])
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k(a.dtype)
    (m, n, _), (mp, np_, kp), a_rows, b_rows = as_row_tiles(
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


KERNEL = KernelSpec(run=matmul, default_config=MatmulConfig.default,
                    select_config=select_config, unsupported=unsupported)
