"""The ops as Python functions: `torch_pallas.matmul(a, b)` and friends,
each the public function of its op file (ops/<op>.py), forwarding to its
`torch.ops.pallas.*` op, so eager calls, autograd and torch.compile behave
the same whichever spelling a model uses; and `linear`, built on matmul.
"""

from __future__ import annotations

import torch

from torch_pallas import ops, registry  # noqa: F401  (ops registers the ops)

globals().update({info.name: info.function for info in registry.ops()})
_linear_product = ops.matmul.linear_product  # input @ weight.T, in one step on no-grad CPU calls


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`input @ weight.T + bias` with the Pallas matmul, like
    `torch.nn.functional.linear`. The weight's transpose is read in place and
    the batch dimensions of `input` fold into one product."""
    out = _linear_product(input, weight)
    if bias is None:
        return out
    if torch.is_autocast_enabled(out.device.type):  # cast with the operands, as F.linear's is
        bias = bias.to(out.dtype)
    elif bias.dtype != out.dtype:
        raise TypeError(
            f"torch_pallas.linear: bias has dtype {bias.dtype}, input and weight "
            f"{out.dtype}; they must be the same (convert one explicitly)"
        )
    return out + bias


__all__ = ["linear", *(info.name for info in registry.ops())]
