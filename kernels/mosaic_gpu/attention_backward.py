"""Attention backward on Hopper Tensor Cores (Mosaic GPU): FlashAttention-2's
two-kernel backward, the contract of kernels/attention_shapes.py.

Algorithm (FlashAttention-2, Dao 2023, arXiv:2307.08691, Algorithm 2; the
dq kernel apart, as FlashAttention-3, Shah et al. 2024, arXiv:2407.08608,
and JAX's Mosaic GPU attention split it to avoid atomics):

- delta = rowsum(dO * O) (float32) and lse in base 2 are prepared by XLA;
  they are (B, Hq, L) vectors, never an (L, S) tensor.
- dK, dV kernel: one program (one warpgroup) per `block_kv` keys of each
  (batch, key/value head). K and V tiles are copied to SMEM once; then
  `plgpu.emit_pipeline` streams, for each of the G query heads sharing
  this key/value head and each query block that can see these keys
  (causal: from the diagonal on), the Q and dO tiles and the lse, delta
  (and mask) blocks by TMA, while each step recomputes S = Q Kᵀ, P =
  exp2(s - lse), and with dP = dO Vᵀ, dS = P * (dP - delta), adds Pᵀ dO
  to dV and dSᵀ Q to dK in float32 `wgmma` accumulators that live across
  the whole loop (so the G heads' sum costs nothing).
- dQ kernel: one program per `block_q` query rows of each (batch, query
  head); Q, dO, lse, delta loaded once; K, V (and mask) tiles streamed over
  the visible key blocks (causal: up to the diagonal); dQ += dS K.
- dK and dQ are scaled once at the end; every product accumulates in
  float32, P and dS enter wgmma in the input dtype.

Staging (Kᵀ, Vᵀ read in place, Pᵀ and dSᵀ read from their SMEM tiles
transposed on the hardware; transposed by XLA or when stored in the
simulator) and padding as attention_blocks.py describes. float32 is refused
(`unsupported`), as for the forward.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels.attention_shapes import attention_dims
from torch_pallas.kernels.mosaic_gpu.attention_blocks import (
    LOG2E,
    SUPPORTED_DTYPES,
    Target,
    fits_smem,
    itemsize,
    pad_rows,
    padded_head_dim,
    tile_transforms,
    visible,
)
from torch_pallas.kernels.shapes import cdiv, round_up
from torch_pallas.kernels.spec import KernelSpec


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Knobs of both kernels: the dK/dV kernel owns `block_kv` keys and
    streams `block_q` query rows; the dQ kernel the other way round."""

    block_q: int
    block_kv: int
    max_concurrent_steps: int  # tiles in flight in either pipeline

    @classmethod
    def default(cls, backend: str) -> "BackwardConfig":
        return cls(block_q=64, block_kv=64, max_concurrent_steps=2)

    def smem_bytes(self, dtype, head_dim: int, value_dim: int, mask_dtype=None) -> dict:
        """Shared memory of each kernel's main loop and epilogue, the larger."""
        size = itemsize(dtype)
        e, ev = padded_head_dim(head_dim), padded_head_dim(value_dim)
        bq, bk, steps = self.block_q, self.block_kv, self.max_concurrent_steps
        mask = 0 if mask_dtype is None else bq * bk * itemsize(mask_dtype)
        scores = bq * bk * size  # one staged Pᵀ or dSᵀ tile
        dkv = bk * (e + ev) * size + 2 * scores + steps * (bq * (e + ev) * size + 2 * bq * 4 + mask)
        dkv = max(dkv, bk * (e + ev) * size)
        dq = bq * (e + ev) * size + 2 * bq * 4 + steps * (bk * (e + ev) * size + mask)
        dq = max(dq, bq * e * size)
        return {"dkv": dkv, "dq": dq}

    def check(self, dtype, head_dim: int, value_dim: int, mask_dtype=None) -> None:
        if self.block_q % 64 or self.block_kv % 64:
            raise ValueError(f"attention backward: {self} needs block_q and block_kv "
                             "multiples of 64 (wgmma rows, 128-byte swizzle of 16-bit tiles)")
        for kernel, nbytes in self.smem_bytes(dtype, head_dim, value_dim, mask_dtype).items():
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


