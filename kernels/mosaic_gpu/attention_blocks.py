"""What the Hopper attention kernels (attention.py, attention_backward.py)
share: the operands padded to whole blocks, the way each operand is staged
for `wgmma` on the hardware and in the simulator, the scores' softcap and
visibility (causal rule, padded keys, spans: `visible`, and the block range
a tile's spans reach, `block_range`), a tile's pipeline with or without warp
specialization (`tile_pipeline`), and the shared-memory budget.

Staging (`Target`). On the hardware wgmma reads 16-bit operands either way,
so a transposed operand (Kᵀ in Q Kᵀ, Vᵀ in dO Vᵀ, Pᵀ and dSᵀ in the
backward) is the SMEM tile as it lies, seen through `ref.transpose`;
a left operand computed in registers (P in P V, dS in dS K) stays there;
register arrays get their `wgmma` layouts by `plgpu.layout_cast`. The
simulator (jax 0.10) runs none of these: there XLA transposes K and V once
outside the kernels, so every SMEM tile is read as it is stored, register
operands go through an SMEM tile (`operand`), transposed ones are stored
transposed (`stage_transposed`), and layouts (which never change values)
are left to it. Everything else, the algorithm, the pipelines, every copy
and barrier, is the same code on both. (The simulator runs the kernels'
one-warpgroup form by default: see `tile_pipeline`.)

Padding. The simulator raises on a block past an array's edge where the
hardware's TMA zero-fills, so L, S are zero-padded to whole blocks and E, Ev
to a multiple of 64 (one 128-byte swizzle row of a 16-bit tile, what wgmma
and the swizzle need) outside the kernels; padded keys are made invisible
inside them (`visible`), padded query rows and head columns are cut off.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels import attention_dropout
from torch_pallas.kernels.attention_shapes import MAX_HEAD_DIM
from torch_pallas.kernels.mosaic_gpu import compat
from torch_pallas.kernels.mosaic_gpu.tiles import HOPPER_SMEM_BYTES, smem_transforms
from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.shapes import round_up

LOG2E = math.log2(math.e)  # scores are kept in base 2: exp2 is the fast exponential
HEAD_DIM_MULTIPLE = 64  # 16-bit elements in one 128-byte swizzle row
SUPPORTED_DTYPES = ("float16", "bfloat16")
# What Mosaic GPU allocates beside the kernels' own tiles (barriers,
# alignment): 2120-2128 bytes in every forward lowered for sm_90a; the budget
# checks keep this margin.
SMEM_SLACK_BYTES = 2560


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a kernel runs: the hardware (`interpret` None) or the simulator."""

    hardware: bool

    @classmethod
    def of(cls, interpret) -> "Target":
        return cls(hardware=interpret is None)

    def layout(self, x, layout):
        """`x` with the register layout `layout` on the hardware."""
        return plgpu.layout_cast(x, layout) if self.hardware else x

    def rows(self, x):
        """A per-row vector (one value per query row of a wgmma tile)."""
        return self.layout(x, plgpu.Layout.WGMMA.reduce(1))

    def tile(self, x):
        return self.layout(x, plgpu.Layout.WGMMA)

    def load_rows(self, ref):
        """A (rows,) SMEM vector, in the layout of a wgmma tile's rows."""
        if self.hardware:
            return compat.load(ref, layout=plgpu.Layout.WGMMA.reduce(1))
        return ref[...]

    def transposed(self, ref):
        """The transposed operand of a tile staged as (n, k) on the hardware
        (read in place), or already as (k, n) by XLA in the simulator."""
        return ref.transpose((1, 0)) if self.hardware else ref

    def transposed_shape(self, rows: int, cols: int) -> tuple[int, int]:
        """The SMEM shape of a (rows, cols) tile handed to wgmma transposed."""
        return (rows, cols) if self.hardware else (cols, rows)

    def operand(self, x, dtype, smem):
        """wgmma's A operand x (a register tile) in `dtype`: read from the
        registers on the hardware; stored to `smem` (allocated only for the
        simulator, whose wgmma reads SMEM only) in the simulator."""
        if self.hardware:
            return x.astype(dtype)
        smem[...] = x.astype(dtype)
        plgpu.commit_smem()
        return smem

    def stage_transposed(self, x, smem):
        """wgmma's A operand xᵀ, for a register tile x: x stored as it is and
        read transposed on the hardware, stored transposed in the simulator
        (`smem` has `transposed_shape(*x.shape)`)."""
        if self.hardware:
            smem[...] = x.astype(smem.dtype)
            plgpu.commit_smem()
            return smem.transpose((1, 0))
        smem[...] = x.T.astype(smem.dtype)
        plgpu.commit_smem()
        return smem


