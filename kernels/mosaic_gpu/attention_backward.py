"""Attention backward on Hopper Tensor Cores (Mosaic GPU): FlashAttention-2's
two-kernel backward, the contract of kernels/attention_shapes.py.

Algorithm (FlashAttention-2, Dao 2023, arXiv:2307.08691, Algorithm 2; the
dQ kernel apart, as FlashAttention-3, Shah et al. 2024, arXiv:2407.08608,
does it without atomics; the warp-specialized Hopper structure after both):

- delta = rowsum(dO * O) (float32) and lse in base 2 are prepared by XLA;
  they are (B, Hq, L) vectors, never an (L, S) tensor.
- dK, dV kernel: tiles of `compute_wgs * block_kv` keys of one (batch,
  key/value head); each compute warpgroup owns `block_kv` of them, its K
  and V tiles copied to SMEM once. A memory warpgroup
  (`plgpu.emit_pipeline_warp_specialized`) streams, for each of the G query
  heads sharing the key/value head and each query block that can see the
  tile's keys (causal: from the diagonal on), the Q and dO tiles and the
  lse, delta (and mask) blocks by TMA, shared by the compute warpgroups;
  each step recomputes S = Q Kᵀ and P = exp2(s - lse), with dP = dO Vᵀ
  and dS = P * (dP - delta) adds Pᵀ dO to dV and dSᵀ Q to dK in float32
  `wgmma` accumulators that live across the whole loop (so the G heads'
  sum costs nothing), and dK, dV leave through the K, V tiles by TMA.
- dQ kernel: tiles of `compute_wgs * block_q` query rows of one (batch,
  query head); each compute warpgroup loads its Q, dO, lse, delta once; K,
  V (and mask) tiles are streamed over the visible key blocks (causal: up
  to the diagonal); dQ += dS K, dS from the registers.
- Dropout: the rows' keys travel with lse and delta (streamed by the dK/dV
  kernel, loaded once per warpgroup by the dQ kernel), and each step
  recomputes the tile's mask Z from them (attention_blocks.dropout_factors):
  dV takes (P Z)ᵀ dO, and dS = P * (dP Z - delta).
- Spans: the dQ kernel visits the key blocks its rows' spans reach, as the
  forward does; the dK/dV kernel the query blocks from its first key's
  key_spans start to its last valid key's end (the (2, Sp) key spans in
  GMEM), streaming each block's rows' spans with lse and delta for the
  element mask of blocks across a span's edge.
- Softcap: P from the capped scores; dS times 1 - t², t = tanh(scale q.k /
  c) of the unmasked score (attention_blocks.softcapped).
- Both kernels run on persistent grids (`plgpu.nd_loop` over the tiles, one
  program per SM; causal tiles longest first). Without warp specialization
  (the form select_config gives the simulator) one warpgroup does both jobs
  (attention_blocks.tile_pipeline). dK and dQ are scaled once at
  the end; every product accumulates in float32, P and dS enter wgmma in
  the input dtype.

Staging (Kᵀ, Vᵀ read in place, Pᵀ and dSᵀ read from their SMEM tiles
transposed, dS from the registers on the hardware; transposed by XLA or
when stored, and through SMEM, in the simulator) and padding as
attention_blocks.py describes. float32 is refused (`unsupported`), as for
the forward.
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
    fits_smem,
    itemsize,
    mask_view,
    pad_rows,
    padded_head_dim,
    WARPGROUP_AXIS,
    dropout_factors,
    softcapped,
    straddles,
    tile_pipeline,
    tile_transforms,
    visible,
    warpgroup,
)
from torch_pallas.kernels.shapes import cdiv
from torch_pallas.kernels.spec import KernelSpec


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Knobs of both kernels. The dK/dV kernel's compute warpgroups own
    `block_kv` keys each and stream `block_q` query rows; the dQ kernel's
    own `block_q` query rows each and stream `block_kv` keys."""

    block_q: int
    block_kv: int
    max_concurrent_steps: int  # tiles in flight in either pipeline
    compute_wgs: int = 2
    # A memory warpgroup beside the compute ones (the hardware's choice), or
    # one warpgroup doing both (the simulator's: see attention_blocks.tile_pipeline).
    warp_specialized: bool = True
    # Programs of the persistent grids (one per SM of the GPU); None: one per tile.
    num_programs: int | None = None

    @classmethod
    def default(cls, backend: str) -> "BackwardConfig":
        return cls(block_q=64, block_kv=64, max_concurrent_steps=2)

    def smem_bytes(self, dtype, head_dim: int, value_dim: int, mask_dtype=None,
                   dropout: bool = False, spans: bool = False) -> dict:
        """Shared memory of each kernel on the hardware (the simulator also
        stages dS and the outputs apart)."""
        size = itemsize(dtype)
        e, ev = padded_head_dim(head_dim), padded_head_dim(value_dim)
        bq, bk, wgs = self.block_q, self.block_kv, self.compute_wgs
        steps = self.max_concurrent_steps
        mask = 0 if mask_dtype is None else wgs * bq * bk * itemsize(mask_dtype)
        # lse, delta (and the dropout keys, the spans' starts and ends)
        rows = (2 + int(dropout) + 2 * int(spans)) * bq * 4
        # K, V tiles (dK, dV leave through them), Pᵀ and dSᵀ tiles; Q, dO, rows, mask
        dkv = wgs * (bk * (e + ev) + 2 * bq * bk) * size + steps * (
            bq * (e + ev) * size + rows + mask)
        # Q, dO tiles (dQ leaves through Q's), rows; K, V, mask
        dq = wgs * (bq * (e + ev) * size + rows) + steps * (bk * (e + ev) * size + mask)
        return {"dkv": dkv, "dq": dq}

    def fits(self, dtype, head_dim: int, value_dim: int, mask_dtype=None,
             dropout: bool = False, spans: bool = False) -> bool:
        return all(fits_smem(n) for n in self.smem_bytes(dtype, head_dim, value_dim, mask_dtype,
                                                         dropout, spans).values())

    def check(self, dtype, head_dim: int, value_dim: int, mask_dtype=None,
              dropout: bool = False, spans: bool = False) -> None:
        attention_launch.check_tiles("attention backward", self)
        for kernel, nbytes in self.smem_bytes(dtype, head_dim, value_dim, mask_dtype,
                                              dropout, spans).items():
            if not fits_smem(nbytes):
                raise ValueError(f"attention backward: {self} needs {nbytes} bytes of shared "
                                 f"memory in its {kernel} kernel for head dims "
                                 f"{head_dim}/{value_dim}, more than a Hopper block has")


