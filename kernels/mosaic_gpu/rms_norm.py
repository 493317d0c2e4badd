"""RMSNorm's forward on Hopper (Zhang & Sennrich 2019): rstd = 1 / sqrt(mean(x^2)
+ eps) per row and out = x * rstd * weight, rounded as the casting mode says
(kernels/rms_norm_casting.py, formulas in kernels/rms_norm_math.py): NONE
as `torch.nn.functional.rms_norm` (float32, rounded once to x's dtype),
LLAMA and GEMMA as those models' modules.

A program takes one block of 64 rows (a wgmma row tile: its row vectors
live in the registers' WGMMA layout, reduced along the row). A row wider
than shared memory would hold for 64 rows is walked twice, tile by tile
of 64 columns, by `plgpu.emit_pipeline` (TMA copies GMEM -> SMEM in
flight while the previous tile computes): once for the sum of squares,
once to write the output (SMEM -> GMEM by TMA), reading x twice from L2
or HBM instead of holding it. rstd leaves from the registers.

Rows and columns are zero-padded to whole tiles outside the kernel (the
simulator raises on a block past an array's edge where TMA zero-fills);
zeros add nothing to the sums, whose mean divides by the true width. The
weight is broadcast to one (64, N) tile row outside the kernel, so the
product is elementwise on two tiles of the same layout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels import rms_norm_math, shapes
from torch_pallas.kernels.mosaic_gpu import compat
from torch_pallas.kernels.mosaic_gpu.fences import fenced
from torch_pallas.kernels.mosaic_gpu.tiles import smem_transforms
from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.rms_norm_casting import Casting
from torch_pallas.kernels.shapes import round_up
from torch_pallas.kernels.spec import KernelSpec

ROW_AXIS = "rows"


@dataclasses.dataclass(frozen=True)
class RowTilesConfig:
    """Tiles of the row-wise kernels (rms_norm and its backward)."""

    block_rows: int = 64  # wgmma's row tile: the layout of the row vectors
    block_cols: int = 64
    max_concurrent_steps: int = 2

    @classmethod
    def default(cls, backend: str) -> "RowTilesConfig":
        return cls()

    def padded(self, rows: int, cols: int) -> tuple[int, int]:
        return round_up(rows, self.block_rows), round_up(cols, self.block_cols)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """How a kernel stages its tiles: as the hardware needs them (`hardware`:
    register arrays in the WGMMA layout, so row vectors reduce and broadcast
    along rows), or as the simulator runs them (layouts left to it)."""

    hardware: bool
    config: RowTilesConfig

    def spec(self, dtype, index):
        """A (block_rows, block_cols) tile of a `dtype` array at `index`."""
        shape = (self.config.block_rows, self.config.block_cols)
        row_bytes = self.config.block_cols * jnp.dtype(dtype).itemsize
        return plgpu.BlockSpec(shape, index, transforms=smem_transforms(dtype, row_bytes))

    def load(self, ref):
        """A tile, in float32, in the WGMMA layout on the hardware."""
        if self.hardware:
            return compat.load(ref, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        return ref[...].astype(jnp.float32)

    def load_rows(self, ref):
        """A (block_rows,) vector, in the layout of a WGMMA tile's rows."""
        if self.hardware:
            return compat.load(ref, layout=plgpu.Layout.WGMMA.reduce(1))
        return ref[...]

    def rows(self, x):
        return plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1)) if self.hardware else x

    def tile(self, x):
        return plgpu.layout_cast(x, plgpu.Layout.WGMMA) if self.hardware else x

    def steps(self, count: int) -> int:
        return min(self.config.max_concurrent_steps, count)

    def out_tile(self, dtype):
        """An SMEM tile a pipeline's results leave through (by TMA)."""
        shape = (self.config.block_rows, self.config.block_cols)
        row_bytes = self.config.block_cols * jnp.dtype(dtype).itemsize
        return plgpu.SMEM(shape, dtype, transforms=smem_transforms(dtype, row_bytes))


def store_tiles(pipeline, out_gmem, row_block: int, tiles: Tiles):
    """Runs `pipeline(write)`, in which `write(j, value)` stores a result
    tile to column tile j of `out_gmem`'s row block: through one SMEM tile,
    by TMA, the copy of a tile overlapping the next tile's loads and math.
    (Not the pipeline's out_specs: JAX 0.10's simulator cannot run their
    predicated copies.)"""
    config = tiles.config

    def scoped(out_smem):
        def write(j, value):
            plgpu.wait_smem_to_gmem(0)  # the previous tile has left the buffer
            out_smem[...] = value.astype(out_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[
                pl.ds(row_block * config.block_rows, config.block_rows),
                pl.ds(j * config.block_cols, config.block_cols)])

        pipeline(write)
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped, tiles.out_tile(out_gmem.dtype))


