"""torch.ops.pallas.fill(size, value, *, dtype=None, device=None): a new
tensor of `size` holding `value`, like torch.full.

The dtype defaults as torch.full's does (bool -> bool, int -> int64,
float -> the default float dtype). int64 and float64 are filled in 32 bits
and widened, which is exact for the values accepted (checked).
"""

from __future__ import annotations

import math
import struct

import torch

from collections.abc import Sequence

from torch_pallas.base import dtypes
from torch_pallas.runtime import launch, registry
from torch_pallas.library import registration
from torch_pallas.ops import checks

OP = "pallas::fill"
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.float64)


def result_dtype(value, dtype: torch.dtype | None) -> torch.dtype:
    """The output dtype, after checking `value` and `dtype`."""
    # Symbolic values (torch.compile) default like the numbers they stand for.
    if isinstance(value, (bool, torch.SymBool)):
        default = torch.bool
    elif isinstance(value, (int, torch.SymInt)):
        default = torch.int64
    elif isinstance(value, (float, torch.SymFloat)):
        default = torch.get_default_dtype()
    else:
        raise TypeError(f"{OP}: value must be a real number, got {value!r}")
    if dtype is None:
        dtype = default
    checks.dtype_argument(OP, dtype, DTYPES)
    return dtype


def kernel_value(value, dtype: torch.dtype):
    """`value` as the kernel writes it: converted the way torch.full converts
    it (ints truncate; a finite value past the dtype's range, or a NaN or
    infinity for an int dtype, raises RuntimeError as torch's does; 16-bit
    floats are rounded through float32 first, as torch rounds a double), and
    checked to survive the 32-bit computation (ValueError: a limit of the
    kernels, not torch's)."""
    if dtype.is_floating_point:
        value = float(value)
        if math.isnan(value):
            return math.nan  # one object, so compiled kernels are reused
        info = torch.finfo(dtype)
        if math.isfinite(value) and not info.min <= value <= info.max:
            raise checks.RefusedLikeTorch(
                f"{OP}: value {value!r} cannot be converted to {dtype} without overflow"
            )
        if dtype in (torch.float16, torch.bfloat16):
            value = _in_float32(value)
        if dtype == torch.float64 and _in_float32(value) != value:
            raise ValueError(
                f"{OP}: value {value!r} is not exactly representable in the float32 "
                "the kernel computes float64 results in; use dtype=torch.float32"
            )
        return value
    if isinstance(value, float) and not math.isfinite(value):
        raise checks.RefusedLikeTorch(f"{OP}: value {value!r} cannot be converted to {dtype}")
    value = int(value)
    info = torch.iinfo(dtype)
    if not info.min <= value <= info.max:
        raise checks.RefusedLikeTorch(
            f"{OP}: value {value} cannot be converted to {dtype} without overflow"
        )
    if not dtypes.INT32_MIN <= value <= dtypes.INT32_MAX:
        raise ValueError(
            f"{OP}: value {value} does not fit the int32 the kernel computes "
            f"{dtype} results in"
        )
    return value


def _in_float32(value: float) -> float:
    """`value` rounded to float32 as torch rounds a double (to nearest; an
    infinity past its range)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _check_size(size) -> tuple:
    for i, s in enumerate(size):
        checks.size(OP, f"size[{i}]", s)
    return tuple(size)


def fill_implementation(size, value, *, dtype=None, device=None):
    size = _check_size(size)
    dtype = result_dtype(value, dtype)
    device = checks.factory_device(OP, device)
    value = kernel_value(value, dtype)
    if math.prod(size) == 0 or device.type == "meta":
        return torch.empty(size, dtype=dtype, device=device)
    kernel_dtype = dtypes.COMPUTED_IN_32_BITS.get(dtype, dtype)
    out = launch.run(
        "fill", device,
        params={"shape": size, "value": value, "dtype": dtypes.jax_name(kernel_dtype)},
    )
    return out if kernel_dtype == dtype else out.to(dtype)


def fill_fake(size, value, *, dtype=None, device=None):
    size = _check_size(size)
    dtype = result_dtype(value, dtype)
    return torch.empty(size, dtype=dtype, device=checks.factory_device(OP, device, fake=True))


registration.define(
    OP,
    fill_implementation,
    schema="(SymInt[] size, Scalar value, *, ScalarType? dtype=None, Device? device=None) -> Tensor",
    fake=fill_fake,
)


# torch.ops.pallas.fill, skipping the dispatcher on plain eager calls.
call = registration.direct_caller(torch.ops.pallas.fill.default)


def fill(size: int | Sequence[int], value, *, dtype=None, device=None) -> torch.Tensor:
    """A new tensor of shape `size` filled with `value`, like `torch.full`.

    The dtype defaults as torch.full's does: bool for a bool value, int64 for
    an int, the default float dtype for a float. Supported: float32,
    float16, bfloat16, int32, and int64/float64 for values exact in 32 bits.
    """
    if isinstance(size, (int, torch.SymInt)):
        size = (size,)
    # Before the dispatcher, which refuses a float size with a RuntimeError:
    # torch.full raises TypeError, and this names the position.
    _check_size(size)
    return call(size, value, dtype=dtype, device=checks.caller_device(device))


def reference(size, value, dtype) -> torch.Tensor:
    return torch.full(tuple(size), value, dtype=dtype)


def examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """A ragged float fill and an int one (int64 by default); nothing to
    differentiate."""
    if requires_grad:
        return []
    value = float(torch.randn(()))
    return [
        registry.Example(((33, 129), value), {"dtype": torch.float32, "device": device},
                         reference((33, 129), value, torch.float32), 0.0),
        registry.Example(((4,), 7), {"device": device}, reference((4,), 7, torch.int64), 0.0),
    ]


registry.register(registry.OpInfo(
    name="fill",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.fill",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.fill",
        "triton": "torch_pallas.kernels.triton.fill",
    },
    function=fill,
    torch_function=torch.full,
    examples=examples,
))
