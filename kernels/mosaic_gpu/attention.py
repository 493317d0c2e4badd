"""Attention forward on Hopper Tensor Cores (Mosaic GPU): FlashAttention's
online softmax, the contract of kernels/attention_shapes.py.

Algorithm (FlashAttention-2, Dao 2023, arXiv:2307.08691; the Hopper
structure after FlashAttention-3, Shah et al. 2024, arXiv:2407.08608):

- Tiles: `compute_wgs * block_q` query rows of one (batch, query head).
  A persistent grid of `num_programs` programs (one per SM) loops
  (`plgpu.nd_loop`) over them, query blocks of a head consecutive (they
  share its K and V in L2), causal ones longest first. Query head h reads
  key/value head h // G (GQA) by index; nothing is repeated in memory.
- Warp specialization (`plgpu.emit_pipeline_warp_specialized`): a memory
  warpgroup streams (block_kv, E) K and (block_kv, Ev) V tiles (and the
  program's (rows, block_kv) mask tile, if any) GMEM -> SMEM by TMA,
  `max_concurrent_steps` in flight, for `compute_wgs` compute warpgroups
  that share them, each owning `block_q` query rows. (Without it, the form
  select_config gives the simulator, one warpgroup does both with
  `plgpu.emit_pipeline`: attention_blocks.tile_pipeline.)
- Each compute warpgroup copies its Q tile to SMEM once; then per key block:
  S = Q Kᵀ by `wgmma` into a float32 accumulator; s = S * scale + mask in
  base 2 (times log2 e, so that `exp2` serves); padded keys and keys after
  the query (causal) set to -inf; the running row maximum m and sum l
  (float32) rescale the output accumulator by exp2(m_old - m_new); P =
  exp2(s - m), cast to the input dtype, and `wgmma` adds P V.
- Causal: key blocks entirely above a tile's diagonal are never loaded (its
  pipeline's length is its last visible key block).
- Epilogue: o = acc / l (0 for a row with no visible key) leaves through the
  Q tile's SMEM by TMA; lse = m + log l (natural log; +inf for such a row)
  from the registers.
- Dropout (kernels/attention_shapes.py): each compute warpgroup copies its
  rows' keys to SMEM with its Q tile and keeps them in registers (one per
  row, like m and l); P enters l as it is and P V dropped and rescaled,
  the mask hashed from the keys and the key indices in registers
  (attention_blocks.dropout_factors).
- Spans (kernels/attention_shapes.py: windows, packed sequences): each
  tile's pipeline starts at the key block of its first row's span start
  and ends at the block of its last valid row's span end (two scalars read
  from the (2, Lp) spans in GMEM by every warpgroup, so the memory one
  issues exactly the copies the compute ones wait for: a dynamic start and
  length, possibly 0); each compute warpgroup copies its rows' spans to
  SMEM with its Q tile and keeps them in registers, and masks only the
  blocks that cross a span's edge (attention_blocks.RowSpans). Work scales
  with the keys attended, not with L x S.
- Softcap c: s = c tanh(scale q.k / c), before the mask (one tanh per
  score; attention_blocks.softcapped).
- Without spans and softcap the kernel traced is the one traced before
  them (each is a static keyword only when used).

Operands are staged as attention_blocks.py describes (Kᵀ read in place and
P from the registers on the hardware; both through SMEM for the simulator)
and zero-padded there to whole blocks. float32 is refused (`unsupported`):
wgmma reads it only as TF32; the op then runs its Triton kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels.attention_shapes import attention_operands
from torch_pallas.kernels.mosaic_gpu import attention_launch
from torch_pallas.kernels.mosaic_gpu.attention_blocks import (
    LOG2E,
    PROGRAMS_AXIS,
    RowSpans,
    block_range,
    straddles,
    fits_smem,
    itemsize,
    mask_view,
    padded_head_dim,
    WARPGROUP_AXIS,
    dropout_factors,
    softcapped,
    tile_pipeline,
    tile_transforms,
    visible,
    warpgroup,
)
from torch_pallas.kernels.shapes import cdiv
from torch_pallas.kernels.spec import KernelSpec


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Knobs of `attention_kernel`: `compute_wgs` warpgroups of `block_q`
    query rows each per program, sharing its K/V tiles."""

    block_q: int  # query rows per compute warpgroup (wgmma's 64, or a multiple)
    block_kv: int
    max_concurrent_steps: int  # K/V (and mask) tiles in flight
    compute_wgs: int = 2
    # A memory warpgroup beside the compute ones (the hardware's choice), or
    # one warpgroup doing both (the simulator's: see attention_blocks.tile_pipeline).
    warp_specialized: bool = True
    # Programs of the persistent grid (one per SM of the GPU); None: one per tile.
    num_programs: int | None = None

    @classmethod
    def default(cls, backend: str) -> "AttentionConfig":
        return cls(block_q=64, block_kv=128, max_concurrent_steps=2)

    @property
    def block_rows(self) -> int:
        """Query rows per program."""
        return self.compute_wgs * self.block_q

    def smem_bytes(self, dtype, head_dim: int, value_dim: int, mask_dtype=None,
                   dropout: bool = False, spans: bool = False) -> int:
        """Shared memory on the hardware: each warpgroup's Q tile (its O
        tile too when E = Ev, else one beside it; its rows' dropout keys and
        spans) and the pipeline's K, V (and mask) tiles. (The simulator also
        stages P.)"""
        size = itemsize(dtype)
        e, ev = padded_head_dim(head_dim), padded_head_dim(value_dim)
        rows, bk = self.block_rows, self.block_kv
        per_step = bk * (e + ev) * size
        if mask_dtype is not None:
            per_step += rows * bk * itemsize(mask_dtype)
        fixed = rows * e * size + (0 if e == ev else rows * ev * size)
        if dropout:
            fixed += rows * 4
        if spans:
            fixed += rows * 8
        return fixed + self.max_concurrent_steps * per_step

    def fits(self, dtype, head_dim: int, value_dim: int, mask_dtype=None,
             dropout: bool = False, spans: bool = False) -> bool:
        return fits_smem(self.smem_bytes(dtype, head_dim, value_dim, mask_dtype, dropout, spans))

    def check(self, dtype, head_dim: int, value_dim: int, mask_dtype=None,
              dropout: bool = False, spans: bool = False) -> None:
        attention_launch.check_tiles("attention", self)
        nbytes = self.smem_bytes(dtype, head_dim, value_dim, mask_dtype, dropout, spans)
        if not fits_smem(nbytes):
            raise ValueError(f"attention: {self} needs {nbytes} bytes of shared memory for "
                             f"head dims {head_dim}/{value_dim}, more than a Hopper block has")