def padded_head_dim(e: int) -> int:
    if not 1 <= e <= MAX_HEAD_DIM:
        raise ValueError(f"attention: head dimension {e} is not in 1..{MAX_HEAD_DIM}")
    return round_up(e, HEAD_DIM_MULTIPLE)


def pad_rows(x, rows: int, cols: int | None = None, value: float = 0.0):
    """x (B, H, n[, c]) padded at the end of its last two axes (or its last,
    for 3-D x) to `rows` [and `cols`], with `value`."""
    shape = tuple(x.shape[:2]) + ((rows,) if cols is None else (rows, cols))
    if value == 0.0:
        return pad_to(x, shape)
    return jnp.pad(x, [(0, s - d) for d, s in zip(x.shape, shape)], constant_values=value)


def tile_transforms(dtype):
    """The SMEM layout of a tile wgmma reads or a wgmma-layout tile is stored
    to (128-byte swizzle)."""
    return smem_transforms(dtype)


def visible(s, target: Target, *, row0, col0, kv_len: int, causal: bool, ragged: bool,
            spans=None):
    """Scores s (rows, cols) of queries row0.. and keys col0.., -inf where a
    key is hidden: padding past kv_len (when `ragged`), or after the query
    (when `causal`), or outside the rows' spans (`spans`, a `RowSpans`). Only
    a block that holds such keys pays for the test (the last key block, the
    blocks on the diagonal, the blocks on a span's edge)."""
    if spans is not None:  # spans end at kv_len at most: they hide the padding too
        ragged = False
    if not (causal or ragged or spans is not None):
        return s
    rows, cols = s.shape
    partly_hidden = False
    if ragged:
        partly_hidden = col0 + cols > kv_len
    if causal:
        partly_hidden = jnp.logical_or(partly_hidden, col0 + cols - 1 > row0)
    if spans is not None:
        partly_hidden = jnp.logical_or(partly_hidden, spans.edge)

    def hide(s):
        col = target.tile(jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)) + col0
        shown = None
        if ragged:
            shown = col < kv_len
        if causal:  # the rows as a row vector: two per thread, not a tile's worth
            row = target.rows(jax.lax.iota(jnp.int32, rows)) + row0
            row = jax.lax.broadcast_in_dim(row, s.shape, [0])
            shown = (col <= row) if shown is None else (shown & (col <= row))
        if spans is not None:
            inside = spans.shown(col)
            shown = inside if shown is None else (shown & inside)
        return jnp.where(shown, s, -jnp.inf)

    return jax.lax.cond(partly_hidden, hide, lambda s: s, s)


@dataclasses.dataclass(frozen=True)
class RowSpans:
    """The spans (kernels/attention_shapes.py) of a score tile's rows: their
    starts and ends (wgmma row vectors, int32), and whether the tile may
    straddle a span's edge (`edge`, a scalar; where it is False every key
    of the tile is visible to every row, and no element mask is applied)."""

    starts: object
    ends: object
    edge: object

    def shown(self, col):
        """Which of the (rows, cols) key indices `col` the rows see."""
        starts = jax.lax.broadcast_in_dim(self.starts, col.shape, [0])
        ends = jax.lax.broadcast_in_dim(self.ends, col.shape, [0])
        return (col >= starts) & (col < ends)


