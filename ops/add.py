"""torch.ops.pallas.add(x, y): x + y with broadcasting, like torch.add for
tensors of one dtype."""

from __future__ import annotations

import math

import torch

from torch_pallas.base import dtypes
from torch_pallas.runtime import launch, registry
from torch_pallas.library import registration
from torch_pallas.ops import checks

OP = "pallas::add"
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32)


def broadcast_shape(x: torch.Tensor, y: torch.Tensor) -> torch.Size:
    """The output shape, after checking everything a kernel relies on."""
    checks.tensor(OP, "x", x)
    checks.tensor(OP, "y", y)
    checks.same_dtype(OP, x, y)
    checks.dtype_in(OP, "x", x.dtype, DTYPES)
    checks.same_device(OP, x, y)
    # Ranks first: comparing shapes of different ranks item by item would
    # guard a compiled graph on a symbolic size (s0 == 6) for nothing.
    if x.dim() == y.dim() and x.shape == y.shape:
        return x.shape
    try:
        return torch.broadcast_shapes(x.shape, y.shape)
    except RuntimeError:
        raise checks.RefusedLikeTorch(
            f"{OP}: shapes x {tuple(x.shape)} and y {tuple(y.shape)} do not broadcast"
        ) from None


def add_implementation(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    shape = broadcast_shape(x, y)
    if math.prod(shape) == 0:
        return x.new_empty(shape)
    return launch.run("add", x.device, (x, y), {"out_shape": tuple(shape)})


def add_fake(x, y):
    return x.new_empty(broadcast_shape(x, y))


def _setup_context(ctx, inputs, output):
    x, y = inputs
    ctx.shapes = (x.shape, y.shape)


def _backward(ctx, grad):
    # d(x + y) = grad for each operand, summed over the dimensions it was
    # broadcast along.
    x_shape, y_shape = ctx.shapes
    grad_x = grad.sum_to_size(x_shape) if ctx.needs_input_grad[0] else None
    grad_y = grad.sum_to_size(y_shape) if ctx.needs_input_grad[1] else None
    return grad_x, grad_y


def _jvp(inputs, tangents):
    # The tangent of x + y: tx + ty, each broadcast to the output's shape.
    tx, ty = tangents
    if tx is not None and ty is not None:
        return torch.ops.pallas.add(tx, ty)
    tangent = tx if tx is not None else ty
    return torch.broadcast_to(tangent, broadcast_shape(*inputs)).contiguous()


registration.define(
    OP, add_implementation, fake=add_fake, backward=_backward, setup_context=_setup_context,
    jvp=_jvp,
)


def _vmap(info, in_dims, x, y):
    """torch.vmap of add as one call: each vmapped dimension goes first,
    ahead of size-1 dimensions that line the operand's own dimensions up
    with the other's, so broadcasting works per example."""
    x_dim, y_dim = in_dims
    if x_dim is None and y_dim is None:
        return torch.ops.pallas.add(x, y), None
    rank = max(x.dim() - (x_dim is not None), y.dim() - (y_dim is not None))

    def leading(t, dim):
        if dim is None:
            return t
        t = t.movedim(dim, 0)
        return t.reshape(t.shape[0], *[1] * (rank - t.dim() + 1), *t.shape[1:])

    return torch.ops.pallas.add(leading(x, x_dim), leading(y, y_dim)), 0


torch.library.register_vmap(OP, _vmap)


# torch.ops.pallas.add, skipping the dispatcher on plain eager calls.
call = registration.direct_caller(torch.ops.pallas.add.default)


def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y with broadcasting, like `torch.add` for tensors of one dtype
    (float32, float16, bfloat16 or int32)."""
    return call(x, y)


def reference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y in float64 (exact integers for integer dtypes)."""
    if x.dtype.is_floating_point:
        return x.double() + y.double()
    return x.long() + y.long()


def examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """Broadcasts both ways, ragged sizes."""
    found = []
    for x_shape, y_shape in (((5, 1, 7), (3, 7)), ((33, 129), (129,))):
        x = torch.randn(x_shape, device=device, requires_grad=requires_grad)
        y = torch.randn(y_shape, device=device, requires_grad=requires_grad)
        ref = reference(x.detach().cpu(), y.detach().cpu())
        found.append(registry.Example((x, y), {}, ref, dtypes.ROUNDING[x.dtype] * ref.abs()))
    return found


registry.register(registry.OpInfo(
    name="add",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.add",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.add",
        "triton": "torch_pallas.kernels.triton.add",
    },
    function=add,
    torch_function=torch.add,
    examples=examples,
))