def scores(q_smem, k_operand, do_smem, v_operand, *, bq, bk):
    """(S, dP) = (Q Kᵀ, dO Vᵀ), both wgmmas in flight before either is read."""
    def products(s_acc, dp_acc):
        plgpu.wgmma(s_acc, q_smem, k_operand)
        plgpu.wgmma(dp_acc, do_smem, v_operand)
        return s_acc[...], dp_acc[...]

    return pl.run_scoped(products, plgpu.ACC((bq, bk), jnp.float32),
                         plgpu.ACC((bq, bk), jnp.float32))


def probabilities(s, mask_tile, lse2, target, *, scale, row0, col0, kv_len, causal, ragged,
                  softcap=0.0, spans=None):
    """P = exp(s - lse), from the raw scores S = Q Kᵀ (lse2 in base 2), and
    with a softcap the tanh t of the capped scores (else None)."""
    s, t = softcapped(s, scale=scale, softcap=softcap)
    if mask_tile is not None:
        s = s + mask_tile.astype(jnp.float32) * LOG2E
    s = visible(s, target, row0=row0, col0=col0, kv_len=kv_len, causal=causal, ragged=ragged,
                spans=spans)
    return jnp.exp2(s - jax.lax.broadcast_in_dim(lse2, s.shape, [0])), t


def score_gradient(p, dp, delta, t):
    """dS = P * (dP - delta), times softcap's 1 - t² (t from the unmasked
    scores: finite where the mask hides a score, whose P is 0)."""
    ds = p * (dp - jax.lax.broadcast_in_dim(delta, dp.shape, [0]))
    return ds if t is None else ds * (1.0 - t * t)


