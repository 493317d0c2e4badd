"""Rotary position embeddings (Su et al. 2021, "RoFormer") on Hopper, in the
rotate-half convention of transformers' `apply_rotary_pos_emb`: with
x = (x1, x2) the halves of a head's D features and (c1, c2), (s1, s2) the
halves of the token's cos and sin,

    out = (x1 * c1 - x2 * s1,  x2 * c2 + x1 * s2)

in float32, rounded once; with `transpose`, the backward's transposed
rotation dx = (g1 * c1 + g2 * s2,  g2 * c2 - g1 * s1).

The op hands q (N1, Hq, N2, D), k (N1, Hk, N2, D) and the angles cos, sin
(N1, N2, D), shared by a token's heads (N2 = 1 when the heads lie inside
the tokens in memory, as a transformers layer's `transpose(1, 2)` leaves
them). A program takes one block of `block_tokens` tokens: its four angle
tiles (the halves of cos and sin) are copied GMEM -> SMEM once, then
`plgpu.emit_pipeline` streams the block's heads, q's then k's, each head as
its two half tiles (TMA copies in flight while the previous head computes);
the results are stored from the registers to their GMEM tiles. Each half is
its own tile, so no register array is ever split or joined.

Halves are zero-padded to whole `half_multiple`s (rotating zeros gives
zeros) and tokens to whole blocks, outside the kernel: the simulator raises
on a block past an array's edge where TMA would zero-fill.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels.mosaic_gpu import compat
from torch_pallas.kernels.mosaic_gpu.fences import fenced
from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.shapes import round_up
from torch_pallas.kernels.spec import KernelSpec

TOKEN_AXIS, BATCH_AXIS = "tokens", "batch"


@dataclasses.dataclass(frozen=True)
class RotaryConfig:
    block_tokens: int = 64  # rows of a tile
    half_multiple: int = 16  # a tile's width: a half of D, padded to whole multiples
    max_concurrent_steps: int = 2

    @classmethod
    def default(cls, backend: str) -> "RotaryConfig":
        return cls()


def rotate(x1, x2, c1, c2, s1, s2, *, transpose: bool):
    """The rotation of the halves (x1, x2), or its transpose."""
    if transpose:
        return x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Where a program's tiles lie in the padded (N1, H, N2, 2 * half)
    arrays and (N1, N2, 2 * half) angles: `tokens` rows along N2 (batch
    `a`) when `along_n2`, else along N1."""

    tokens: int
    half: int
    along_n2: bool
    hardware: bool  # on a GPU: every tile loaded in one register layout

    def load(self, ref):
        """A tile in float32. On the hardware in one strided layout whatever
        its dtype (a bfloat16 tile and a float32 one would otherwise load in
        layouts of different vector widths, which cannot be multiplied);
        the simulator picks none."""
        if not self.hardware:
            return ref[...].astype(jnp.float32)
        vector = next(v for v in (4, 2, 1) if (self.tokens * self.half) % (128 * v) == 0)
        layout = plgpu.Layout.WG_STRIDED((self.tokens, self.half), vec_size=vector)
        return compat.load(ref, layout=layout).astype(jnp.float32)

    def head_tile(self, t, a, h, c):
        """Element indices of head h's half c of token block t."""
        rows, cols = pl.ds(t * self.tokens, self.tokens), pl.ds(c * self.half, self.half)
        return (a, h, rows, cols) if self.along_n2 else (rows, h, 0, cols)

    def head_spec(self, t, a, c):
        """A pipeline over heads: half c of each head of token block t."""
        if self.along_n2:
            return plgpu.BlockSpec((None, None, self.tokens, self.half),
                                   lambda h: (a, h, t, c))
        return plgpu.BlockSpec((self.tokens, None, None, self.half), lambda h: (t, h, 0, c))

    def angle_tile(self, t, a, c):
        rows, cols = pl.ds(t * self.tokens, self.tokens), pl.ds(c * self.half, self.half)
        return (a, rows, cols) if self.along_n2 else (rows, 0, cols)


