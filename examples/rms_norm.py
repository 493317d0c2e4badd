"""RMSNorm as a torch op from Pallas kernels: forward and backward, each a
`pl.pallas_call` over blocks of rows, registered with torch_pallas.custom_op.

    python examples/rms_norm.py      # checks against torch on CPU

y = x / sqrt(mean(x^2) + eps) * w over the last dimension, in float32
inside the kernels, in x's dtype outside.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import torch
from jax.experimental import pallas as pl

import torch_pallas

BLOCK_ROWS = 8


def as_row_blocks(x):
    """x (..., D) as (N, D) rows, zero-padded to whole blocks of rows."""
    rows = x.reshape(-1, x.shape[-1])
    padded = -(-rows.shape[0] // BLOCK_ROWS) * BLOCK_ROWS
    return jnp.pad(rows, ((0, padded - rows.shape[0]), (0, 0))), rows.shape[0]


def rms_norm_kernel(x_ref, w_ref, o_ref, *, eps):
    x = x_ref[...].astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    o_ref[...] = (x * rstd * w_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


def rms_norm_backward_kernel(g_ref, x_ref, w_ref, dx_ref, dw_ref, *, eps):
    x = x_ref[...].astype(jnp.float32)
    g = g_ref[...].astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    x_hat = x * rstd
    wg = w_ref[...].astype(jnp.float32) * g
    dx_ref[...] = (rstd * (wg - x_hat * jnp.mean(wg * x_hat, axis=-1, keepdims=True))).astype(dx_ref.dtype)
    dw_ref[...] = jnp.sum(g * x_hat, axis=0, keepdims=True)  # this block's share


def rows_spec(d):
    return pl.BlockSpec((BLOCK_ROWS, d), lambda i: (i, 0))


@torch_pallas.custom_op("examples::rms_norm_backward")
def rms_norm_backward(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, interpret=None
) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1]
    (g, n), (xr, _) = as_row_blocks(grad), as_row_blocks(x)
    blocks = g.shape[0] // BLOCK_ROWS
    dx, dw_blocks = pl.pallas_call(
        functools.partial(rms_norm_backward_kernel, eps=eps),
        grid=(blocks,),
        in_specs=[rows_spec(d), rows_spec(d), pl.BlockSpec((d,), lambda i: (0,))],
        out_specs=[rows_spec(d), pl.BlockSpec((1, d), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct(g.shape, x.dtype), jax.ShapeDtypeStruct((blocks, d), jnp.float32)],
        interpret=interpret,
    )(g, xr, weight)
    return dx[:n].reshape(x.shape), dw_blocks.sum(axis=0).astype(weight.dtype)


@torch_pallas.custom_op("examples::rms_norm", backward=torch.ops.examples.rms_norm_backward)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, interpret=None) -> torch.Tensor:
    d = x.shape[-1]
    xr, n = as_row_blocks(x)
    out = pl.pallas_call(
        functools.partial(rms_norm_kernel, eps=eps),
        grid=(xr.shape[0] // BLOCK_ROWS,),
        in_specs=[rows_spec(d), pl.BlockSpec((d,), lambda i: (0,))],
        out_specs=rows_spec(d),
        out_shape=jax.ShapeDtypeStruct(xr.shape, x.dtype),
        interpret=interpret,
    )(xr, weight)
    return out[:n].reshape(x.shape)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps) * weight.double()).to(x.dtype)


if __name__ == "__main__":
    x = torch.randn(3, 37, 256, requires_grad=True)
    w = torch.randn(256, requires_grad=True)
    out = torch.ops.examples.rms_norm(x, w, 1e-5)
    out.square().sum().backward()
    expected_x, expected_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    rms_norm_reference(expected_x, expected_w, 1e-5).square().sum().backward()
    for name, got, want in [("forward", out, rms_norm_reference(x, w, 1e-5)),
                            ("grad x", x.grad, expected_x.grad), ("grad w", w.grad, expected_w.grad)]:
        err = (got.double() - want.double()).abs().max().item()
        print(f"rms_norm {name}: max |error| {err:.2e}")
        assert err < 1e-3 * max(1.0, want.abs().max().item())
