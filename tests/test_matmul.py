"""pallas::matmul against a float64 reference on every CPU backend."""

from __future__ import annotations

import pytest
import torch

import torch_pallas
from torch_pallas import references
from helpers import FLOAT_DTYPES, assert_within, random_tensor

SHAPES = [  # (M, K, N): tiny, ragged everywhere, exact tiles, K not a tile multiple
    (1, 1, 1),
    (7, 5, 3),
    (128, 64, 128),
    (130, 70, 200),
    (33, 257, 65),
]


def check_matmul(a, b):
    out = torch.ops.pallas.matmul(a, b)
    ref = references.matmul(a, b)
    assert out.dtype == a.dtype and out.device == a.device
    assert_within(out, ref, references.matmul_error_bound(a, b, ref),
                  f"matmul {tuple(a.shape)}x{tuple(b.shape)} {a.dtype}")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_matmul_matches_float64(cpu_backend, m, k, n, dtype):
    check_matmul(random_tensor((m, k), dtype), random_tensor((k, n), dtype))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_large_ragged(cpu_backend, dtype):
    check_matmul(random_tensor((1000, 999), dtype), random_tensor((999, 1001), dtype))


def test_matmul_transposed_and_strided_operands():
    a = random_tensor((64, 40), torch.float32)
    b = random_tensor((70, 40), torch.float32)
    check_matmul(a, b.t())
    check_matmul(a[::2], b.t()[:, 1::3])


@pytest.mark.parametrize("m,k,n", [(0, 5, 3), (4, 0, 3), (4, 5, 0)])
def test_matmul_empty_dimensions(m, k, n):
    a, b = torch.randn(m, k), torch.randn(k, n)
    out = torch.ops.pallas.matmul(a, b)
    assert out.shape == (m, n)
    assert torch.equal(out, torch.zeros(m, n))  # K = 0: an empty sum


def test_matmul_gradients_match_torch():
    a = torch.randn(37, 19, dtype=torch.float32, requires_grad=True)
    b = torch.randn(19, 23, dtype=torch.float32, requires_grad=True)
    grad = torch.randn(37, 23)
    torch.ops.pallas.matmul(a, b).backward(grad)
    ga, gb = a.grad, b.grad
    a.grad = b.grad = None
    (a @ b).backward(grad)
    torch.testing.assert_close(ga, a.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb, b.grad, rtol=1e-5, atol=1e-5)


def test_matmul_gradient_only_where_needed():
    a = torch.randn(8, 5, requires_grad=True)
    b = torch.randn(5, 6)  # no grad: its gradient is never computed
    torch.ops.pallas.matmul(a, b).sum().backward()
    torch.testing.assert_close(a.grad, torch.ones(8, 6) @ b.t())
    assert b.grad is None


def test_matmul_wrapper_is_the_op():
    a, b = torch.randn(9, 4), torch.randn(4, 2)
    assert torch.equal(torch_pallas.matmul(a, b), torch.ops.pallas.matmul(a, b))
