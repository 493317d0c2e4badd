"""Loss layers on the Pallas training kernels."""

from __future__ import annotations

import torch

from torch_pallas.ops.linear_cross_entropy import linear_cross_entropy


class LinearCrossEntropyLoss(torch.nn.Module):
    """A language model's head and its cross-entropy loss in one op,
    `torch.ops.pallas.linear_cross_entropy`, which never holds the
    (tokens x vocabulary) logits: the value of

        F.cross_entropy(F.linear(input, weight, bias).float(), target,
                        ignore_index=..., reduction=..., label_smoothing=...)

    (the logits softcapped first, `softcap * tanh(z / softcap)`, where
    `softcap` is set, as Gemma 2 does), float32, differentiable in input,
    weight and bias.

    `forward(input, weight, target, bias=None)`: input (..., H), weight
    (V, H) (the LM head's, which the module does not own), target (...)
    int64 classes or `ignore_index`. The arguments are checked when the op
    runs.
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, softcap: float | None = None) -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.softcap = softcap

    def forward(self, input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear_cross_entropy(input, weight, target, bias, ignore_index=self.ignore_index,
                                    reduction=self.reduction,
                                    label_smoothing=self.label_smoothing, softcap=self.softcap)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, softcap={self.softcap}")
