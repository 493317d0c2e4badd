"""Row-wise softmax as a torch op from Pallas kernels: one `pl.pallas_call`
over blocks of rows, each row's max, exponentials and sum in float32, and a
backward kernel (dx = y * (g - sum(g * y))) that recomputes y from x.

    python examples/softmax.py      # checks against torch on CPU
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax.experimental import pallas as pl

import torch_pallas

BLOCK_ROWS = 8


def row_softmax(x):
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    return e / jnp.sum(e, axis=-1, keepdims=True)


def softmax_kernel(x_ref, o_ref):
    o_ref[...] = row_softmax(x_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


def softmax_backward_kernel(g_ref, x_ref, dx_ref):
    y = row_softmax(x_ref[...].astype(jnp.float32))
    g = g_ref[...].astype(jnp.float32)
    dx_ref[...] = (y * (g - jnp.sum(g * y, axis=-1, keepdims=True))).astype(dx_ref.dtype)


def rowwise(kernel, *arrays, interpret):
    """`kernel` over blocks of rows of same-shaped (..., D) arrays."""
    d = arrays[0].shape[-1]
    n = arrays[0].size // d
    padded = [jnp.pad(a.reshape(n, d), ((0, -n % BLOCK_ROWS), (0, 0))) for a in arrays]
    spec = pl.BlockSpec((BLOCK_ROWS, d), lambda i: (i, 0))
    out = pl.pallas_call(
        kernel,
        grid=(padded[0].shape[0] // BLOCK_ROWS,),
        in_specs=[spec] * len(arrays),
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(padded[-1].shape, arrays[-1].dtype),
        interpret=interpret,
    )(*padded)
    return out[:n].reshape(arrays[0].shape)


@torch_pallas.custom_op("examples::softmax_backward")
def softmax_backward(grad: torch.Tensor, x: torch.Tensor, interpret=None) -> torch.Tensor:
    return rowwise(softmax_backward_kernel, grad, x, interpret=interpret)


@torch_pallas.custom_op("examples::softmax", backward=torch.ops.examples.softmax_backward)
def softmax(x: torch.Tensor, interpret=None) -> torch.Tensor:
    return rowwise(softmax_kernel, x, interpret=interpret)


if __name__ == "__main__":
    x = (torch.randn(5, 33, 300) * 4).requires_grad_()
    grad = torch.randn(5, 33, 300)
    out = torch.ops.examples.softmax(x)
    (got,) = torch.autograd.grad(out, x, grad)
    ref = x.double().softmax(-1)
    (want,) = torch.autograd.grad(ref, x, grad.double())
    for name, a, b in [("forward", out, ref), ("grad x", got, want)]:
        err = (a.double() - b.double()).abs().max().item()
        print(f"softmax {name}: max |error| {err:.2e}")
        assert err < 1e-5
