"""Attention forward on Hopper Tensor Cores (Mosaic GPU): FlashAttention's
online softmax, the contract of kernels/attention_shapes.py.

Algorithm (FlashAttention-2, Dao 2023, arXiv:2307.08691; the Hopper
pipeline after FlashAttention-3, Shah et al. 2024, arXiv:2407.08608):

- Parallel grid: one program (one warpgroup) per `block_q` query rows of
  each (batch, query head). Query head h reads key/value head h // G (GQA)
  by index; nothing is repeated in memory.
- The program's Q tile is copied GMEM -> SMEM once by TMA. Then
  `plgpu.emit_pipeline` streams (block_kv, E) K and (block_kv, Ev) V tiles
  (and the mask's (block_q, block_kv) tile, if any) GMEM -> SMEM by TMA,
  `max_concurrent_steps` copies in flight, while each step:
  S = Q Kᵀ by `wgmma` into a float32 accumulator; s = S * scale + mask, in
  base 2 (times log2 e, so that `exp2` serves); padded keys and keys after
  the query (causal) set to -inf; the running row maximum m and sum l
  (float32) rescale the output accumulator by exp2(m_old - m_new); P =
  exp2(s - m) in the input dtype goes to SMEM and `wgmma` adds P V.
- Causal: key blocks entirely above the diagonal are never loaded (the
  pipeline's length is this query block's last visible key block).
- Epilogue: o = acc / l (0 for a row with no visible key) and lse = m + log l
  (natural log; +inf for such a row) go SMEM -> GMEM by TMA.

Operands are staged as attention_blocks.py describes (Kᵀ read in place on
the hardware, transposed by XLA for the simulator) and zero-padded there to
whole blocks. float32 is refused (`unsupported`): wgmma reads it only as
TF32; the op then runs its Triton kernel.
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
    mask_view,
    pad_rows,
    padded_head_dim,
    tile_transforms,
    visible,
)
from torch_pallas.kernels.shapes import cdiv, round_up
from torch_pallas.kernels.spec import KernelSpec


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Knobs of `attention_kernel`: one warpgroup per `block_q` query rows."""

    block_q: int
    block_kv: int
    max_concurrent_steps: int  # K/V (and mask) tiles in flight

    @classmethod
    def default(cls, backend: str) -> "AttentionConfig":
        return cls(block_q=64, block_kv=128, max_concurrent_steps=2)

    def smem_bytes(self, dtype, head_dim: int, value_dim: int, mask_dtype=None) -> int:
        """Shared memory of the main loop (Q, P and the pipeline's tiles) or
        the epilogue (Q's scope ends before it), whichever is larger."""
        size = itemsize(dtype)
        e, ev = padded_head_dim(head_dim), padded_head_dim(value_dim)
        bq, bk = self.block_q, self.block_kv
        per_step = bk * (e + ev) * size
        if mask_dtype is not None:
            per_step += bq * bk * itemsize(mask_dtype)
        main = bq * e * size + bq * bk * size + self.max_concurrent_steps * per_step
        epilogue = bq * ev * size + bq * 4
        return max(main, epilogue)

    def check(self, dtype, head_dim: int, value_dim: int, mask_dtype=None) -> None:
        if self.block_q % 64 or self.block_kv % 64:
            raise ValueError(f"attention: {self} needs block_q and block_kv multiples of 64 "
                             "(wgmma rows, 128-byte swizzle of 16-bit tiles)")
        nbytes = self.smem_bytes(dtype, head_dim, value_dim, mask_dtype)
        if not fits_smem(nbytes):
            raise ValueError(f"attention: {self} needs {nbytes} bytes of shared memory for "
                             f"head dims {head_dim}/{value_dim}, more than a Hopper block has")


