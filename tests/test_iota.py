"""pallas::iota against torch.arange on every CPU backend."""

from __future__ import annotations

import pytest
import torch

import torch_pallas
from torch_pallas.base import dtypes
from torch_pallas.ops import iota as iota_op

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 1000, 2049, 5000])
def test_iota_matches_torch_arange(cpu_backend, n, dtype):
    out = torch.ops.pallas.iota(n, dtype=dtype)
    assert out.dtype == dtype
    # Each integer rounded once to dtype. (torch.arange on CPU rounds some
    # bfloat16 values past 4096 differently: 4113 -> 4096 where 4128 is
    # nearest; float16's first differences lie past these n.)
    assert torch.equal(out, iota_op.reference(n, dtype))
    if dtype != torch.bfloat16:
        assert torch.equal(out, torch.arange(n, dtype=dtype))


# Triton's interpreter casts with numpy, which warns as it writes float16's inf.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types_round_each_integer_once_never_farther_than_torch(cpu_backend, dtype):
    """The op rounds each integer once to the nearest value (torch.arange on
    CUDA does too); torch.arange on CPU rounds some positions a step lower
    (ops/iota.py). So the op equals the integers rounded once, and is nowhere
    farther from the integers than torch.arange on CPU. n runs past float16's
    largest finite integer (65504): from 65520 on the op gives inf, as
    casting those integers does."""
    n = int(torch.randint(66000, 70001, ()))
    out = torch.ops.pallas.iota(n, dtype=dtype)
    exact = torch.arange(n, dtype=torch.float64)
    assert torch.equal(out, exact.to(dtype))
    assert torch.equal(out, iota_op.reference(n, dtype))
    if dtype == torch.float16:
        assert out[65519] == 65504 and out[65520:].isinf().all()
    finite = out.isfinite()
    ours = (out.double() - exact).abs()[finite]
    torchs = (torch.arange(n, dtype=dtype).double() - exact).abs()[finite]
    assert (ours <= torchs).all()
    assert (ours <= exact[finite] * dtypes.ROUNDING[dtype]).all()  # half a step at most


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