def attention_kernel(q_gmem, k_gmem, v_gmem, *refs, scale, causal, kv_len, group, has_mask,
                     target, config, dropout_p=0.0, softcap=0.0, spans=False, q_len=None):
    """q_gmem (B, Hq, Lp, Ep); k_gmem (B, Hkv, Sp, Ep), or (B, Hkv, Ep, Sp)
    in the simulator; v_gmem (B, Hkv, Sp, Evp); mask (Bm, Hm, Lp, Sp) when
    `has_mask`; with `spans` the rows' spans (2, Lp) int32 (starts, ends; the
    first `q_len` rows valid); with dropout the rows' keys (B, Hq, Lp)
    int32; outputs o (B, Hq, Lp, Evp) and lse (B, Hq, Lp) float32. Threads:
    `config.compute_wgs` compute warpgroups, then the memory one; each
    program loops over its share of the (batch, head, query block) tiles."""
    *ins, o_gmem, lse_gmem = refs
    named = attention_operands(ins, {"dropout_p": dropout_p, "spans": spans})
    mask_gmem, spans_gmem, keys_gmem = named.mask, named.spans, named.keys
    bq, bk, wgs, rows = config.block_q, config.block_kv, config.compute_wgs, config.block_rows
    batch, q_heads, lp, e = q_gmem.shape
    ev = v_gmem.shape[-1]
    q_blocks = lp // rows
    dtype = q_gmem.dtype
    transforms = tile_transforms(dtype)
    kv_blocks = cdiv(kv_len, bk)
    ragged = kv_len % bk != 0
    # A static pipeline shrinks to its length; every tile's must match the allocation.
    steps = min(config.max_concurrent_steps, kv_blocks)

    def step(first_row, kv_start, full, q_tiles, p_tiles, indices, k_smem, v_smem, *rest):
        mask_smem, carry = (rest[0], rest[1]) if has_mask else (None, rest[0])
        (j,) = indices
        if spans:  # the key block: the pipeline starts at the first one the rows reach
            j = j + kv_start
        wg = warpgroup(config.warp_specialized)
        acc, m, l, *ride = carry  # the rows' dropout keys (and spans) ride along unchanged
        row_keys = ride[:1] if keys_gmem is not None else ()

        def qk(s_acc):
            plgpu.wgmma(s_acc, q_tiles.at[wg], target.transposed(k_smem))
            return s_acc[...]

        s, _ = softcapped(pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32)), scale=scale,
                          softcap=softcap)
        if has_mask:  # this warpgroup's rows of the tile's mask block
            s = s + mask_smem.at[pl.ds(wg * bq, bq)][...].astype(jnp.float32) * LOG2E
        row_spans = None
        if spans:  # an element mask only on blocks across a span's edge
            row_spans = RowSpans(ride[-2], ride[-1], straddles(j * bk, j * bk + bk, full))
        s = visible(s, target, row0=first_row + wg * bq, col0=j * bk, kv_len=kv_len,
                    causal=causal, ragged=ragged, spans=row_spans)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_base = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
        alpha = jnp.exp2(m - m_base)
        p = jnp.exp2(s - jax.lax.broadcast_in_dim(m_base, s.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        if row_keys:  # l sums p as it is; v is weighted by the dropped p
            p = p * dropout_factors(row_keys[0], target, col0=j * bk, shape=p.shape,
                                    dropout_p=dropout_p)
        p_operand = target.operand(p, dtype, None if p_tiles is None else p_tiles.at[wg])

        def pv(o_acc):
            plgpu.wgmma(o_acc, p_operand, v_smem)
            return o_acc[...]

        acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
        acc = acc + pl.run_scoped(pv, plgpu.ACC((bq, ev), jnp.float32))
        return acc, m_new, l, *ride

    def compute(b, h, first_row, q_tiles, o_tiles, keys_tiles, spans_tiles, q_barriers,
                run_pipeline):
        """One compute warpgroup's tile: its Q rows (and dropout keys, spans)
        in, the loop, O and lse out."""
        wg = warpgroup(config.warp_specialized)
        wg_rows = pl.ds(first_row + wg * bq, bq)
        plgpu.copy_gmem_to_smem(q_gmem.at[b, h, wg_rows], q_tiles.at[wg], q_barriers.at[wg])
        if keys_gmem is not None:
            plgpu.copy_gmem_to_smem(keys_gmem.at[b, h, wg_rows], keys_tiles.at[wg],
                                    q_barriers.at[wgs + wg])
            plgpu.barrier_wait(q_barriers.at[wgs + wg])
        if spans:  # the rows' starts and ends, one (2, block_q) copy
            spans_barrier = q_barriers.at[(1 if keys_gmem is None else 2) * wgs + wg]
            plgpu.copy_gmem_to_smem(spans_gmem.at[:, wg_rows], spans_tiles.at[wg],
                                    spans_barrier)
            plgpu.barrier_wait(spans_barrier)
        plgpu.barrier_wait(q_barriers.at[wg])
        ride = () if keys_gmem is None else (target.load_rows(keys_tiles.at[wg]),)
        if spans:
            ride += (target.load_rows(spans_tiles.at[wg, 0]),
                     target.load_rows(spans_tiles.at[wg, 1]))
        acc, m, l, *_ = run_pipeline((target.tile(jnp.zeros((bq, ev), jnp.float32)),
                                      target.rows(jnp.full((bq,), -jnp.inf, jnp.float32)),
                                      target.rows(jnp.zeros((bq,), jnp.float32)), *ride))
        empty = l == 0.0  # no visible key: o = 0, lse = +inf
        safe_l = jnp.where(empty, 1.0, l)
        inv_l = jnp.where(empty, 0.0, 1.0 / safe_l)
        o_smem = o_tiles.at[wg]
        o_smem[...] = (acc * jax.lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(dtype)
        # lse straight from the registers: 256 bytes, not worth an SMEM tile
        lse_gmem.at[b, h, wg_rows][...] = jnp.where(empty, jnp.inf,
                                                    (m + jnp.log2(safe_l)) * (1.0 / LOG2E))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, h, wg_rows])
        plgpu.wait_smem_to_gmem(0)  # the Q/O tile is reused by the next tile

    def pipeline(b, h, qi, q_tiles, o_tiles, p_tiles, keys_tiles, spans_tiles, q_barriers):
        """The warp-specialized pipeline of tile (b, h, qi), and its GMEM refs."""
        first_row = qi * rows
        kv_start, full = 0, None
        if spans:  # the key blocks from the first row's start to the last valid row's end
            last_row = jnp.minimum(first_row + rows - 1, q_len - 1)
            kv_start, kv_steps, full = block_range(spans_gmem, first_row, last_row, bk)
        elif causal:  # key blocks past the tile's last query row are never loaded
            kv_steps = jnp.minimum(kv_blocks, (first_row + rows + bk - 1) // bk)
        else:
            kv_steps = kv_blocks
        block = (lambda j: j + kv_start) if spans else (lambda j: j)
        in_specs = [
            plgpu.BlockSpec(target.transposed_shape(bk, e),
                            (lambda j: (block(j), 0)) if target.hardware
                            else (lambda j: (0, block(j))),
                            transforms=transforms),
            plgpu.BlockSpec((bk, ev), lambda j: (block(j), 0), transforms=transforms),
        ]
        kv_head = h // group
        gmem = [k_gmem.at[b, kv_head], v_gmem.at[b, kv_head]]
        if has_mask:  # one (rows, block_kv) block per step for all warpgroups
            in_specs.append(plgpu.BlockSpec((rows, bk), lambda j: (qi, block(j)),
                                            transforms=tile_transforms(mask_gmem.dtype)))
            gmem.append(mask_view(mask_gmem, b, h))
        run = tile_pipeline(
            functools.partial(step, first_row, kv_start, full, q_tiles, p_tiles),
            warp_specialized=config.warp_specialized,
            grid=(kv_steps,),
            in_specs=in_specs,
            compute_wgs=wgs,
            max_concurrent_steps=steps,
            compute_context=functools.partial(compute, b, h, first_row, q_tiles, o_tiles,
                                              keys_tiles, spans_tiles, q_barriers),
        )
        return run, gmem

    def scoped(allocations, q_tiles, o_tiles, p_tiles, keys_tiles, spans_tiles, q_barriers):
        o_tiles = q_tiles if o_tiles is None else o_tiles  # Q's tile is free after the loop

        @plgpu.nd_loop((batch, q_heads, q_blocks), collective_axes=PROGRAMS_AXIS)
        def _(loop):
            b, h, qi = loop.index
            if causal:  # the longest tiles first: programs finish closer together
                qi = q_blocks - 1 - qi
            run, gmem = pipeline(b, h, qi, q_tiles, o_tiles, p_tiles, keys_tiles, spans_tiles,
                                 q_barriers)
            run(*gmem, allocations=allocations)

    zero = jnp.int32(0)
    example, example_gmem = pipeline(zero, zero, zero, None, None, None, None, None, None)
    pl.run_scoped(
        scoped,
        example.get_allocations(*example_gmem),
        plgpu.SMEM((wgs, bq, e), dtype, transforms=transforms),
        None if e == ev else plgpu.SMEM((wgs, bq, ev), dtype, transforms=transforms),
        None if target.hardware else plgpu.SMEM((wgs, bq, bk), dtype, transforms=transforms),
        None if keys_gmem is None else plgpu.SMEM((wgs, bq), jnp.int32),
        plgpu.SMEM((wgs, 2, bq), jnp.int32) if spans else None,
        # Q's copies, the dropout keys', the spans'
        plgpu.Barrier(num_barriers=(1 + int(keys_gmem is not None) + int(spans)) * wgs),
        collective_axes=WARPGROUP_AXIS if config.warp_specialized else (),
    )


def attention(q, k, v, *optional, scale: float, causal: bool, config: AttentionConfig,
              interpret, dropout_p: float = 0.0, spans: bool = False, softcap: float = 0.0,
              span_width: int = 0, window=None):
    """(o, lse) of softmax(scale * q kᵀ + mask) v, per kernels/attention_shapes.py:
    q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev) in float16 or
    bfloat16; `optional`: [mask (Bm, Hm, L, S)][, spans (L, 2) int32][,
    dropout keys (B, Hq, L)]; a softcap c > 0 caps the scores. o (B, Hq, L,
    Ev) in q's dtype, lse (B, Hq, L) float32."""
    launch = attention_launch.prologue(
        "attention", q, k, v, optional, scale=scale, causal=causal, dropout_p=dropout_p,
        config=config, interpret=interpret, row_tile=config.block_rows, key_tile=config.block_kv,
        spans=spans, softcap=softcap)
    # In the simulator Kᵀ tiles, read as stored (see attention_blocks).
    k = launch.k if launch.target.hardware else jnp.swapaxes(launch.k, 2, 3)
    dims, lp = launch.dims, launch.lp
    b, hq = dims.batch, dims.q_heads
    o, lse = plgpu.kernel(
        functools.partial(attention_kernel, **launch.static),
        out_type=(jax.ShapeDtypeStruct((b, hq, lp, launch.ev), q.dtype),
                  jax.ShapeDtypeStruct((b, hq, lp), jnp.float32)),
        **launch.kernel_options(b * hq * (lp // config.block_rows)),
    )(launch.q, k, launch.v, *launch.optional)
    return o[:, :, :dims.q_len, :dims.value_dim], lse[:, :, :dims.q_len]


def candidates(q_len: int, warp_specialized: bool = True) -> tuple[AttentionConfig, ...]:
    """Configurations in order of preference: two compute warpgroups (one
    for calls of at most 64 query rows, e.g. decoding, and without warp
    specialization), large key blocks, then deep pipelines; the last resorts
    without overlap."""
    if not warp_specialized:
        wgs = (1,)
    else:
        wgs = (1, 2) if q_len <= 64 else (2, 1)
    ordered = [AttentionConfig(64, bk, steps, n, warp_specialized) for n in wgs
               for bk in (128, 64) for steps in (4, 3, 2)]
    return tuple(ordered) + (AttentionConfig(64, 64, 1, 1, warp_specialized),)


def config_for(dtype, q_len: int, head_dim: int, value_dim: int, mask_dtype=None,
               warp_specialized: bool = True, dropout: bool = False,
               spans: bool = False) -> AttentionConfig:
    """The first candidate that fits a Hopper block's shared memory."""
    return attention_launch.first_fitting("attention", candidates(q_len, warp_specialized),
                                          dtype, head_dim, value_dim, mask_dtype, dropout, spans)


def select_config(backend: str, avals, params, device=None) -> AttentionConfig:
    """Per query length, head dims and mask dtype (the shared memory they
    need); warp-specialized on one program per SM of `device` on a GPU, one
    warpgroup on one program in the simulator (attention_launch.config_for_call).
    The avals: q, k, v, then the optional operands."""
    return attention_launch.config_for_call(backend, avals, params, device, optional_at=3,
                                            config_for=config_for,
                                            default=AttentionConfig.default)


def unsupported(backend: str, avals, params) -> str | None:
    return attention_launch.refusal("attention", avals)


KERNEL = KernelSpec(run=attention, default_config=AttentionConfig.default,
                    select_config=select_config, unsupported=unsupported)
