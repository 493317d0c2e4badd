"""The SwiGLU gate's backward, fused: with s = sigmoid(gate),

    d_up   = dy * gate * s
    d_gate = dy * up * s * (1 + gate * (1 - s))

from one pass over dy, gate and up (s recomputed, nothing saved by the
forward), in float32, blocks as the forward's (swiglu.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu import chip
from torch_pallas.kernels.tpu.add import AddConfig as ElementwiseConfig
from torch_pallas.kernels.tpu.cores import pipeline_core_split, tensorcore_mesh
from torch_pallas.kernels.tpu.swiglu import elementwise_blocks, select_config, sigmoid


def swiglu_backward_kernel(dy_hbm, gate_hbm, up_hbm, dgate_hbm, dup_hbm, *, block, num_cores):
    def body(dy_vmem, gate_vmem, up_vmem, dgate_vmem, dup_vmem):
        dy = dy_vmem[...].astype(jnp.float32)
        gate = gate_vmem[...].astype(jnp.float32)
        up = up_vmem[...].astype(jnp.float32)
        s = sigmoid(gate)
        dup_vmem[...] = (dy * gate * s).astype(dup_vmem.dtype)
        dgate_vmem[...] = (dy * up * s * (1.0 + gate * (1.0 - s))).astype(dgate_vmem.dtype)

    rows, cols = gate_hbm.shape
    spec = pl.BlockSpec(block, lambda i, j: (i, j))
    pltpu.emit_pipeline(
        body,
        grid=(rows // block[0], cols // block[1]),
        in_specs=[spec, spec, spec],
        out_specs=[spec, spec],
        **pipeline_core_split(num_cores, parallel_dims=1),
    )(dy_hbm, gate_hbm, up_hbm, dgate_hbm, dup_hbm)


def swiglu_backward(grad_out, gate, up, *, config: ElementwiseConfig, num_cores: int, interpret):
    """(d_gate, d_up), each of gate's shape and dtype."""
    block, (dym, gm, um) = elementwise_blocks((grad_out, gate, up), config)
    shape = jax.ShapeDtypeStruct(gm.shape, gm.dtype)
    dgate, dup = pl.kernel(
        functools.partial(swiglu_backward_kernel, block=block, num_cores=num_cores),
        out_type=(shape, shape),
        mesh=tensorcore_mesh(num_cores),
        interpret=interpret,
    )(dym, gm, um)
    cut = lambda m: m.reshape(-1)[:gate.size].reshape(gate.shape)  # noqa: E731
    return cut(dgate), cut(dup)


KERNEL = KernelSpec(run=chip.widening_float16(swiglu_backward),
                    default_config=ElementwiseConfig.default, select_config=select_config)
