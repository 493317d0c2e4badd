"""Dtypes across the torch/JAX border.

JAX (without x64) has no 64-bit arrays, and the kernels' hardware has no
64-bit Tensor Core or vector paths: the shipped ops that accept
float64/int64 compute in the 32-bit counterpart and widen the result, and
only when that is exact (they check and raise otherwise). A user's JAX
function (torch_pallas.custom_op) receives 64-bit tensors as they are, with
JAX's 64-bit mode on for that kernel alone (`needs_x64`), and float8
tensors as JAX's float8 types. Nothing is ever narrowed silently.
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

# What a custom op's function may also take and return: float8 (JAX has the
# same types), and 64-bit types with JAX's 64-bit mode on for its kernel.
FLOAT8_NAMES: dict[torch.dtype, str] = {
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}
X64_NAMES: dict[torch.dtype, str] = {torch.float64: "float64", torch.int64: "int64"}
CUSTOM_OP_NAMES: dict[torch.dtype, str] = {**JAX_NAMES, **FLOAT8_NAMES, **X64_NAMES}
TORCH_DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in CUSTOM_OP_NAMES.items()}

# 64-bit dtypes a kernel may produce exactly in 32 bits, then widen.
COMPUTED_IN_32_BITS: dict[torch.dtype, torch.dtype] = {
    torch.int64: torch.int32,
    torch.float64: torch.float32,
}

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def jax_name(dtype: torch.dtype) -> str:
    try:
        return CUSTOM_OP_NAMES[dtype]
    except KeyError:
        raise TypeError(f"torch_pallas: no JAX counterpart for {dtype}") from None


def needs_x64(dtypes) -> bool:
    """Whether a kernel seeing these torch dtypes needs JAX's 64-bit mode."""
    return any(d in X64_NAMES for d in dtypes)


def names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


# What one rounding step costs in each dtype (2**-mantissa_bits): the
# tolerance of a correctly rounded result, used by the ops' error bounds.
ROUNDING = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