def dkv_kernel(q_gmem, k_gmem, v_gmem, do_gmem, lse_gmem, delta_gmem, *refs, scale, causal,
               kv_len, group, has_mask, target, config, dropout_p=0.0, softcap=0.0,
               spans=False, q_len=None):
    """q_gmem (B, Hq, Lp, Ep), do_gmem (B, Hq, Lp, Evp); k_gmem (B, Hkv,
    Sp, Ep) and v_gmem (B, Hkv, Sp, Evp), or both transposed in the
    simulator; lse_gmem (base 2) and delta_gmem (B, Hq, Lp) float32; mask
    (Bm, Hm, Lp, Sp) when `has_mask`; with `spans` the rows' spans (2, Lp)
    and the keys' (2, Sp) int32 (starts, ends); with dropout the rows' keys
    (B, Hq, Lp) int32. Outputs dk (B, Hkv, Sp, Ep), dv (B, Hkv, Sp, Evp).
    Each program loops over (batch, key/value head, key block) tiles; each
    compute warpgroup owns `block_kv` keys of one."""
    *ins, dk_gmem, dv_gmem = refs
    named = attention_operands(ins, {"dropout_p": dropout_p, "spans": spans}, backward=True)
    mask_gmem, spans_gmem, key_spans_gmem, keys_gmem = (named.mask, named.spans,
                                                        named.key_spans, named.keys)
    bq, bk, wgs = config.block_q, config.block_kv, config.compute_wgs
    tile_keys = wgs * bk
    batch, kv_heads = dk_gmem.shape[:2]
    e, ev = q_gmem.shape[-1], do_gmem.shape[-1]
    key_tiles = dk_gmem.shape[2] // tile_keys
    q_blocks = q_gmem.shape[2] // bq
    dtype = q_gmem.dtype
    transforms = tile_transforms(dtype)
    ragged = kv_len % bk != 0
    # The pipeline's slots: one allocation serves every tile's pipeline.
    steps = (config.max_concurrent_steps if causal or spans
             else min(config.max_concurrent_steps, group * q_blocks))

    def step(kj, full, k_tiles, v_tiles, pt_tiles, dst_tiles, head_and_block, indices, q_smem,
             do_smem, lse_smem, delta_smem, *rest):
        *tiles, carry = rest
        mask_smem = tiles.pop(0) if has_mask else None
        spans_smem = tiles.pop(0) if spans else None
        keys_smem = tiles.pop(0) if keys_gmem is not None else None
        dk_acc, dv_acc = carry
        (t,) = indices
        _, i = head_and_block(t)
        wg = warpgroup(config.warp_specialized)
        s, dp = scores(q_smem, target.transposed(k_tiles.at[wg]), do_smem,
                       target.transposed(v_tiles.at[wg]), bq=bq, bk=bk)
        mask_tile = mask_smem.at[:, pl.ds(wg * bk, bk)][...] if has_mask else None
        col0 = kj * tile_keys + wg * bk
        row_spans = None
        if spans:  # the step's rows' spans; the element mask where rows miss some keys
            row_spans = RowSpans(target.load_rows(spans_smem.at[0]),
                                 target.load_rows(spans_smem.at[1]),
                                 straddles(i * bq, i * bq + bq, full))
        p, tanh = probabilities(s, mask_tile, target.load_rows(lse_smem), target, scale=scale,
                                row0=i * bq, col0=col0, kv_len=kv_len, causal=causal,
                                ragged=ragged, softcap=softcap, spans=row_spans)
        pz = p
        if keys_smem is not None:  # dV takes the dropped P, dP the same mask
            z = dropout_factors(target.load_rows(keys_smem), target, col0=col0, shape=p.shape,
                                dropout_p=dropout_p)
            pz, dp = p * z, dp * z
        plgpu.wgmma(dv_acc, target.stage_transposed(pz, pt_tiles.at[wg]), do_smem)
        ds = score_gradient(p, dp, target.load_rows(delta_smem), tanh)
        plgpu.wgmma(dk_acc, target.stage_transposed(ds, dst_tiles.at[wg]), q_smem)
        plgpu.wgmma_wait(0)  # this step's tiles are released when it returns
        return carry

    def compute(b, kv_head, kj, k_tiles, v_tiles, out_tiles, barriers, run_pipeline):
        """One compute warpgroup's keys: K, V in, the loop, dK, dV out."""
        wg = warpgroup(config.warp_specialized)
        keys = pl.ds(kj * tile_keys + wg * bk, bk)
        if target.hardware:
            k_src, v_src = k_gmem.at[b, kv_head, keys], v_gmem.at[b, kv_head, keys]
        else:
            k_src, v_src = k_gmem.at[b, kv_head, :, keys], v_gmem.at[b, kv_head, :, keys]
        plgpu.copy_gmem_to_smem(k_src, k_tiles.at[wg], barriers.at[wg])
        plgpu.copy_gmem_to_smem(v_src, v_tiles.at[wg], barriers.at[wgs + wg])
        plgpu.barrier_wait(barriers.at[wg])
        plgpu.barrier_wait(barriers.at[wgs + wg])

        def accumulate(dk_acc, dv_acc):
            run_pipeline((dk_acc, dv_acc))
            return dk_acc[...], dv_acc[...]

        dk, dv = pl.run_scoped(accumulate, plgpu.ACC((bk, e), jnp.float32),
                               plgpu.ACC((bk, ev), jnp.float32))
        dk_tiles, dv_tiles = out_tiles
        dk_tiles.at[wg][...] = (dk * scale).astype(dtype)
        dv_tiles.at[wg][...] = dv.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dk_tiles.at[wg], dk_gmem.at[b, kv_head, keys])
        plgpu.copy_smem_to_gmem(dv_tiles.at[wg], dv_gmem.at[b, kv_head, keys])
        plgpu.wait_smem_to_gmem(0)  # the tiles are reused by the next tile

    def pipeline(b, kv_head, kj, scratch):
        k_tiles, v_tiles, pt_tiles, dst_tiles, out_tiles, barriers = scratch
        full = None
        if spans:  # the query blocks from the first key's first row to the last's last
            first_key = kj * tile_keys
            last_key = jnp.minimum(first_key + tile_keys - 1, kv_len - 1)
            first_q, per_head, full = block_range(key_spans_gmem, first_key, last_key, bq)
        elif causal:  # query blocks before the tile's first key see none of its keys
            first_q = kj * tile_keys // bq
            per_head = jnp.maximum(q_blocks - first_q, 0)
        else:
            first_q, per_head = 0, q_blocks

        def head_and_block(t):
            # lax's truncating div and rem (t and per_head are >= 0): jnp's
            # `%` guards a zero divisor with a constant that jax 0.11's
            # Mosaic GPU lowering cannot place when per_head is traced (spans)
            return kv_head * group + jax.lax.div(t, per_head), first_q + jax.lax.rem(t, per_head)

        def query_spec(cols):
            return plgpu.BlockSpec((None, bq, cols), lambda t: (*head_and_block(t), 0),
                                   transforms=transforms)

        row_spec = plgpu.BlockSpec((None, bq), head_and_block)
        in_specs = [query_spec(e), query_spec(ev), row_spec, row_spec]
        gmem = [q_gmem.at[b], do_gmem.at[b], lse_gmem.at[b], delta_gmem.at[b]]
        if has_mask:  # one (block_q, keys of the tile) block per step
            heads_vary = mask_gmem.shape[1] > 1

            def mask_index(t):
                h, i = head_and_block(t)
                return (h if heads_vary else 0, i, kj)

            in_specs.append(plgpu.BlockSpec((None, bq, tile_keys), mask_index,
                                            transforms=tile_transforms(mask_gmem.dtype)))
            gmem.append(mask_gmem.at[b if mask_gmem.shape[0] > 1 else 0])
        if spans:  # the rows' starts and ends, one (2, block_q) block per step
            in_specs.append(plgpu.BlockSpec((2, bq), lambda t: (0, head_and_block(t)[1])))
            gmem.append(spans_gmem)
        if keys_gmem is not None:  # the rows' keys, streamed like lse
            in_specs.append(row_spec)
            gmem.append(keys_gmem.at[b])
        run = tile_pipeline(
            functools.partial(step, kj, full, k_tiles, v_tiles, pt_tiles, dst_tiles,
                              head_and_block),
            warp_specialized=config.warp_specialized,
            grid=(group * per_head,),
            in_specs=in_specs,
            compute_wgs=wgs,
            max_concurrent_steps=steps,
            compute_context=functools.partial(compute, b, kv_head, kj, k_tiles, v_tiles,
                                              out_tiles, barriers),
        )
        return run, gmem

    def scoped(allocations, k_tiles, v_tiles, pt_tiles, dst_tiles, dk_tiles, dv_tiles,
               barriers):
        if target.hardware:  # dK and dV leave through the K and V tiles
            dk_tiles, dv_tiles = k_tiles, v_tiles
        scratch = (k_tiles, v_tiles, pt_tiles, dst_tiles, (dk_tiles, dv_tiles), barriers)

        @plgpu.nd_loop((batch, kv_heads, key_tiles), collective_axes=PROGRAMS_AXIS)
        def _(loop):
            b, kv_head, kj = loop.index  # causal: the first key tiles are the longest
            run, gmem = pipeline(b, kv_head, kj, scratch)
            run(*gmem, allocations=allocations)

    zero = jnp.int32(0)
    example, example_gmem = pipeline(zero, zero, zero, (None,) * 6)
    sim_only = (lambda *shape: None) if target.hardware else (
        lambda *shape: plgpu.SMEM((wgs, *shape), dtype, transforms=transforms))
    pl.run_scoped(
        scoped,
        example.get_allocations(*example_gmem),
        plgpu.SMEM((wgs, *target.transposed_shape(bk, e)), dtype, transforms=transforms),
        plgpu.SMEM((wgs, *target.transposed_shape(bk, ev)), dtype, transforms=transforms),
        plgpu.SMEM((wgs, *target.transposed_shape(bq, bk)), dtype, transforms=transforms),
        plgpu.SMEM((wgs, *target.transposed_shape(bq, bk)), dtype, transforms=transforms),
        sim_only(bk, e),
        sim_only(bk, ev),
        plgpu.Barrier(num_barriers=2 * wgs),
        collective_axes=WARPGROUP_AXIS if config.warp_specialized else (),
    )


