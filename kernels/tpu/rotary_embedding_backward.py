"""Rotary embeddings' backward on the TensorCores: the transposed rotation
of the gradients of q_embed and k_embed,

    dx = (g1 * c1 + g2 * s2,  g2 * c2 - g1 * s1)

on the forward's blocks (rotary_embedding.py, `transpose=True`)."""

from __future__ import annotations

import functools

from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu import chip
from torch_pallas.kernels.tpu.rotary_embedding import RotaryConfig, rotary_embedding, select_config

rotary_embedding_backward = functools.partial(rotary_embedding, transpose=True)

KERNEL = KernelSpec(run=chip.widening_float16(rotary_embedding_backward),
                    default_config=RotaryConfig.default, select_config=select_config)
