"""linear_cross_entropy's loss on the TensorCores: for one chunk of rows of
logits z (R, V) (the op computes them, chunk by chunk, with the matmul
kernels) and their targets, each row's loss and log-sum-exp, in float32,
without materialising anything of the chunk's size:

    lse = m + log(sum_j exp(z_j - m))            (online over column blocks)
    loss = lse - (1 - e) * z_t - e * mean_j(z_j)  (kernels/cross_entropy.py)

`pltpu.emit_pipeline` walks the grid (row blocks, column blocks); the
column blocks are the ARBITRARY axis along which the running maximum m, the
rescaled sum of exponentials, the target's logit and (with label smoothing)
the sum of logits accumulate in VMEM scratch (FlashAttention's online
softmax, Milakov & Gimelshein 2018); the row blocks are PARALLEL and split
across the TensorCores. A target of -1 marks an ignored row (loss 0).
Columns past the vocabulary (the padding to a lane multiple, or the stale
end of a partial last block) are masked out. On `interpret` (JAX's generic interpreter, which copies whole buffers
per grid step) the whole chunk is one block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels.cross_entropy import capped, row_loss
from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.shapes import cdiv, round_up
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu import chip
from torch_pallas.kernels.tpu.cores import pipeline_core_split, tensorcore_mesh

LANES = 128
SUBLANES = 8


@dataclasses.dataclass(frozen=True)
class LogitBlocksConfig:
    """Blocks of a chunk of logits (the loss kernel and its backward)."""

    block_rows: int | None  # None: the whole chunk in one block
    block_cols: int | None

    @classmethod
    def default(cls, backend: str) -> "LogitBlocksConfig":
        if backend == "interpret":
            return cls(None, None)
        if backend == "tpu_interpret":
            return cls(SUBLANES, 2 * LANES)  # small: ragged vocabularies span several blocks
        # 128 x 2048: 0.5 MiB of bf16 logits a step (8-row blocks took 4032
        # steps for a 512 x 128256 chunk, their overhead beyond its copy)
        return cls(16 * SUBLANES, 16 * LANES)

    def padded(self, rows: int, cols: int) -> tuple[int, int, tuple[int, int]]:
        """(padded rows, padded cols, block) for a (rows, cols) chunk: the
        rows padded to whole blocks, the columns only to a multiple of 128.
        The last column block may then be partial: `emit_pipeline` copies
        its lane-aligned part and the kernels mask the columns past the
        vocabulary, so a vocabulary of whole lanes (32000, 128256) is never
        copied into a padded chunk."""
        if self.block_rows is None:
            return rows, cols, (rows, cols)
        block_rows = min(self.block_rows, round_up(rows, 2 * SUBLANES))
        block_cols = min(self.block_cols, round_up(cols, LANES))
        return round_up(rows, block_rows), round_up(cols, LANES), (block_rows, block_cols)


def column_index(shape, j: int, block_cols: int):
    """Each element's column in the whole chunk, for block column j."""
    return jax.lax.broadcasted_iota(jnp.int32, shape, 1) + j * block_cols


def loss_kernel(z_hbm, t_hbm, loss_hbm, lse_hbm, *, m_vmem, s_vmem, zt_vmem, zsum_vmem,
                vocab: int, smoothing: float, softcap: float, block, num_cores: int):
    """z_hbm (Rp, Cp), t_hbm (Rp, 1) int32; outputs loss and lse (Rp, 1)
    float32; scratch (block rows, LANES) float32 each."""
    rows, cols = z_hbm.shape
    grid = (rows // block[0], cdiv(cols, block[1]))
    ragged = vocab % block[1] != 0  # padding, or the stale end of a partial block

    def body(z_ref, t_ref, loss_ref, lse_ref):
        j = pl.program_id(1)

        @pl.when(j == 0)
        def _():
            m_vmem[...] = jnp.full_like(m_vmem, -jnp.inf)
            for ref in (s_vmem, zt_vmem, zsum_vmem):
                ref[...] = jnp.zeros_like(ref)

        z = capped(z_ref[...].astype(jnp.float32), softcap)
        col = column_index(z.shape, j, block[1])
        zt_vmem[...] += jnp.sum(jnp.where(col == t_ref[...], z, 0.0), axis=1, keepdims=True)
        if ragged:
            z = jnp.where(col < vocab, z, -jnp.inf)
        if smoothing:
            zsum_vmem[...] += jnp.sum(jnp.where(z == -jnp.inf, 0.0, z), axis=1, keepdims=True)
        m_old = m_vmem[...]
        m_new = jnp.maximum(m_old, z.max(axis=1, keepdims=True))  # column 0 is in block 0
        s_vmem[...] = (s_vmem[...] * jnp.exp(m_old - m_new)
                       + jnp.sum(jnp.exp(z - m_new[:, :1]), axis=1, keepdims=True))
        m_vmem[...] = m_new

        @pl.when(j == grid[1] - 1)
        def _():
            lse = m_vmem[...][:, :1] + chip.log(s_vmem[...][:, :1])
            loss = row_loss(lse, zt_vmem[...][:, :1], zsum_vmem[...][:, :1], vocab=vocab,
                            smoothing=smoothing)
            loss_ref[...] = jnp.where(t_ref[...] >= 0, loss, 0.0)
            lse_ref[...] = lse

    logits = pl.BlockSpec(block, lambda i, j: (i, j))
    per_row = pl.BlockSpec((block[0], 1), lambda i, j: (i, 0))
    pltpu.emit_pipeline(
        body, grid=grid, in_specs=[logits, per_row], out_specs=[per_row, per_row],
        **pipeline_core_split(num_cores, parallel_dims=1),
    )(z_hbm, t_hbm, loss_hbm, lse_hbm)


def linear_cross_entropy(logits, target, *, smoothing: float, softcap: float,
                         config: LogitBlocksConfig, num_cores: int, interpret):
    """(loss, lse), each (R,) float32, for logits (R, V) and target (R,)
    int32 (-1: ignored)."""
    rows, vocab = logits.shape
    padded_rows, padded_cols, block = config.padded(rows, vocab)
    scratch = pltpu.VMEM((block[0], LANES), jnp.float32)
    loss, lse = pl.kernel(
        functools.partial(loss_kernel, vocab=vocab, smoothing=smoothing, softcap=softcap,
                          block=block, num_cores=num_cores),
        out_type=(jax.ShapeDtypeStruct((padded_rows, 1), jnp.float32),) * 2,
        mesh=tensorcore_mesh(num_cores),
        scratch_types=dict(m_vmem=scratch, s_vmem=scratch, zt_vmem=scratch, zsum_vmem=scratch),
        interpret=interpret,
    )(pad_to(logits, (padded_rows, padded_cols)), pad_to(target.reshape(rows, 1),
                                                         (padded_rows, 1)))
    return loss[:rows, 0], lse[:rows, 0]


KERNEL = KernelSpec(run=chip.widening_float16(linear_cross_entropy), default_config=LogitBlocksConfig.default)