def rotary_embedding_kernel(q_gmem, k_gmem, cos_gmem, sin_gmem, qo_gmem, ko_gmem, *,
                            tiles: Tiles, transpose: bool, config: RotaryConfig):
    t, a = jax.lax.axis_index(TOKEN_AXIS), jax.lax.axis_index(BATCH_AXIS)

    def scoped(angles_smem, barrier):
        # c1, c2, s1, s2: read once, used by every head of the block
        for i, (table, c) in enumerate(((cos_gmem, 0), (cos_gmem, 1), (sin_gmem, 0),
                                        (sin_gmem, 1))):
            plgpu.copy_gmem_to_smem(table.at[tiles.angle_tile(t, a, c)], angles_smem.at[i],
                                    barrier)
        plgpu.barrier_wait(barrier)

        for x_gmem, o_gmem in ((q_gmem, qo_gmem), (k_gmem, ko_gmem)):
            def body(indices, x1_smem, x2_smem, o_gmem=o_gmem):
                (h,) = indices
                angles = [tiles.load(angles_smem.at[i]) for i in range(4)]
                y1, y2 = rotate(tiles.load(x1_smem), tiles.load(x2_smem), *angles,
                                transpose=transpose)
                o_gmem.at[tiles.head_tile(t, a, h, 0)][...] = y1.astype(o_gmem.dtype)
                o_gmem.at[tiles.head_tile(t, a, h, 1)][...] = y2.astype(o_gmem.dtype)

            heads = x_gmem.shape[1]
            plgpu.emit_pipeline(
                fenced(body), grid=(heads,),
                in_specs=[tiles.head_spec(t, a, 0), tiles.head_spec(t, a, 1)],
                max_concurrent_steps=min(config.max_concurrent_steps, heads),
            )(x_gmem, x_gmem)

    pl.run_scoped(scoped, plgpu.SMEM((4, tiles.tokens, tiles.half), cos_gmem.dtype),
                  plgpu.Barrier(num_arrivals=4))


def padded_halves(x, half: int):
    """x (..., 2 * h) as (..., 2 * half): each half zero-padded to `half`."""
    h = x.shape[-1] // 2
    if h == half:
        return x
    pairs = pad_to(x.reshape(*x.shape[:-1], 2, h), (*x.shape[:-1], 2, half))
    return pairs.reshape(*x.shape[:-1], 2 * half)


def rotary_embedding(q, k, cos, sin, *, config: RotaryConfig, interpret, transpose: bool = False):
    """(q_embed, k_embed) for q (N1, Hq, N2, D), k (N1, Hk, N2, D) and the
    angles cos, sin (N1, N2, D), in the dtype q and cos promote to; with
    `transpose`, the backward's rotation of the gradients q and k."""
    n1, _, n2, d = q.shape
    half = round_up(d // 2, config.half_multiple)
    along_n2 = n2 > 1
    count = n2 if along_n2 else n1
    tokens = min(config.block_tokens, round_up(count, 8))
    padded = round_up(count, tokens)
    tiles = Tiles(tokens=tokens, half=half, along_n2=along_n2, hardware=interpret is None)

    def pad(x):
        axis = x.ndim - 2 if along_n2 else 0
        x = padded_halves(x, half)
        return pad_to(x, x.shape[:axis] + (padded,) + x.shape[axis + 1:])

    inputs = [pad(x) for x in (q, k, cos, sin)]
    dtype = jnp.promote_types(q.dtype, cos.dtype)
    qo, ko = plgpu.kernel(
        functools.partial(rotary_embedding_kernel, tiles=tiles, transpose=transpose,
                          config=config),
        out_type=tuple(jax.ShapeDtypeStruct(x.shape, dtype) for x in inputs[:2]),
        grid=(padded // tokens, n1 if along_n2 else 1),
        grid_names=(TOKEN_AXIS, BATCH_AXIS),
        interpret=interpret,
    )(*inputs)

    def cut(x):
        x = x[:, :, :n2] if along_n2 else x[:n1]
        if half == d // 2:
            return x
        return x.reshape(*x.shape[:-1], 2, half)[..., :d // 2].reshape(*x.shape[:-1], d)

    return cut(qo), cut(ko)


KERNEL = KernelSpec(run=rotary_embedding, default_config=RotaryConfig.default)