def attention_kernel(q_gmem, k_gmem, v_gmem, *refs, scale, causal, kv_len, group, has_mask,
                     target, config):
    """q_gmem (B, Hq, Lp, Ep); k_gmem (B, Hkv, Sp, Ep), or (B, Hkv, Ep, Sp)
    in the simulator; v_gmem (B, Hkv, Sp, Evp); mask (Bm, Hm, Lp, Sp) when
    `has_mask`; outputs o (B, Hq, Lp, Evp) and lse (B, Hq, Lp) float32."""
    mask_gmem, (o_gmem, lse_gmem) = (refs[0], refs[1:]) if has_mask else (None, refs)
    bq, bk = config.block_q, config.block_kv
    b, h, qi = jax.lax.axis_index("b"), jax.lax.axis_index("h"), jax.lax.axis_index("q")
    kv_head = h // group
    q0 = qi * bq
    e, ev = q_gmem.shape[-1], v_gmem.shape[-1]
    dtype = q_gmem.dtype
    transforms = tile_transforms(dtype)
    kv_blocks = cdiv(kv_len, bk)
    ragged = kv_len % bk != 0
    if causal:  # key blocks past this query block's last row are never visited
        kv_steps = jnp.minimum(kv_blocks, (q0 + bq + bk - 1) // bk)
    else:
        kv_steps = kv_blocks
    score_scale = scale * LOG2E

    def step(q_smem, p_smem, indices, k_smem, v_smem, *rest):
        mask_smem, carry = (rest[0], rest[1]) if has_mask else (None, rest[0])
        (j,) = indices
        acc, m, l = carry

        def qk(s_acc):
            plgpu.wgmma(s_acc, q_smem, target.transposed(k_smem))
            return s_acc[...]

        s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32)) * score_scale
        if has_mask:
            s = s + mask_smem[...].astype(jnp.float32) * LOG2E
        s = visible(s, target, row0=q0, col0=j * bk, kv_len=kv_len, causal=causal,
                    ragged=ragged)
        m_new = jnp.maximum(m, s.max(axis=1))
        m_base = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing visible yet
        alpha = jnp.exp2(m - m_base)
        p = jnp.exp2(s - jax.lax.broadcast_in_dim(m_base, s.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        p_smem[...] = p.astype(dtype)
        plgpu.commit_smem()  # P visible to wgmma

        def pv(o_acc):
            plgpu.wgmma(o_acc, p_smem, v_smem)
            return o_acc[...]

        acc = acc * jax.lax.broadcast_in_dim(alpha, acc.shape, [0])
        acc = acc + pl.run_scoped(pv, plgpu.ACC((bq, ev), jnp.float32))
        return acc, m_new, l

    k_shape = target.transposed_shape(bk, e)
    in_specs = [
        plgpu.BlockSpec(k_shape, (lambda j: (j, 0)) if target.hardware else (lambda j: (0, j)),
                        transforms=transforms),
        plgpu.BlockSpec((bk, ev), lambda j: (j, 0), transforms=transforms),
    ]
    kv_refs = [k_gmem.at[b, kv_head], v_gmem.at[b, kv_head]]
    if has_mask:
        in_specs.append(plgpu.BlockSpec((bq, bk), lambda j: (qi, j),
                                        transforms=tile_transforms(mask_gmem.dtype)))
        kv_refs.append(mask_view(mask_gmem, b, h))

    def main_loop(q_smem, p_smem, barrier):
        plgpu.copy_gmem_to_smem(q_gmem.at[b, h, pl.ds(q0, bq)], q_smem, barrier.at[0])
        plgpu.barrier_wait(barrier.at[0])
        init = (target.tile(jnp.zeros((bq, ev), jnp.float32)),
                target.rows(jnp.full((bq,), -jnp.inf, jnp.float32)),
                target.rows(jnp.zeros((bq,), jnp.float32)))
        return plgpu.emit_pipeline(
            functools.partial(step, q_smem, p_smem), grid=(kv_steps,), in_specs=in_specs,
            max_concurrent_steps=config.max_concurrent_steps, init_carry=init,
        )(*kv_refs)

    acc, m, l = pl.run_scoped(
        main_loop,
        plgpu.SMEM((bq, e), dtype, transforms=transforms),
        plgpu.SMEM((bq, bk), dtype, transforms=transforms),
        plgpu.Barrier(num_barriers=1),
    )

    def epilogue(o_smem, lse_smem):
        empty = l == 0.0  # no visible key: o = 0, lse = +inf
        safe_l = jnp.where(empty, 1.0, l)
        inv_l = jnp.where(empty, 0.0, 1.0 / safe_l)
        o_smem[...] = (acc * jax.lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(dtype)
        lse_smem[...] = jnp.where(empty, jnp.inf, (m + jnp.log2(safe_l)) * (1.0 / LOG2E))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, h, pl.ds(q0, bq)])
        plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[b, h, pl.ds(q0, bq)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(epilogue, plgpu.SMEM((bq, ev), dtype, transforms=transforms),
                  plgpu.SMEM((bq,), jnp.float32))


def attention(q, k, v, mask=None, *, scale: float, causal: bool, config: AttentionConfig,
              interpret):
    """(o, lse) of softmax(scale * q kᵀ + mask) v, per kernels/attention_shapes.py:
    q (B, Hq, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev) in float16 or
    bfloat16, mask (Bm, Hm, L, S) or None. o (B, Hq, L, Ev) in q's dtype, lse
    (B, Hq, L) float32."""
    dims = attention_dims(q.shape, k.shape, v.shape, None if mask is None else mask.shape)
    if jnp.dtype(q.dtype).name not in SUPPORTED_DTYPES or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention (mosaic_gpu): q, k, v are {q.dtype}, {k.dtype}, {v.dtype}; "
                         f"the kernel takes one of {SUPPORTED_DTYPES}")
    config.check(q.dtype, dims.head_dim, dims.value_dim, None if mask is None else mask.dtype)
    target = Target.of(interpret)
    bq, bk = config.block_q, config.block_kv
    lp, sp = round_up(dims.q_len, bq), round_up(dims.kv_len, bk)
    e, ev = padded_head_dim(dims.head_dim), padded_head_dim(dims.value_dim)
    q = pad_rows(q, lp, e)
    k = pad_rows(k, sp, e)
    v = pad_rows(v, sp, ev)
    if not target.hardware:
        k = jnp.swapaxes(k, 2, 3)  # Kᵀ tiles, read as stored (see attention_blocks)
    operands = [q, k, v]
    if mask is not None:
        operands.append(pad_rows(mask, lp, sp))
    b, hq = dims.batch, dims.q_heads
    o, lse = plgpu.kernel(
        functools.partial(
            attention_kernel, scale=float(scale), causal=bool(causal), kv_len=dims.kv_len,
            group=dims.group, has_mask=mask is not None, target=target, config=config,
        ),
        out_type=(jax.ShapeDtypeStruct((b, hq, lp, ev), q.dtype),
                  jax.ShapeDtypeStruct((b, hq, lp), jnp.float32)),
        grid=(lp // bq, hq, b),
        grid_names=("q", "h", "b"),
        interpret=interpret,
    )(*operands)
    return o[:, :, :dims.q_len, :dims.value_dim], lse[:, :, :dims.q_len]


# Preferred first: large key blocks, then deep pipelines (each must fit SMEM).
CANDIDATES = tuple(
    AttentionConfig(block_q=64, block_kv=bk, max_concurrent_steps=steps)
    for bk in (128, 64) for steps in (3, 2)
) + (AttentionConfig(block_q=64, block_kv=64, max_concurrent_steps=1),)


def config_for(dtype, head_dim: int, value_dim: int, mask_dtype=None) -> AttentionConfig:
    """The first candidate that fits a Hopper block's shared memory."""
    for config in CANDIDATES:
        if fits_smem(config.smem_bytes(dtype, head_dim, value_dim, mask_dtype)):
            return config
    raise ValueError(f"attention: no configuration fits head dims {head_dim}/{value_dim}")


def select_config(backend: str, avals, params, device=None) -> AttentionConfig:
    """Per head dims and mask dtype (the shared memory they need); the same
    on the hardware and in the simulator."""
    (_, dtype), (k_shape, _), (v_shape, _) = avals[:3]
    mask_dtype = avals[3][1] if len(avals) > 3 else None
    if dtype not in SUPPORTED_DTYPES:
        return AttentionConfig.default(backend)
    return config_for(dtype, k_shape[-1], v_shape[-1], mask_dtype)


def unsupported(backend: str, avals, params) -> str | None:
    dtype = avals[0][1]
    if dtype not in SUPPORTED_DTYPES:
        return (f"computes attention on the Tensor Cores in float16 or bfloat16 only; q is "
                f"{dtype} (wgmma would read float32 as TF32)")
    return None


KERNEL = KernelSpec(run=attention, default_config=AttentionConfig.default,
                    select_config=select_config, unsupported=unsupported)
