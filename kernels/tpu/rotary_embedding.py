"""Rotary position embeddings (Su et al. 2021, "RoFormer"), in the
rotate-half convention of transformers' `apply_rotary_pos_emb`: with
x = (x1, x2) the two halves of a head's D features and cos = (c1, c2),
sin = (s1, s2) the token's angles,

    out = (x1 * c1 - x2 * s1,  x2 * c2 + x1 * s2)

in float32, rounded once. Its backward is the transposed rotation

    dx = (g1 * c1 + g2 * s2,  g2 * c2 - g1 * s1)

(the forward with -sin only where sin's two halves are equal, which nothing
here assumes), the same kernel with `transpose=True`.

The op hands q (N1, Hq, N2, D) and k (N1, Hk, N2, D), each token's angles
in cos and sin (N1, N2, D), shared by its heads: N1 batches of N2 tokens
when the heads lie outside the tokens in memory, N1 tokens (N2 = 1) when a
transformers layer's `view(B, S, H, D).transpose(1, 2)` keeps them inside.
`pltpu.emit_pipeline` walks blocks of tokens with all their heads, q's, k's
and the angles in one step (the angles read once for every head), the
token blocks PARALLEL and split across the TensorCores; tokens are
zero-padded to whole blocks. On `interpret` (JAX's generic interpreter,
which copies whole buffers per grid step) everything is one block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.shapes import round_up
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu import chip
from torch_pallas.kernels.tpu.cores import pipeline_core_split, tensorcore_mesh

SUBLANES = 8


@dataclasses.dataclass(frozen=True)
class RotaryConfig:
    """Tokens per block (each with all its heads of q and k)."""

    block_tokens: int | None  # None: every token in one block

    @classmethod
    def default(cls, backend: str) -> "RotaryConfig":
        if backend == "interpret":
            return cls(block_tokens=None)
        # 16 tokens x 32 heads x 128 float32 features: 256 KiB per q block
        return cls(block_tokens=16)


# A chip's block: about this many bytes of q per block; 16 tokens (the
# simulator's) move 256 KiB of float32 q a step at 32 heads of 128.
CHIP_BLOCK_BYTES = 2**20


def select_config(backend: str, avals, params, device=None) -> RotaryConfig:
    """On a chip, tokens per block for CHIP_BLOCK_BYTES of q (8 to 1024,
    whole sublanes)."""
    if backend != "tpu":
        return RotaryConfig.default(backend)
    (n1, heads, _, d), dtype = avals[0]
    itemsize = 2 if dtype == "bfloat16" else 4  # float16 runs as float32 on a chip
    tokens = CHIP_BLOCK_BYTES // max(heads * d * itemsize, 1)
    return RotaryConfig(block_tokens=max(SUBLANES, min(1024, tokens) // SUBLANES * SUBLANES))


def rotate(x1, x2, c1, c2, s1, s2, *, transpose: bool):
    """The rotation of the halves (x1, x2), or its transpose."""
    if transpose:
        return x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


def rotary_embedding_kernel(q_hbm, k_hbm, cos_hbm, sin_hbm, qo_hbm, ko_hbm, *, blocks,
                            transpose: bool, num_cores: int):
    half = q_hbm.shape[-1] // 2

    def body(q_vmem, k_vmem, cos_vmem, sin_vmem, qo_vmem, ko_vmem):
        # the token's angles broadcast along the heads (axis 1)
        c = cos_vmem[...].astype(jnp.float32)[:, None]
        s = sin_vmem[...].astype(jnp.float32)[:, None]
        c1, c2, s1, s2 = c[..., :half], c[..., half:], s[..., :half], s[..., half:]
        for x_vmem, o_vmem in ((q_vmem, qo_vmem), (k_vmem, ko_vmem)):
            x = x_vmem[...].astype(jnp.float32)
            x1, x2 = x[..., :half], x[..., half:]
            y = jnp.concatenate(rotate(x1, x2, c1, c2, s1, s2, transpose=transpose), axis=-1)
            o_vmem[...] = y.astype(o_vmem.dtype)

    q_spec, k_spec, table_spec = (pl.BlockSpec(shape, index) for shape, index in (
        (blocks.heads_block(q_hbm.shape[1]), blocks.heads_index),
        (blocks.heads_block(k_hbm.shape[1]), blocks.heads_index),
        (blocks.table_block, blocks.table_index)))
    pltpu.emit_pipeline(
        body,
        grid=blocks.grid,
        in_specs=[q_spec, k_spec, table_spec, table_spec],
        out_specs=[q_spec, k_spec],
        **pipeline_core_split(num_cores, parallel_dims=1),
    )(q_hbm, k_hbm, cos_hbm, sin_hbm, qo_hbm, ko_hbm)


@dataclasses.dataclass(frozen=True)
class TokenBlocks:
    """How the (N1, H, N2, D) arrays are cut: `tokens` per block along the
    token axis (N2 if N2 > 1, else N1), `padded` tokens in all; along N2, a
    block spans `batches` of N1 (all of them in one block, else one). The
    grid: (token blocks, N1 blocks)."""

    n1: int
    n2: int
    d: int
    tokens: int
    padded: int
    batches: int

    @classmethod
    def of(cls, n1: int, n2: int, d: int, block_tokens: int | None) -> "TokenBlocks":
        count = n2 if n2 > 1 else n1
        if block_tokens is None:
            return cls(n1, n2, d, count, count, n1)
        if count <= block_tokens:
            return cls(n1, n2, d, count, count, 1)
        # a block's second-minor dimension, when it cuts N2, in whole sublanes
        tokens = round_up(block_tokens, SUBLANES) if n2 > 1 else block_tokens
        return cls(n1, n2, d, tokens, round_up(count, tokens), 1)

    @property
    def along_n2(self) -> bool:
        return self.n2 > 1

    @property
    def grid(self) -> tuple[int, int]:
        return (self.padded // self.tokens, self.n1 // self.batches if self.along_n2 else 1)

    def heads_block(self, heads: int) -> tuple[int, ...]:
        if self.along_n2:
            return (self.batches, heads, self.tokens, self.d)
        return (self.tokens, heads, 1, self.d)

    def heads_index(self, t, a):
        return (a, 0, t, 0) if self.along_n2 else (t, 0, 0, 0)

    @property
    def table_block(self) -> tuple[int, ...]:
        return (self.batches, self.tokens, self.d) if self.along_n2 else (self.tokens, 1, self.d)

    def table_index(self, t, a):
        return (a, t, 0) if self.along_n2 else (t, 0, 0)

    def pad(self, x):
        """x (N1, ..., N2, D) zero-padded along the token axis."""
        axis = x.ndim - 2 if self.along_n2 else 0
        return pad_to(x, x.shape[:axis] + (self.padded,) + x.shape[axis + 1:])

    def cut(self, x):
        return x[:, :, :self.n2] if self.along_n2 else x[:self.n1]


def rotary_embedding(q, k, cos, sin, *, config: RotaryConfig, num_cores: int, interpret,
                     transpose: bool = False):
    """(q_embed, k_embed) for q (N1, Hq, N2, D), k (N1, Hk, N2, D) and the
    angles cos, sin (N1, N2, D), in the dtype q and cos promote to; with
    `transpose`, the backward's rotation of the gradients q and k."""
    n1, _, n2, d = q.shape
    blocks = TokenBlocks.of(n1, n2, d, config.block_tokens)
    dtype = jnp.promote_types(q.dtype, cos.dtype)
    inputs = [blocks.pad(a) for a in (q, k, cos, sin)]
    qo, ko = pl.kernel(
        functools.partial(rotary_embedding_kernel, blocks=blocks, transpose=transpose,
                          num_cores=num_cores),
        out_type=tuple(jax.ShapeDtypeStruct(x.shape, dtype) for x in inputs[:2]),
        mesh=tensorcore_mesh(num_cores),
        interpret=interpret,
    )(*inputs)
    return blocks.cut(qo), blocks.cut(ko)


KERNEL = KernelSpec(run=chip.widening_float16(rotary_embedding), default_config=RotaryConfig.default,
                    select_config=select_config)
