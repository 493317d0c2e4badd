"""Normalization layers on the Pallas training kernels: drop-ins for
torch.nn's, the same parameters, state_dict and constructor, their forward
one fused op."""

from __future__ import annotations

import torch

from torch_pallas.ops.layer_norm import layer_norm
from torch_pallas.ops.rms_norm import rms_norm


class RMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` computed by `torch.ops.pallas.rms_norm` (one pass
    over the rows forward and one backward, float32 statistics)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return rms_norm(input, self.normalized_shape, self.weight, self.eps)


class LayerNorm(torch.nn.LayerNorm):
    """`torch.nn.LayerNorm` computed by `torch.ops.pallas.layer_norm` (one
    pass over the rows forward, one backward for all three gradients)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)
