"""The SwiGLU gate, silu(gate) * up (Shazeer 2020), fused on Hopper: one
pass reading both halves and writing the product, in float32, rounded once.

As add.py: the operands (of one shape) flattened into a (rows, cols)
matrix, zero-padded to whole blocks (silu(0) * 0 = 0); a parallel grid gives
each CUDA block `blocks_per_program` consecutive row blocks, staged GMEM ->
SMEM by `plgpu.emit_pipeline` (TMA copies in flight while the previous
pair computes), the product stored from the registers to its GMEM rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from torch_pallas.kernels.mosaic_gpu.add import AddConfig as ElementwiseConfig
from torch_pallas.kernels.mosaic_gpu.fences import fenced
from torch_pallas.kernels.padding import as_rows
from torch_pallas.kernels.spec import KernelSpec

LOG2E = 1.4426950408889634


def sigmoid(x):
    """1 / (1 + e^-x), on the fast base-2 exponential."""
    return 1.0 / (1.0 + jnp.exp2(-x * LOG2E))


def elementwise_pipeline(body, inputs, config: ElementwiseConfig):
    """Runs `body(rows, *smem_tiles)` over this program's row blocks of the
    `inputs` (GMEM refs of one shape), `rows` the block's GMEM rows."""
    first = jax.lax.axis_index("p") * config.blocks_per_program
    spec = plgpu.BlockSpec((config.block_rows, config.block_cols), lambda step: (first + step, 0))

    def step_body(indices, *tiles):
        (step,) = indices
        body(pl.ds((first + step) * config.block_rows, config.block_rows), *tiles)

    plgpu.emit_pipeline(fenced(step_body), grid=(config.blocks_per_program,), in_specs=[spec] * len(inputs),
                        max_concurrent_steps=config.max_concurrent_steps)(*inputs)


def elementwise_call(kernel, arrays, outputs: int, config: ElementwiseConfig, interpret):
    """`kernel(*input_refs, *output_refs)` over `arrays` (of one shape) as
    whole row blocks; the `outputs` results, each in the arrays' shape."""
    shape, size = arrays[0].shape, arrays[0].size
    rows_per_program = config.block_rows * config.blocks_per_program
    matrices = [as_rows(a, config.block_cols, rows_per_program) for a in arrays]
    out_type = jax.ShapeDtypeStruct(matrices[0].shape, matrices[0].dtype)
    outs = plgpu.kernel(
        kernel,
        out_type=(out_type,) * outputs,
        grid=(matrices[0].shape[0] // rows_per_program,),
        grid_names=("p",),
        interpret=interpret,
    )(*matrices)
    return tuple(o.reshape(-1)[:size].reshape(shape) for o in outs)


def swiglu_kernel(gate_gmem, up_gmem, o_gmem, *, config: ElementwiseConfig):
    def body(rows, gate_smem, up_smem):
        gate = gate_smem[...].astype(jnp.float32)
        o_gmem[rows, :] = (gate * sigmoid(gate) * up_smem[...].astype(jnp.float32)).astype(
            o_gmem.dtype)

    elementwise_pipeline(body, (gate_gmem, up_gmem), config)


def swiglu(gate, up, *, config: ElementwiseConfig, interpret):
    """silu(gate) * up, for gate and up of one shape and dtype."""
    (out,) = elementwise_call(functools.partial(swiglu_kernel, config=config), (gate, up), 1,
                              config, interpret)
    return out


KERNEL = KernelSpec(run=swiglu, default_config=ElementwiseConfig.default)