def probabilities(s, mask_tile, lse2, target, *, score_scale, row0, col0, kv_len, causal,
                  ragged):
    """P = exp(s - lse), from the raw scores S = Q Kᵀ (lse2 in base 2)."""
    s = s * score_scale
    if mask_tile is not None:
        s = s + mask_tile.astype(jnp.float32) * LOG2E
    s = visible(s, target, row0=row0, col0=col0, kv_len=kv_len, causal=causal, ragged=ragged)
    return jnp.exp2(s - jax.lax.broadcast_in_dim(lse2, s.shape, [0]))


def dkv_kernel(q_gmem, k_gmem, v_gmem, do_gmem, lse_gmem, delta_gmem, *refs, scale, causal,
               kv_len, group, has_mask, target, config):
    """q_gmem (B, Hq, Lp, Ep), do_gmem (B, Hq, Lp, Evp); k_gmem (B, Hkv,
    Sp, Ep) and v_gmem (B, Hkv, Sp, Evp), or both transposed in the
    simulator; lse_gmem (base 2) and delta_gmem (B, Hq, Lp) float32; mask
    (Bm, Hm, Lp, Sp) when `has_mask`. Outputs dk (B, Hkv, Sp, Ep), dv (B,
    Hkv, Sp, Evp)."""
    mask_gmem, (dk_gmem, dv_gmem) = (refs[0], refs[1:]) if has_mask else (None, refs)
    bq, bk = config.block_q, config.block_kv
    b, kv_head, kj = (jax.lax.axis_index(n) for n in ("b", "h", "k"))
    k0 = kj * bk
    e, ev = q_gmem.shape[-1], do_gmem.shape[-1]
    dtype = q_gmem.dtype
    transforms = tile_transforms(dtype)
    q_blocks = q_gmem.shape[2] // bq
    first_q = k0 // bq if causal else 0  # query blocks before it see none of these keys
    per_head = jnp.maximum(q_blocks - first_q, 0) if causal else q_blocks
    ragged = kv_len % bk != 0

    def head_and_block(t):
        return kv_head * group + t // per_head, first_q + t % per_head

    def query_spec(cols):
        return plgpu.BlockSpec((None, bq, cols), lambda t: (*head_and_block(t), 0),
                               transforms=transforms)

    def row_spec():
        return plgpu.BlockSpec((None, bq), lambda t: head_and_block(t))

    in_specs = [query_spec(e), query_spec(ev), row_spec(), row_spec()]
    gmem = [q_gmem.at[b], do_gmem.at[b], lse_gmem.at[b], delta_gmem.at[b]]
    if has_mask:
        heads_vary = mask_gmem.shape[1] > 1

        def mask_index(t):
            h, i = head_and_block(t)
            return (h if heads_vary else 0, i, kj)

        in_specs.append(plgpu.BlockSpec((None, bq, bk), mask_index,
                                        transforms=tile_transforms(mask_gmem.dtype)))
        gmem.append(mask_gmem.at[b if mask_gmem.shape[0] > 1 else 0])

    def step(k_smem, v_smem, pt_smem, dst_smem, dk_acc, dv_acc, indices, q_smem, do_smem,
             lse_smem, delta_smem, *mask_smem):
        (t,) = indices
        _, i = head_and_block(t)
        s, dp = scores(q_smem, target.transposed(k_smem), do_smem, target.transposed(v_smem),
                       bq=bq, bk=bk)
        p = probabilities(s, mask_smem[0][...] if has_mask else None,
                          target.load_rows(lse_smem), target, score_scale=scale * LOG2E,
                          row0=i * bq, col0=k0, kv_len=kv_len, causal=causal, ragged=ragged)
        plgpu.wgmma(dv_acc, target.stage_transposed(p, pt_smem), do_smem)
        delta = target.load_rows(delta_smem)
        ds = p * (dp - jax.lax.broadcast_in_dim(delta, dp.shape, [0]))
        plgpu.wgmma(dk_acc, target.stage_transposed(ds, dst_smem), q_smem)
        plgpu.wgmma_wait(0)  # the pipeline reuses Q's and dO's slots next

    def main_loop(dk_acc, dv_acc):
        def with_kv(k_smem, v_smem, pt_smem, dst_smem, barrier):
            if target.hardware:
                k_src = k_gmem.at[b, kv_head, pl.ds(k0, bk)]
                v_src = v_gmem.at[b, kv_head, pl.ds(k0, bk)]
            else:
                k_src = k_gmem.at[b, kv_head, :, pl.ds(k0, bk)]
                v_src = v_gmem.at[b, kv_head, :, pl.ds(k0, bk)]
            plgpu.copy_gmem_to_smem(k_src, k_smem, barrier.at[0])
            plgpu.copy_gmem_to_smem(v_src, v_smem, barrier.at[1])
            plgpu.barrier_wait(barrier.at[0])
            plgpu.barrier_wait(barrier.at[1])
            plgpu.emit_pipeline(
                functools.partial(step, k_smem, v_smem, pt_smem, dst_smem, dk_acc, dv_acc),
                grid=(group * per_head,), in_specs=in_specs,
                max_concurrent_steps=config.max_concurrent_steps,
            )(*gmem)

        pl.run_scoped(
            with_kv,
            plgpu.SMEM(target.transposed_shape(bk, e), dtype, transforms=transforms),
            plgpu.SMEM(target.transposed_shape(bk, ev), dtype, transforms=transforms),
            plgpu.SMEM(target.transposed_shape(bq, bk), dtype, transforms=transforms),
            plgpu.SMEM(target.transposed_shape(bq, bk), dtype, transforms=transforms),
            plgpu.Barrier(num_barriers=2),
        )
        return dk_acc[...], dv_acc[...]

    dk, dv = pl.run_scoped(main_loop, plgpu.ACC((bk, e), jnp.float32),
                           plgpu.ACC((bk, ev), jnp.float32))

    def epilogue(dk_smem, dv_smem):
        dk_smem[...] = (dk * scale).astype(dtype)
        dv_smem[...] = dv.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dk_smem, dk_gmem.at[b, kv_head, pl.ds(k0, bk)])
        plgpu.copy_smem_to_gmem(dv_smem, dv_gmem.at[b, kv_head, pl.ds(k0, bk)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(epilogue, plgpu.SMEM((bk, e), dtype, transforms=transforms),
                  plgpu.SMEM((bk, ev), dtype, transforms=transforms))


def dq_kernel(q_gmem, k_gmem, v_gmem, do_gmem, lse_gmem, delta_gmem, *refs, scale, causal,
              kv_len, group, has_mask, target, config):
    """As dkv_kernel's operands, with K and V as they lie; in the simulator
    Kᵀ (B, Hkv, Ep, Sp) and Vᵀ (B, Hkv, Evp, Sp) follow delta_gmem. Output
    dq (B, Hq, Lp, Ep)."""
    if target.hardware:
        kt_gmem = vt_gmem = None
    else:
        kt_gmem, vt_gmem = refs[0], refs[1]
        refs = refs[2:]
    mask_gmem, (dq_gmem,) = (refs[0], refs[1:]) if has_mask else (None, refs)
    bq, bk = config.block_q, config.block_kv
    b, h, qi = (jax.lax.axis_index(n) for n in ("b", "h", "q"))
    kv_head = h // group
    q0 = qi * bq
    e, ev = q_gmem.shape[-1], do_gmem.shape[-1]
    dtype = q_gmem.dtype
    transforms = tile_transforms(dtype)
    kv_blocks = cdiv(kv_len, bk)
    ragged = kv_len % bk != 0
    kv_steps = jnp.minimum(kv_blocks, (q0 + bq + bk - 1) // bk) if causal else kv_blocks

    rows = lambda j: (j, 0)  # noqa: E731
    cols = lambda j: (0, j)  # noqa: E731
    if target.hardware:  # K and V once each, read both ways in place
        in_specs = [plgpu.BlockSpec((bk, e), rows, transforms=transforms),
                    plgpu.BlockSpec((bk, ev), rows, transforms=transforms)]
        gmem = [k_gmem.at[b, kv_head], v_gmem.at[b, kv_head]]
    else:  # K, and Kᵀ and Vᵀ as XLA transposed them
        in_specs = [plgpu.BlockSpec((bk, e), rows, transforms=transforms),
                    plgpu.BlockSpec((e, bk), cols, transforms=transforms),
                    plgpu.BlockSpec((ev, bk), cols, transforms=transforms)]
        gmem = [k_gmem.at[b, kv_head], kt_gmem.at[b, kv_head], vt_gmem.at[b, kv_head]]
    if has_mask:
        in_specs.append(plgpu.BlockSpec((bq, bk), lambda j: (qi, j),
                                        transforms=tile_transforms(mask_gmem.dtype)))
        bm, hm = mask_gmem.shape[:2]
        gmem.append(mask_gmem.at[b if bm > 1 else 0, h if hm > 1 else 0])

    def step(q_smem, do_smem, lse2, delta, ds_smem, dq_acc, indices, *tiles):
        (j,) = indices
        if target.hardware:
            k_smem, v_smem, *mask_smem = tiles
            kt, vt = target.transposed(k_smem), target.transposed(v_smem)
        else:
            k_smem, kt, vt, *mask_smem = tiles
        s, dp = scores(q_smem, kt, do_smem, vt, bq=bq, bk=bk)
        p = probabilities(s, mask_smem[0][...] if has_mask else None, lse2, target,
                          score_scale=scale * LOG2E, row0=q0, col0=j * bk, kv_len=kv_len,
                          causal=causal, ragged=ragged)
        ds = p * (dp - jax.lax.broadcast_in_dim(delta, dp.shape, [0]))
        plgpu.wgmma(dq_acc, target.operand(ds, dtype, ds_smem), k_smem)
        plgpu.wgmma_wait(0)  # the pipeline reuses K's slot next

    def main_loop(dq_acc):
        def with_q(q_smem, do_smem, lse_smem, delta_smem, ds_smem, barrier):
            rows_ = pl.ds(q0, bq)
            plgpu.copy_gmem_to_smem(q_gmem.at[b, h, rows_], q_smem, barrier.at[0])
            plgpu.copy_gmem_to_smem(do_gmem.at[b, h, rows_], do_smem, barrier.at[1])
            plgpu.copy_gmem_to_smem(lse_gmem.at[b, h, rows_], lse_smem, barrier.at[2])
            plgpu.copy_gmem_to_smem(delta_gmem.at[b, h, rows_], delta_smem, barrier.at[3])
            for i in range(4):
                plgpu.barrier_wait(barrier.at[i])
            lse2, delta = target.load_rows(lse_smem), target.load_rows(delta_smem)
            plgpu.emit_pipeline(
                functools.partial(step, q_smem, do_smem, lse2, delta, ds_smem, dq_acc),
                grid=(kv_steps,), in_specs=in_specs,
                max_concurrent_steps=config.max_concurrent_steps,
            )(*gmem)

        pl.run_scoped(
            with_q,
            plgpu.SMEM((bq, e), dtype, transforms=transforms),
            plgpu.SMEM((bq, ev), dtype, transforms=transforms),
            plgpu.SMEM((bq,), jnp.float32),
            plgpu.SMEM((bq,), jnp.float32),
            None if target.hardware else plgpu.SMEM((bq, bk), dtype, transforms=transforms),
            plgpu.Barrier(num_barriers=4),
        )
        return dq_acc[...]

    dq = pl.run_scoped(main_loop, plgpu.ACC((bq, e), jnp.float32))

    def epilogue(dq_smem):
        dq_smem[...] = (dq * scale).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dq_smem, dq_gmem.at[b, h, pl.ds(q0, bq)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(epilogue, plgpu.SMEM((bq, e), dtype, transforms=transforms))


def attention_backward(q, k, v, o, do, lse, mask=None, *, scale: float, causal: bool,
                       config: BackwardConfig, interpret):
    """(dq, dk, dv) of attention (kernels/attention_shapes.py): q (B, Hq, L,
    E), k (B, Hkv, S, E), v (B, Hkv, S, Ev), o and do (B, Hq, L, Ev), lse (B,
    Hq, L) float32 as the forward returned it, mask (Bm, Hm, L, S) or None.
    dk, dv are summed over the query heads sharing each key/value head."""
    dims = attention_dims(q.shape, k.shape, v.shape, None if mask is None else mask.shape)
    if jnp.dtype(q.dtype).name not in SUPPORTED_DTYPES or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention backward (mosaic_gpu): q, k, v are {q.dtype}, {k.dtype}, "
                         f"{v.dtype}; the kernel takes one of {SUPPORTED_DTYPES}")
    config.check(q.dtype, dims.head_dim, dims.value_dim, None if mask is None else mask.dtype)
    target = Target.of(interpret)
    bq, bk = config.block_q, config.block_kv
    lp, sp = round_up(dims.q_len, bq), round_up(dims.kv_len, bk)
    e, ev = padded_head_dim(dims.head_dim), padded_head_dim(dims.value_dim)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    lse2 = pad_rows(lse.astype(jnp.float32) * LOG2E, lp, value=jnp.inf)  # padded rows: P = 0
    delta = pad_rows(delta, lp)
    q, do = pad_rows(q, lp, e), pad_rows(do, lp, ev)
    k, v = pad_rows(k, sp, e), pad_rows(v, sp, ev)
    kt, vt = jnp.swapaxes(k, 2, 3), jnp.swapaxes(v, 2, 3)
    masks = [] if mask is None else [pad_rows(mask, lp, sp)]
    b, hq, hkv = dims.batch, dims.q_heads, dims.kv_heads
    static = dict(scale=float(scale), causal=bool(causal), kv_len=dims.kv_len, group=dims.group,
                  has_mask=mask is not None, target=target, config=config)

    dk, dv = plgpu.kernel(
        functools.partial(dkv_kernel, **static),
        out_type=(jax.ShapeDtypeStruct((b, hkv, sp, e), q.dtype),
                  jax.ShapeDtypeStruct((b, hkv, sp, ev), q.dtype)),
        grid=(sp // bk, hkv, b),
        grid_names=("k", "h", "b"),
        interpret=interpret,
    )(q, k if target.hardware else kt, v if target.hardware else vt, do, lse2, delta, *masks)

    transposed = [] if target.hardware else [kt, vt]
    dq = plgpu.kernel(
        functools.partial(dq_kernel, **static),
        out_type=jax.ShapeDtypeStruct((b, hq, lp, e), q.dtype),
        grid=(lp // bq, hq, b),
        grid_names=("q", "h", "b"),
        interpret=interpret,
    )(q, k, v, do, lse2, delta, *transposed, *masks)
    return (dq[:, :, :dims.q_len, :dims.head_dim], dk[:, :, :dims.kv_len, :dims.head_dim],
            dv[:, :, :dims.kv_len, :dims.value_dim])


# Preferred first: deep pipelines; 64 x 64 blocks keep dK and dV (or dQ) and
# four score tiles in one warpgroup's registers.
CANDIDATES = tuple(BackwardConfig(block_q=64, block_kv=64, max_concurrent_steps=steps)
                   for steps in (3, 2, 1))


def config_for(dtype, head_dim: int, value_dim: int, mask_dtype=None) -> BackwardConfig:
    for config in CANDIDATES:
        if all(fits_smem(n) for n in
               config.smem_bytes(dtype, head_dim, value_dim, mask_dtype).values()):
            return config
    raise ValueError(f"attention backward: no configuration fits head dims "
                     f"{head_dim}/{value_dim}")


def select_config(backend: str, avals, params, device=None) -> BackwardConfig:
    """Per head dims and mask dtype (the shared memory they need); the same
    on the hardware and in the simulator."""
    (_, dtype), (k_shape, _), (v_shape, _) = avals[:3]
    mask_dtype = avals[6][1] if len(avals) > 6 else None
    if dtype not in SUPPORTED_DTYPES:
        return BackwardConfig.default(backend)
    return config_for(dtype, k_shape[-1], v_shape[-1], mask_dtype)


def unsupported(backend: str, avals, params) -> str | None:
    dtype = avals[0][1]
    if dtype not in SUPPORTED_DTYPES:
        return (f"computes attention's gradients on the Tensor Cores in float16 or bfloat16 "
                f"only; q is {dtype} (wgmma would read float32 as TF32)")
    return None


KERNEL = KernelSpec(run=attention_backward, default_config=BackwardConfig.default,
                    select_config=select_config, unsupported=unsupported)