def by_row(v, shape):
    """The row vector v broadcast along the rows of a `shape` tile."""
    return jax.lax.broadcast_in_dim(v, shape, [0])


def rms_norm_kernel(x_gmem, *refs, n: int, eps: float, casting: Casting, has_weight: bool,
                    tiles: Tiles):
    """x_gmem (Rp, Np); the weight broadcast to (block_rows, Np) when
    `has_weight`; outputs o (Rp, Np) and rstd (Rp,) float32."""
    w_gmem, (o_gmem, rstd_gmem) = (refs[0], refs[1:]) if has_weight else (None, refs)
    config = tiles.config
    row_block = jax.lax.axis_index(ROW_AXIS)
    col_tiles = x_gmem.shape[1] // config.block_cols
    x_spec = tiles.spec(x_gmem.dtype, lambda j: (row_block, j))

    def squares(indices, x_smem, total):
        x = tiles.load(x_smem)
        return total + (x * x).sum(axis=1)

    total = plgpu.emit_pipeline(
        fenced(squares), grid=(col_tiles,), in_specs=[x_spec],
        max_concurrent_steps=tiles.steps(col_tiles),
        init_carry=tiles.rows(jnp.zeros((config.block_rows,), jnp.float32)),
    )(x_gmem)
    rstd = rms_norm_math.inverse_rms(total, n, eps, on_cpu=not tiles.hardware)
    # rstd straight from the registers: 256 bytes, not worth an SMEM tile
    rstd_gmem.at[pl.ds(row_block * config.block_rows, config.block_rows)][...] = rstd

    def normalize(write):
        def body(indices, x_smem, *w_smem):
            x = tiles.load(x_smem)
            w = tiles.load(w_smem[0]) if has_weight else None
            write(indices[0], rms_norm_math.output(x * by_row(rstd, x.shape), w, casting,
                                                   x_gmem.dtype))

        w_specs = [tiles.spec(w_gmem.dtype, lambda j: (0, j))] if has_weight else []
        plgpu.emit_pipeline(
            body, grid=(col_tiles,), in_specs=[x_spec, *w_specs],
            max_concurrent_steps=tiles.steps(col_tiles),
        )(x_gmem, *([w_gmem] if has_weight else []))

    store_tiles(normalize, o_gmem, row_block, tiles)


def weight_tile_row(weight, rows: int, cols: int):
    """The weight (N,) as a (rows, cols) array: broadcast, zero-padded."""
    return jnp.broadcast_to(pad_to(weight, (cols,)), (rows, cols))


def rms_norm(x, weight=None, *, eps: float, casting: Casting = Casting.NONE,
             config: RowTilesConfig, interpret):
    """(out, rstd) for x (..., N) and weight (N,) or None: out in x's shape
    and dtype (promote_types(x, weight) for a weighted LLAMA casting), rstd
    (...) float32."""
    x, lead = shapes.rows(x)
    rows, n = x.shape
    padded_rows, padded_cols = config.padded(rows, n)
    inputs = [pad_to(x, (padded_rows, padded_cols))]
    if weight is not None:
        inputs.append(weight_tile_row(weight, config.block_rows, padded_cols))
    tiles = Tiles(hardware=interpret is None, config=config)
    out_dtype = rms_norm_math.output_dtype(x, weight, casting)
    out, rstd = plgpu.kernel(
        functools.partial(rms_norm_kernel, n=n, eps=eps, casting=casting,
                          has_weight=weight is not None, tiles=tiles),
        out_type=(jax.ShapeDtypeStruct((padded_rows, padded_cols), out_dtype),
                  jax.ShapeDtypeStruct((padded_rows,), jnp.float32)),
        grid=(padded_rows // config.block_rows,),
        grid_names=(ROW_AXIS,),
        interpret=interpret,
    )(*inputs)
    return out[:rows, :n].reshape(*lead, n), rstd[:rows].reshape(lead)


KERNEL = KernelSpec(run=rms_norm, default_config=RowTilesConfig.default)
