"""pallas::iota against torch.arange on every CPU backend."""

from __future__ import annotations

import pytest
import torch

import torch_pallas
from torch_pallas.ops import iota as iota_op

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 1000, 2049, 5000])
def test_iota_matches_torch_arange(cpu_backend, n, dtype):
    out = torch.ops.pallas.iota(n, dtype=dtype)
    assert out.dtype == dtype
    # Each integer rounded once to dtype. (torch.arange in bfloat16 rounds
    # some values past 4096 differently: 4113 -> 4096 where 4128 is nearest.)
    assert torch.equal(out, iota_op.reference(n, dtype))
    if dtype != torch.bfloat16:
        assert torch.equal(out, torch.arange(n, dtype=dtype))


def test_iota_defaults_to_int64_like_arange():
    out = torch_pallas.iota(10)
    assert out.dtype == torch.int64
    assert torch.equal(out, torch.arange(10))


def test_iota_float64_is_exact():
    n = 2**24 + 3  # past float32's exact integers: widened from int32, not float32
    out = torch.ops.pallas.iota(n, dtype=torch.float64)
    assert torch.equal(out[-4:], torch.arange(n - 4, n, dtype=torch.float64))


def test_iota_empty():
    assert torch.ops.pallas.iota(0).shape == (0,)