def block_range(spans_gmem, first, last, block: int):
    """The blocks of `block` keys (or query rows) that rows (or keys)
    first..last reach, from their spans (spans_gmem (2, n) int32 in GMEM:
    starts, ends, both non-decreasing, so the reach is from the first one's
    start to the last one's end): (first block, number of blocks), and
    the range every one of them reaches, (full_from, full_to) (`straddles`)."""
    start, end = spans_gmem[0, first], spans_gmem[1, last]
    lo = start // block
    steps = jnp.maximum((end + block - 1) // block - lo, 0)
    return lo, steps, (spans_gmem[0, last], spans_gmem[1, first])


def straddles(lo, hi, full):
    """Whether a block [lo, hi) of keys (or rows) may hold one that some
    span of the tile leaves out: it is not inside `full` = (full_from,
    full_to)."""
    full_from, full_to = full
    return jnp.logical_or(lo < full_from, hi > full_to)


def softcapped(s, *, scale: float, softcap: float):
    """Raw scores S = Q Kᵀ in base 2: S * scale * log2 e, or with a softcap
    c the capped c * tanh(S * scale / c) * log2 e; and tanh's value t (None
    without a softcap), from which the backward's 1 - t² is taken."""
    if not softcap:
        return s * (scale * LOG2E), None
    t = jnp.tanh(s * (scale / softcap))
    return t * (softcap * LOG2E), t


def dropout_factors(row_keys, target: Target, *, col0, shape, dropout_p: float):
    """Z of a (rows, cols) score tile of keys col0..: dropout's 1 / (1 - p)
    or 0 per score, from the rows' keys (a wgmma row vector) and the key
    indices, in the tile's registers (kernels/attention_dropout.py)."""
    cols = target.tile(jax.lax.broadcasted_iota(jnp.int32, shape, 1)) + col0
    return attention_dropout.factors(jax.lax.broadcast_in_dim(row_keys, shape, [0]), cols,
                                     dropout_p)


def tile_pipeline(body, *, warp_specialized: bool, grid, in_specs, max_concurrent_steps: int,
                  compute_wgs: int, compute_context):
    """The pipeline of one tile: `run(*gmem_refs, allocations=...)`.

    Warp-specialized (`plgpu.emit_pipeline_warp_specialized`): a memory
    warpgroup (the last thread) issues the TMA copies for `compute_wgs`
    compute warpgroups, each running `compute_context(run_pipeline)`.
    Otherwise the one warpgroup of the program does both (`plgpu.emit_pipeline`),
    with the same `body(indices, *tiles, carry) -> carry` and context:
    the form the simulator runs (each simulated warpgroup of a
    warp-specialized kernel holds one of XLA's CPU worker threads while it
    waits at a barrier; with fewer workers than warpgroups, as on a 2-core
    machine, the simulation can deadlock)."""
    if warp_specialized:
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=grid, memory_registers=40,  # the memory warpgroup only issues copies
            in_specs=in_specs, wg_axis=WARPGROUP_AXIS, num_compute_wgs=compute_wgs,
            max_concurrent_steps=max_concurrent_steps, compute_context=compute_context)
    if compute_wgs != 1:
        raise ValueError(f"attention: {compute_wgs} compute warpgroups need warp specialization")

    def run(*gmem, allocations=None):
        del allocations  # emit_pipeline allocates its tiles per call
        compute_context(lambda carry: plgpu.emit_pipeline(
            body, grid=grid, in_specs=in_specs, max_concurrent_steps=max_concurrent_steps,
            init_carry=carry)(*gmem))

    run.get_allocations = lambda *gmem: None
    return run


WARPGROUP_AXIS = "wg"
# The persistent grid's axis: the kernels' `plgpu.nd_loop`s share their tiles over it.
PROGRAMS_AXIS = "programs"


def warpgroup(warp_specialized: bool):
    """This compute warpgroup's index in its program (0 without warp
    specialization, where the program is one warpgroup)."""
    return jax.lax.axis_index(WARPGROUP_AXIS) if warp_specialized else 0


def thread_axes(warp_specialized: bool, compute_wgs: int) -> dict:
    """`plgpu.kernel`'s thread keywords: the compute warpgroups and the
    memory one, or none (one warpgroup)."""
    if not warp_specialized:
        return {}
    return {"num_threads": compute_wgs + 1, "thread_name": WARPGROUP_AXIS}


def mask_view(mask_gmem, b, h):
    """The (Lp, Sp) additive mask seen by (batch b, query head h): a size-1
    batch or head axis is read at index 0 (broadcast, never copied)."""
    bm, hm = mask_gmem.shape[:2]
    return mask_gmem.at[b if bm > 1 else 0, h if hm > 1 else 0]


def fits_smem(nbytes: int) -> bool:
    return nbytes + SMEM_SLACK_BYTES <= HOPPER_SMEM_BYTES


def itemsize(dtype) -> int:
    return jnp.dtype(dtype).itemsize
