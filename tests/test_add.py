"""pallas::add against a float64 (or exact integer) reference on every CPU
backend, broadcasting included."""

from __future__ import annotations

import pytest
import torch

import torch_pallas
from torch_pallas.base import dtypes
from torch_pallas.ops import add as add_op
from helpers import assert_within, random_tensor, FLOAT_DTYPES

DTYPES = (*FLOAT_DTYPES, torch.int32)
SHAPES = [  # (x shape, y shape)
    ((1,), (1,)),
    ((7,), (7,)),
    ((37, 300), (37, 300)),  # ragged: not a multiple of any block
    ((128, 128), (128, 128)),
    ((5, 1, 33), (4, 1)),  # broadcasting both ways
    ((3, 4, 5), ()),  # a 0-d operand
    ((2, 3, 1000), (3, 1)),
]


def rounding(dtype) -> float:
    return dtypes.ROUNDING.get(dtype, 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape,y_shape", SHAPES)
def test_add_matches_reference(cpu_backend, x_shape, y_shape, dtype):
    x, y = random_tensor(x_shape, dtype), random_tensor(y_shape, dtype)
    out = torch.ops.pallas.add(x, y)
    ref = add_op.reference(x, y)
    assert out.dtype == dtype
    # One rounding of the exact sum, as torch.add does.
    assert_within(out, ref, rounding(dtype) * ref.abs(), f"add {x_shape}+{y_shape} {dtype}")


@pytest.mark.slow
def test_add_large(cpu_backend):
    x, y = random_tensor((1000, 1001), torch.float32), random_tensor((1001,), torch.float32)
    ref = add_op.reference(x, y)
    assert_within(torch.ops.pallas.add(x, y), ref, rounding(torch.float32) * ref.abs())


def test_add_strided_expanded_and_grad_inputs():
    base = torch.randn(40, 60)
    x = base.t()[::2]  # transposed and strided
    y = torch.randn(30, 1).expand(30, 40)  # stride 0
    z = torch.randn(30, 40, requires_grad=True)
    torch.testing.assert_close(torch.ops.pallas.add(x, y), x + y)
    torch.testing.assert_close(torch.ops.pallas.add(z, x), (z + x).detach())


def test_add_gradients_reduce_broadcast_dimensions():
    x = torch.randn(4, 1, 6, requires_grad=True)
    y = torch.randn(5, 1, requires_grad=True)
    grad = torch.randn(4, 5, 6)
    torch.ops.pallas.add(x, y).backward(grad)
    gx, gy = x.grad, y.grad
    x.grad = y.grad = None
    (x + y).backward(grad)
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gy, y.grad)


def test_add_empty():
    out = torch.ops.pallas.add(torch.randn(0, 3), torch.randn(3))
    assert out.shape == (0, 3)


def test_add_wrapper_is_the_op():
    x, y = torch.randn(9), torch.randn(9)
    assert torch.equal(torch_pallas.add(x, y), torch.ops.pallas.add(x, y))
