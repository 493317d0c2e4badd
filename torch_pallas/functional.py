"""Python wrappers of the ops, for `torch_pallas.matmul(a, b)` and friends.

Each forwards to its `torch.ops.pallas.*` op, so eager calls, autograd and
torch.compile behave the same whichever spelling a model uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def fill(size: int | Sequence[int], value, *, dtype=None, device=None) -> torch.Tensor:
    """A new tensor of shape `size` filled with `value`, like `torch.full`.

    The dtype defaults as torch.full's does: bool for a bool value, int64 for
    an int, the default float dtype for a float. Supported: float32,
    float16, bfloat16, int32, and int64/float64 for values exact in 32 bits.
    """
    if isinstance(size, int):
        size = (size,)
    return torch.ops.pallas.fill(size, value, dtype=dtype, device=_factory_device(device))


def iota(n: int, *, dtype=None, device=None) -> torch.Tensor:
    """[0, 1, ..., n-1], like `torch.arange(n)` (int64 unless `dtype` says)."""
    return torch.ops.pallas.iota(n, dtype=dtype, device=_factory_device(device))


def _factory_device(device):
    """`device`, or torch's default device as a factory function sees it
    here (`with torch.device(...)` included, which the op itself, called
    inside that mode, no longer sees). Dynamo cannot trace the lookup: a
    compiled call leaves it to the op."""
    if device is None and not torch.compiler.is_compiling():
        return torch.get_default_device()
    return device


def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y with broadcasting, like `torch.add` for tensors of one dtype
    (float32, float16, bfloat16 or int32)."""
    return torch.ops.pallas.add(x, y)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The matrix product with `torch.matmul`'s semantics (1-D operands,
    broadcast batch dimensions), accumulated in float32 and returned in the
    operands' dtype (float32, float16 or bfloat16). Differentiable; cast
    by torch.autocast like torch.matmul."""
    return torch.ops.pallas.matmul(a, b)


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`input @ weight.T + bias` with the Pallas matmul, like
    `torch.nn.functional.linear`. The weight's transpose is read in place and
    the batch dimensions of `input` fold into one product."""
    out = torch.ops.pallas.matmul(input, weight.t())
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
