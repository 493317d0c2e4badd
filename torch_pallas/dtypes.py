"""Dtypes across the torch/JAX border.

JAX (without x64) has no 64-bit arrays, and the kernels' hardware has no
64-bit Tensor Core or vector paths: ops that accept float64/int64 compute
in the 32-bit counterpart and widen the result, and only when that is exact
(they check and raise otherwise). Nothing is ever narrowed silently.
"""

from __future__ import annotations

import torch

JAX_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}

# 64-bit dtypes a kernel may produce exactly in 32 bits, then widen.
COMPUTED_IN_32_BITS: dict[torch.dtype, torch.dtype] = {
    torch.int64: torch.int32,
    torch.float64: torch.float32,
}

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def jax_name(dtype: torch.dtype) -> str:
    try:
        return JAX_NAMES[dtype]
    except KeyError:
        raise TypeError(f"torch_pallas: no JAX counterpart for {dtype}") from None


def names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


# What one rounding step costs in each dtype (2**-mantissa_bits): the
# tolerance of a correctly rounded result, used by the ops' error bounds.
ROUNDING = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
