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


# What one rounding step costs in each dtype (2**-mantissa_bits), and what
# rounding a Tensor Core input costs (TF32 for float32, when torch allows it).
ROUNDING = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
TF32_INPUT = 2.0**-11


def matmul_error_bound(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor,
                       tf32: bool = False) -> torch.Tensor:
    """Elementwise bound on |pallas - ref| for a float32-accumulated product
    in a's dtype: float32 accumulation, one rounding of the output and, with
    `tf32` (float32 at torch's 'high' precision), the inputs rounded to TF32;
    16-bit inputs are exact in float32."""
    k = a.shape[-1]
    magnitude = a.double().abs() @ b.double().abs()
    accumulate = k * 2.0**-24 * magnitude
    inputs = 2 * TF32_INPUT * magnitude if tf32 and a.dtype == torch.float32 else 0
    finfo = torch.finfo(a.dtype)
    output = ROUNDING[a.dtype] * ref.abs() + finfo.tiny * finfo.eps  # subnormals too
    return inputs + accumulate + output
