"""The SwiGLU gate's backward on Hopper, fused: with s = sigmoid(gate),

    d_up   = dy * gate * s
    d_gate = dy * up * s * (1 + gate * (1 - s))

from one pass over dy, gate and up (s recomputed), in float32, staged as
the forward's (swiglu.py).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from torch_pallas.kernels.mosaic_gpu.swiglu import (
    ElementwiseConfig,
    elementwise_call,
    elementwise_pipeline,
    sigmoid,
)
from torch_pallas.kernels.spec import KernelSpec


def swiglu_backward_kernel(dy_gmem, gate_gmem, up_gmem, dgate_gmem, dup_gmem, *,
                           config: ElementwiseConfig):
    def body(rows, dy_smem, gate_smem, up_smem):
        dy = dy_smem[...].astype(jnp.float32)
        gate = gate_smem[...].astype(jnp.float32)
        s = sigmoid(gate)
        dup_gmem[rows, :] = (dy * gate * s).astype(dup_gmem.dtype)
        dgate_gmem[rows, :] = (dy * up_smem[...].astype(jnp.float32) * s
                               * (1.0 + gate * (1.0 - s))).astype(dgate_gmem.dtype)

    elementwise_pipeline(body, (dy_gmem, gate_gmem, up_gmem), config)


def swiglu_backward(grad_out, gate, up, *, config: ElementwiseConfig, interpret):
    """(d_gate, d_up), each of gate's shape and dtype."""
    return elementwise_call(functools.partial(swiglu_backward_kernel, config=config),
                            (grad_out, gate, up), 2, config, interpret)


KERNEL = KernelSpec(run=swiglu_backward, default_config=ElementwiseConfig.default)
