"""Reference results for every op, computed by torch in float64 (exact
integers for integer dtypes); imported by the tests, the benchmarks and
`python -m torch_pallas`."""

from __future__ import annotations

import torch


def fill(size, value, dtype) -> torch.Tensor:
    return torch.full(tuple(size), value, dtype=dtype)


def iota(n: int, dtype) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64).to(dtype)


def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if x.dtype.is_floating_point:
        return x.double() + y.double()
    return x.long() + y.long()


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.double() @ b.double()


# What one rounding step costs in each dtype (2**-mantissa_bits), and the
# Tensor Core input precision (tf32 for float32 on Hopper).
ROUNDING = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
TENSOR_CORE_INPUT = {torch.float32: 2.0**-11, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def matmul_error_bound(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |pallas - ref| for a float32-accumulated product
    in a's dtype that would also hold on the hardware: rounding the inputs
    to the Tensor Core precision (|a||b| per term, summed), accumulating in
    float32, and rounding the output once."""
    k = a.shape[-1]
    magnitude = a.double().abs() @ b.double().abs()
    inputs = 2 * TENSOR_CORE_INPUT[a.dtype] * magnitude
    accumulate = k * 2.0**-24 * magnitude
    finfo = torch.finfo(a.dtype)
    output = ROUNDING[a.dtype] * ref.abs() + finfo.tiny * finfo.eps  # subnormals too
    return inputs + accumulate + output
