"""The SwiGLU gate, silu(gate) * up (Shazeer 2020, "GLU Variants Improve
Transformer"), fused: one pass reading both halves and writing the product,
in float32, rounded once.

The operands (of one shape) are flattened and viewed as a (rows, cols)
matrix, zero-padded to whole blocks (silu(0) * 0 = 0: the padding computes
nothing that is kept); `pltpu.emit_pipeline` walks the blocks as add.py's
does, the first grid dimension PARALLEL and split across the TensorCores.
On `interpret` the whole array is one block.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels.padding import as_rows
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu import chip
from torch_pallas.kernels.tpu.add import AddConfig as ElementwiseConfig
from torch_pallas.kernels.tpu.cores import pipeline_core_split, tensorcore_mesh


def sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def swiglu_kernel(gate_hbm, up_hbm, o_hbm, *, block, num_cores):
    def body(gate_vmem, up_vmem, o_vmem):
        gate = gate_vmem[...].astype(jnp.float32)
        up = up_vmem[...].astype(jnp.float32)
        o_vmem[...] = (gate * sigmoid(gate) * up).astype(o_vmem.dtype)

    rows, cols = gate_hbm.shape
    spec = pl.BlockSpec(block, lambda i, j: (i, j))
    pltpu.emit_pipeline(
        body,
        grid=(rows // block[0], cols // block[1]),
        in_specs=[spec, spec],
        out_specs=spec,
        **pipeline_core_split(num_cores, parallel_dims=1),
    )(gate_hbm, up_hbm, o_hbm)


def elementwise_blocks(arrays, config: ElementwiseConfig):
    """(block, the arrays as (rows, cols) matrices of whole blocks)."""
    if config.block_cols is None:
        n = math.prod(arrays[0].shape)
        return (1, n), [a.reshape(1, n) for a in arrays]
    block = (config.block_rows, config.block_cols)
    return block, [as_rows(a, config.block_cols, config.block_rows) for a in arrays]


# A chip's elementwise block: about CHIP_BLOCK_BYTES per operand, of rows
# as long as the array's own when those are whole lanes (the (rows, cols)
# view is then the array itself; another width would make XLA lay every
# operand out anew in HBM: (512, 1024) blocks of 8192 x 8192 bfloat16 ran at
# 0.47x XLA's fused jnp on v5e), else of CHIP_BLOCK_COLS. (32, 128) blocks,
# the simulator's, move 8 KiB a step.
CHIP_BLOCK_COLS = 1024
CHIP_BLOCK_BYTES = 2**20


def select_config(backend: str, avals, params, device=None) -> ElementwiseConfig:
    """On a chip, blocks of CHIP_BLOCK_BYTES as above, in 16-row tiles and
    no more rows than the array has."""
    if backend != "tpu":
        return ElementwiseConfig.default(backend)
    shape, dtype = avals[0]
    itemsize = 2 if dtype == "bfloat16" else 4  # float16 runs as float32 on a chip
    last = shape[-1] if shape else 1
    cols = last if last % 128 == 0 and 128 <= last <= 16384 else CHIP_BLOCK_COLS
    rows = -(-math.prod(shape) // cols)
    most = max(16, CHIP_BLOCK_BYTES // (cols * itemsize) // 16 * 16)
    return ElementwiseConfig(block_rows=min(most, -(-rows // 16) * 16), block_cols=cols)


def swiglu(gate, up, *, config: ElementwiseConfig, num_cores: int, interpret):
    """silu(gate) * up, for gate and up of one shape and dtype."""
    block, (gm, um) = elementwise_blocks((gate, up), config)
    out = pl.kernel(
        functools.partial(swiglu_kernel, block=block, num_cores=num_cores),
        out_type=jax.ShapeDtypeStruct(gm.shape, gm.dtype),
        mesh=tensorcore_mesh(num_cores),
        interpret=interpret,
    )(gm, um)
    return out.reshape(-1)[:gate.size].reshape(gate.shape)


KERNEL = KernelSpec(run=chip.widening_float16(swiglu), default_config=ElementwiseConfig.default,
                    select_config=select_config)
