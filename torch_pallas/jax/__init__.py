"""torch_pallas's ops for JAX users: functions of `jax.Array`s with the torch
ops' semantics, running the ops' Pallas TPU kernels (compiled by Mosaic on a
TPU, interpreted on the CPU), differentiable through the ops' own backward
kernels (`jax.custom_vjp`), inside or outside `jax.jit`, with no torch tensor
and no host round trip (`calls` finds and jits an op's kernel; `ops`,
`attention` and `linear_cross_entropy` hold the functions):

    import jax.numpy as jnp
    import torch_pallas.jax as tpj

    out = tpj.attention(q, k, v, is_causal=True)        # (B, H, L, D)
    loss = tpj.linear_cross_entropy(hidden, lm_head, labels)

They are the one JAX-side form of every op: each calls its kernels as the
torch op does (the same kernel, config and parameters: launch.shipped_entry),
and torchax's and torch_tpu's integrations call them. Importing this module
imports JAX.

Imports: `base`, `runtime` (the registry, backends and launch.shipped_entry),
the kernels' shared enums and the op files' pure-Python rules (attention's
span rule and kernel parameters, the loss's chunk size); never `nn`,
`distributed` or the model integrations.
"""

from torch_pallas.jax.attention import attention, varlen_attention
from torch_pallas.jax.calls import backend
from torch_pallas.jax.linear_cross_entropy import linear_cross_entropy
from torch_pallas.jax.token_log_probs import token_log_probs
from torch_pallas.jax.ops import (add, fill, grouped_mm, iota, layer_norm, matmul, rms_norm,
                                  rotary_embedding, swiglu)

__all__ = [
    "add",
    "attention",
    "backend",
    "fill",
    "grouped_mm",
    "iota",
    "layer_norm",
    "linear_cross_entropy",
    "matmul",
    "rms_norm",
    "rotary_embedding",
    "swiglu",
    "token_log_probs",
    "varlen_attention",
]
