"""torch.ops.pallas.matmul(a, b): the matrix product of 2-D a (M, K) and
b (K, N), accumulated in float32, in a's dtype."""

from __future__ import annotations

import torch

from torch_pallas.launch import launch
from torch_pallas.ops import checks

OP = "pallas::matmul"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def output_shape(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """(M, N), after checking everything a kernel relies on."""
    checks.tensor(OP, "a", a)
    checks.tensor(OP, "b", b)
    for name, t in (("a", a), ("b", b)):
        if t.dim() != 2:
            raise ValueError(
                f"{OP}: {name} must be 2-D, got {name}.shape={tuple(t.shape)}"
            )
    checks.same_dtype(OP, a, b, names=("a", "b"))
    checks.dtype_in(OP, "a", a.dtype, DTYPES)
    checks.same_device(OP, a, b, names=("a", "b"))
    torch._check(
        a.shape[1] == b.shape[0],
        lambda: f"{OP}: inner dimensions differ: a.shape={tuple(a.shape)}, "
        f"b.shape={tuple(b.shape)} (a.shape[1] must equal b.shape[0])",
    )
    return (a.shape[0], b.shape[1])


@torch.library.custom_op(OP, mutates_args=())
def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m, n = output_shape(a, b)
    if m == 0 or n == 0:
        return a.new_empty((m, n))
    if a.shape[1] == 0:
        return a.new_zeros((m, n))  # an empty sum
    return launch("matmul", a.device, (a, b))


@matmul.register_fake
def _(a, b):
    return a.new_empty(output_shape(a, b))


def _setup_context(ctx, inputs, output):
    a, b = inputs
    ctx.save_for_backward(
        a if ctx.needs_input_grad[1] else None, b if ctx.needs_input_grad[0] else None
    )


def _backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad_a = torch.ops.pallas.matmul(grad, b.mT) if ctx.needs_input_grad[0] else None
    grad_b = torch.ops.pallas.matmul(a.mT, grad) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


matmul.register_autograd(_backward, setup_context=_setup_context)
