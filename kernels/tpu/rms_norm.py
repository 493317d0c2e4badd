"""RMSNorm's forward on the TensorCores: each row of x (R, N) divided by its
root mean square, then multiplied by the weight (Zhang & Sennrich 2019, "Root
Mean Square Layer Normalization"), rounded as the casting mode says
(kernels/rms_norm_casting.py; formulas in kernels/rms_norm_math.py):

    rstd = 1 / sqrt(mean(x^2) + eps)      (float32, one per row, kept)
    out  = x * rstd * weight              (NONE: torch.nn.functional.rms_norm's
                                           float32, rounded once to x's dtype;
                                           LLAMA, GEMMA: the models' roundings)

`pltpu.emit_pipeline` walks blocks of whole rows, HBM -> VMEM, double
buffered; the row blocks are PARALLEL and split across the TensorCores.
Columns are zero-padded to whole lanes (zeros add nothing to the sum of
squares, whose mean divides by the true N), rows to whole blocks. On
`interpret` (JAX's generic interpreter, which copies whole buffers per grid
step) the whole array is one block.
"""

from __future__ import annotations

import dataclasses
import math
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels import rms_norm_math, shapes
from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.rms_norm_casting import Casting
from torch_pallas.kernels.shapes import round_up
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu import chip
from torch_pallas.kernels.tpu.cores import pipeline_core_split, tensorcore_mesh

LANES = 128


@dataclasses.dataclass(frozen=True)
class RowsConfig:
    """Blocks of whole rows; the row-wise ops' (rms_norm and its backward)
    one knob."""

    block_rows: int | None  # None: every row in one block

    @classmethod
    def default(cls, backend: str) -> "RowsConfig":
        if backend == "interpret":
            return cls(block_rows=None)
        return cls(block_rows=8)  # one (8, 128) VMEM tile row per block


# A chip's row block: about this many bytes of the input in one block
# (half as many rows for float32). 8-row blocks (one VMEM tile row) of
# 16384 x 8192 bfloat16 moved 248 GB/s on v5e, 32- and 128-row ones 324;
# 512 rows of 8192 columns overflowed Mosaic's 16 MiB of VMEM (the float32
# temporaries of a block).
CHIP_BLOCK_BYTES = 2**20


def chip_rows_config(avals, params=None, device=None) -> RowsConfig:
    """Rows per block on a chip for rows of avals[0]'s last dimension:
    CHIP_BLOCK_BYTES of them, 16 to 512 rows, in whole 16-row tiles, and
    no more than the rows there are."""
    shape, dtype = avals[0]
    cols = round_up(shape[-1] if shape else 1, LANES)
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    itemsize = 2 if dtype == "bfloat16" else 4  # float16 runs as float32 on a chip
    block = max(16, min(512, CHIP_BLOCK_BYTES // (cols * itemsize)) // 16 * 16)
    return RowsConfig(block_rows=min(block, round_up(rows, 16)))


def select_rows_config(backend: str, avals, params, device=None) -> RowsConfig:
    """The row-wise kernels' config: chip_rows_config on a chip."""
    if backend == "tpu":
        return chip_rows_config(avals, params, device)
    return RowsConfig.default(backend)


def rms_norm_kernel(*refs, n: int, eps: float, casting: Casting, has_weight: bool, on_cpu: bool,
                    block, num_cores):
    x_hbm, *w_hbm, o_hbm, rstd_hbm = refs

    def body(x_vmem, *rest):
        *w_vmem, o_vmem, rstd_vmem = rest
        x = x_vmem[...].astype(jnp.float32)
        rstd = rms_norm_math.inverse_rms(jnp.sum(x * x, axis=1, keepdims=True), n, eps,
                                         on_cpu=on_cpu)
        w = w_vmem[0][...].astype(jnp.float32) if has_weight else None
        y = rms_norm_math.output(x * rstd, w, casting, x_vmem.dtype)
        o_vmem[...] = y.astype(o_vmem.dtype)
        rstd_vmem[...] = rstd

    rows, cols = x_hbm.shape
    # A second grid axis of one step: the row blocks are the PARALLEL axis the
    # cores split, then one sequential (ARBITRARY) step each.
    row_block = pl.BlockSpec(block, lambda i, j: (i, 0))
    weight = pl.BlockSpec((1, cols), lambda i, j: (0, 0))
    stats = pl.BlockSpec((block[0], 1), lambda i, j: (i, 0))
    pltpu.emit_pipeline(
        body,
        grid=(rows // block[0], 1),
        in_specs=[row_block, *([weight] if has_weight else [])],
        out_specs=[row_block, stats],
        **pipeline_core_split(num_cores, parallel_dims=1),
    )(x_hbm, *w_hbm, o_hbm, rstd_hbm)


def row_blocks(rows: int, cols: int, config: RowsConfig) -> tuple[int, int, int]:
    """(padded rows, padded cols, rows per block) for an (rows, cols) input."""
    if config.block_rows is None:
        return rows, cols, rows
    return round_up(rows, config.block_rows), round_up(cols, LANES), config.block_rows


def rms_norm(x, weight=None, *, eps: float, casting: Casting = Casting.NONE, config: RowsConfig,
             num_cores: int, interpret):
    """(out, rstd) for x (..., N) and weight (N,) or None: out in x's shape
    and dtype (promote_types(x, weight) for a weighted LLAMA casting), rstd
    (...) float32."""
    x, lead = shapes.rows(x)
    rows, n = x.shape
    padded_rows, padded_cols, block_rows = row_blocks(rows, n, config)
    out_dtype = rms_norm_math.output_dtype(x, weight, casting)
    inputs = [pad_to(x, (padded_rows, padded_cols))]
    if weight is not None:
        inputs.append(pad_to(weight.reshape(1, n), (1, padded_cols)))
    out, rstd = pl.kernel(
        functools.partial(rms_norm_kernel, n=n, eps=eps, casting=casting,
                          has_weight=weight is not None, on_cpu=interpret is not None,
                          block=(block_rows, padded_cols), num_cores=num_cores),
        out_type=(jax.ShapeDtypeStruct((padded_rows, padded_cols), out_dtype),
                  jax.ShapeDtypeStruct((padded_rows, 1), jnp.float32)),
        mesh=tensorcore_mesh(num_cores),
        interpret=interpret,
    )(*inputs)
    return out[:rows, :n].reshape(*lead, n), rstd[:rows, 0].reshape(lead)


KERNEL = KernelSpec(run=chip.widening_float16(rms_norm), default_config=RowsConfig.default,
                    select_config=select_rows_config)