def dq_kernel(q_gmem, k_gmem, v_gmem, do_gmem, lse_gmem, delta_gmem, *refs, scale, causal,
              kv_len, group, has_mask, target, config, dropout_p=0.0, softcap=0.0, spans=False,
              q_len=None):
    """As dkv_kernel's operands, with K and V as they lie; in the simulator
    Kᵀ (B, Hkv, Ep, Sp) and Vᵀ (B, Hkv, Evp, Sp) follow delta_gmem. Output
    dq (B, Hq, Lp, Ep). Each program loops over (batch, query head, query
    block) tiles; each compute warpgroup owns `block_q` rows of one."""
    if target.hardware:
        kt_gmem = vt_gmem = None
    else:
        kt_gmem, vt_gmem, *refs = refs
    *ins, dq_gmem = refs
    named = attention_operands(ins, {"dropout_p": dropout_p, "spans": spans}, backward=True)
    mask_gmem, spans_gmem, keys_gmem = named.mask, named.spans, named.keys
    bq, bk, wgs = config.block_q, config.block_kv, config.compute_wgs
    tile_rows = wgs * bq
    batch, q_heads, lp, e = q_gmem.shape
    ev = do_gmem.shape[-1]
    q_tiles_n = lp // tile_rows
    dtype = q_gmem.dtype
    transforms = tile_transforms(dtype)
    kv_blocks = cdiv(kv_len, bk)
    ragged = kv_len % bk != 0
    steps = min(config.max_concurrent_steps, kv_blocks)

    def step(first_row, kv_start, full, q_tiles, do_tiles, ds_tiles, indices, *tiles):
        *tiles, carry = tiles
        # the rows' dropout keys, with dropout, and their spans ride along
        dq_acc, lse2, delta, *ride = carry
        row_keys = ride[:1] if keys_gmem is not None else ()
        (j,) = indices
        if spans:  # the key block: the pipeline starts at the first one the rows reach
            j = j + kv_start
        wg = warpgroup(config.warp_specialized)
        if target.hardware:  # K and V once each, read both ways in place
            k_smem, v_smem, *mask_smem = tiles
            kt, vt = target.transposed(k_smem), target.transposed(v_smem)
        else:  # K, and Kᵀ and Vᵀ as XLA transposed them
            k_smem, kt, vt, *mask_smem = tiles
        s, dp = scores(q_tiles.at[wg], kt, do_tiles.at[wg], vt, bq=bq, bk=bk)
        mask_tile = mask_smem[0].at[pl.ds(wg * bq, bq)][...] if has_mask else None
        row_spans = None
        if spans:  # an element mask only on blocks across a span's edge
            row_spans = RowSpans(ride[-2], ride[-1], straddles(j * bk, j * bk + bk, full))
        p, tanh = probabilities(s, mask_tile, lse2, target, scale=scale,
                                row0=first_row + wg * bq, col0=j * bk, kv_len=kv_len,
                                causal=causal, ragged=ragged, softcap=softcap, spans=row_spans)
        if row_keys:
            dp = dp * dropout_factors(row_keys[0], target, col0=j * bk, shape=dp.shape,
                                      dropout_p=dropout_p)
        ds = score_gradient(p, dp, delta, tanh)
        ds_operand = target.operand(ds, dtype, None if ds_tiles is None else ds_tiles.at[wg])
        plgpu.wgmma(dq_acc, ds_operand, k_smem)
        plgpu.wgmma_wait(0)  # this step's tiles are released when it returns
        return carry

    def compute(b, h, first_row, q_tiles, do_tiles, lse_tiles, delta_tiles, keys_tiles,
                spans_tiles, barriers, run_pipeline):
        """One compute warpgroup's rows: Q, dO, lse, delta (and the dropout
        keys, the spans) in, the loop, dQ out."""
        wg = warpgroup(config.warp_specialized)
        rows = pl.ds(first_row + wg * bq, bq)
        sources = (q_gmem, do_gmem, lse_gmem, delta_gmem)
        tiles = (q_tiles, do_tiles, lse_tiles, delta_tiles)
        if keys_gmem is not None:
            sources, tiles = sources + (keys_gmem,), tiles + (keys_tiles,)
        for n, (src, tile) in enumerate(zip(sources, tiles)):
            plgpu.copy_gmem_to_smem(src.at[b, h, rows], tile.at[wg], barriers.at[n * wgs + wg])
        n_copies = len(tiles)
        if spans:  # the rows' starts and ends, one (2, block_q) copy
            plgpu.copy_gmem_to_smem(spans_gmem.at[:, rows], spans_tiles.at[wg],
                                    barriers.at[n_copies * wgs + wg])
            n_copies += 1
        for n in range(n_copies):
            plgpu.barrier_wait(barriers.at[n * wgs + wg])
        lse2 = target.load_rows(lse_tiles.at[wg])
        delta = target.load_rows(delta_tiles.at[wg])
        ride = () if keys_gmem is None else (target.load_rows(keys_tiles.at[wg]),)
        if spans:
            ride += (target.load_rows(spans_tiles.at[wg, 0]),
                     target.load_rows(spans_tiles.at[wg, 1]))

        def accumulate(dq_acc):
            run_pipeline((dq_acc, lse2, delta, *ride))
            return dq_acc[...]

        dq = pl.run_scoped(accumulate, plgpu.ACC((bq, e), jnp.float32))
        q_tiles.at[wg][...] = (dq * scale).astype(dtype)  # dQ leaves through Q's tile
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tiles.at[wg], dq_gmem.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)  # the tiles are reused by the next tile

    def pipeline(b, h, qi, scratch):
        (q_tiles, do_tiles, lse_tiles, delta_tiles, keys_tiles, spans_tiles, ds_tiles,
         barriers) = scratch
        first_row = qi * tile_rows
        kv_start, full = 0, None
        if spans:  # the key blocks from the first row's start to the last valid row's end
            last_row = jnp.minimum(first_row + tile_rows - 1, q_len - 1)
            kv_start, kv_steps, full = block_range(spans_gmem, first_row, last_row, bk)
        elif causal:  # key blocks past the tile's last row are never loaded
            kv_steps = jnp.minimum(kv_blocks, (first_row + tile_rows + bk - 1) // bk)
        else:
            kv_steps = kv_blocks
        kv_head = h // group
        if spans:
            rows = lambda j: (j + kv_start, 0)  # noqa: E731
            cols = lambda j: (0, j + kv_start)  # noqa: E731
        else:
            rows = lambda j: (j, 0)  # noqa: E731
            cols = lambda j: (0, j)  # noqa: E731
        if target.hardware:
            in_specs = [plgpu.BlockSpec((bk, e), rows, transforms=transforms),
                        plgpu.BlockSpec((bk, ev), rows, transforms=transforms)]
            gmem = [k_gmem.at[b, kv_head], v_gmem.at[b, kv_head]]
        else:
            in_specs = [plgpu.BlockSpec((bk, e), rows, transforms=transforms),
                        plgpu.BlockSpec((e, bk), cols, transforms=transforms),
                        plgpu.BlockSpec((ev, bk), cols, transforms=transforms)]
            gmem = [k_gmem.at[b, kv_head], kt_gmem.at[b, kv_head], vt_gmem.at[b, kv_head]]
        if has_mask:  # one (rows of the tile, block_kv) block per step
            in_specs.append(plgpu.BlockSpec((tile_rows, bk), lambda j: (qi, rows(j)[0]),
                                            transforms=tile_transforms(mask_gmem.dtype)))
            gmem.append(mask_view(mask_gmem, b, h))
        run = tile_pipeline(
            functools.partial(step, first_row, kv_start, full, q_tiles, do_tiles, ds_tiles),
            warp_specialized=config.warp_specialized,
            grid=(kv_steps,),
            in_specs=in_specs,
            compute_wgs=wgs,
            max_concurrent_steps=steps,
            compute_context=functools.partial(compute, b, h, first_row, q_tiles, do_tiles,
                                              lse_tiles, delta_tiles, keys_tiles, spans_tiles,
                                              barriers),
        )
        return run, gmem

    def scoped(allocations, *scratch):
        @plgpu.nd_loop((batch, q_heads, q_tiles_n), collective_axes=PROGRAMS_AXIS)
        def _(loop):
            b, h, qi = loop.index
            if causal:  # the longest tiles first
                qi = q_tiles_n - 1 - qi
            run, gmem = pipeline(b, h, qi, scratch)
            run(*gmem, allocations=allocations)

    zero = jnp.int32(0)
    example, example_gmem = pipeline(zero, zero, zero, (None,) * 8)
    pl.run_scoped(
        scoped,
        example.get_allocations(*example_gmem),
        plgpu.SMEM((wgs, bq, e), dtype, transforms=transforms),
        plgpu.SMEM((wgs, bq, ev), dtype, transforms=transforms),
        plgpu.SMEM((wgs, bq), jnp.float32),
        plgpu.SMEM((wgs, bq), jnp.float32),
        None if keys_gmem is None else plgpu.SMEM((wgs, bq), jnp.int32),
        plgpu.SMEM((wgs, 2, bq), jnp.int32) if spans else None,
        None if target.hardware else plgpu.SMEM((wgs, bq, bk), dtype, transforms=transforms),
        # Q's, dO's, lse's, delta's copies (the dropout keys', the spans')
        plgpu.Barrier(num_barriers=(4 + int(keys_gmem is not None) + int(spans)) * wgs),
        collective_axes=WARPGROUP_AXIS if config.warp_specialized else (),
    )


def attention_backward(q, k, v, o, do, lse, *optional, scale: float, causal: bool,
                       config: BackwardConfig, interpret, dropout_p: float = 0.0,
                       spans: bool = False, softcap: float = 0.0, span_width: int = 0,
                       window=None):
    """(dq, dk, dv) of attention (kernels/attention_shapes.py): q (B, Hq, L,
    E), k (B, Hkv, S, E), v (B, Hkv, S, Ev), o and do (B, Hq, L, Ev), lse (B,
    Hq, L) float32 as the forward returned it; `optional`: [mask (Bm, Hm, L,
    S)][, spans (L, 2), key spans (S, 2) int32][, dropout keys (B, Hq, L)];
    a softcap c > 0 as the forward's. dk, dv are summed over the query heads
    sharing each key/value head."""
    wgs = config.compute_wgs
    # Whole tiles of both kernels: dQ's query rows, dK/dV's keys.
    launch = attention_launch.prologue(
        "attention backward", q, k, v, optional, scale=scale, causal=causal,
        dropout_p=dropout_p, config=config, interpret=interpret,
        row_tile=wgs * config.block_q, key_tile=wgs * config.block_kv, spans=spans,
        softcap=softcap, backward=True)
    dims, lp, sp, e, ev = launch.dims, launch.lp, launch.sp, launch.e, launch.ev
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    lse2 = pad_rows(lse.astype(jnp.float32) * LOG2E, lp, value=jnp.inf)  # padded rows: P = 0
    delta = pad_rows(delta, lp)
    q, k, v, do = launch.q, launch.k, launch.v, pad_rows(do, lp, ev)
    kt, vt = jnp.swapaxes(k, 2, 3), jnp.swapaxes(v, 2, 3)
    hardware = launch.target.hardware
    b, hq, hkv = dims.batch, dims.q_heads, dims.kv_heads

    dk, dv = plgpu.kernel(
        functools.partial(dkv_kernel, **launch.static),
        out_type=(jax.ShapeDtypeStruct((b, hkv, sp, e), q.dtype),
                  jax.ShapeDtypeStruct((b, hkv, sp, ev), q.dtype)),
        **launch.kernel_options(b * hkv * (sp // (wgs * config.block_kv))),
    )(q, k if hardware else kt, v if hardware else vt, do, lse2, delta, *launch.optional)

    transposed = [] if hardware else [kt, vt]
    dq = plgpu.kernel(
        functools.partial(dq_kernel, **launch.static),
        out_type=jax.ShapeDtypeStruct((b, hq, lp, e), q.dtype),
        **launch.kernel_options(b * hq * (lp // (wgs * config.block_q))),
    )(q, k, v, do, lse2, delta, *transposed, *launch.optional)
    return (dq[:, :, :dims.q_len, :dims.head_dim], dk[:, :, :dims.kv_len, :dims.head_dim],
            dv[:, :, :dims.kv_len, :dims.value_dim])


def candidates(q_len: int, warp_specialized: bool = True) -> tuple[BackwardConfig, ...]:
    """Configurations in order of preference: two compute warpgroups (one
    for calls of at most 64 query rows, and without warp specialization),
    deep pipelines; 64 x 64 blocks keep dK and dV (or dQ) and the score
    tiles in one warpgroup's registers."""
    if not warp_specialized:
        wgs = (1,)
    else:
        wgs = (1, 2) if q_len <= 64 else (2, 1)
    return tuple(BackwardConfig(64, 64, steps, n, warp_specialized) for n in wgs
                 for steps in (3, 2)) + (BackwardConfig(64, 64, 1, 1, warp_specialized),)


def config_for(dtype, q_len: int, head_dim: int, value_dim: int, mask_dtype=None,
               warp_specialized: bool = True, dropout: bool = False,
               spans: bool = False) -> BackwardConfig:
    """The first candidate whose kernels both fit a Hopper block's shared memory."""
    return attention_launch.first_fitting("attention backward",
                                          candidates(q_len, warp_specialized), dtype, head_dim,
                                          value_dim, mask_dtype, dropout, spans)


def select_config(backend: str, avals, params, device=None) -> BackwardConfig:
    """Per query length, head dims and mask dtype (the shared memory they
    need), as the forward's (attention_launch.config_for_call). The avals:
    q, k, v, o, do, lse, then the optional operands."""
    return attention_launch.config_for_call(backend, avals, params, device, optional_at=6,
                                            config_for=config_for,
                                            default=BackwardConfig.default)


def unsupported(backend: str, avals, params) -> str | None:
    return attention_launch.refusal("attention's gradients", avals)


KERNEL = KernelSpec(run=attention_backward, default_config=BackwardConfig.default,
                    select_config=select_config, unsupported=unsupported)
