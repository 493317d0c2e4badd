"""torch.ops.pallas.iota(n, *, dtype=None, device=None): [0, 1, ..., n-1],
like torch.arange(n) (int64 by default).

Each value is the integer cast to the dtype, in float16 and bfloat16 rounded
once to nearest (ties to even; exact integers in float32 up to 2**24), as
torch.arange computes on CUDA (RangeFactories.cu: the index in float, cast
once). torch.arange on CPU differs (RangeFactoriesKernel.cpp,
Vectorized16::arange): it casts the first index of each SIMD vector (16
lanes with AVX2, 32 with AVX-512) to the dtype, adds the lane offsets to
that cast value and casts again, so where a vector's first index rounds
down (a tie, to even) the lanes after it repeat that value, one step below
the nearest. Which positions differ depends on the vector width and on where
torch's threads split the range, so no kernel matches it on every machine,
and where the two differ the op's value is the nearer: bfloat16 4113 is
4096 in torch on CPU, 4128 here; arange(70000) in float16 (AVX2) differs at
7,680 positions, each 32 lower in torch (other positions on 2 threads than
on 1). The kernel counts in int32 and writes the output dtype; int64 and
float64 results are widened from 32 bits, exact for every n accepted
(n < 2**31).
"""

from __future__ import annotations

import torch

from torch_pallas.base import dtypes
from torch_pallas.runtime import launch, registry
from torch_pallas.library import registration
from torch_pallas.ops import checks

OP = "pallas::iota"
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.float64)


def _check(n, dtype) -> torch.dtype:
    checks.size(OP, "n", n)
    checks.require(
        n <= dtypes.INT32_MAX,
        lambda: f"{OP}: n={n} is too large; the kernel counts in int32 (n < 2**31)",
    )
    dtype = torch.int64 if dtype is None else dtype
    checks.dtype_argument(OP, dtype, DTYPES)
    return dtype


def iota_implementation(n, *, dtype=None, device=None):
    dtype = _check(n, dtype)
    device = checks.factory_device(OP, device)
    if n == 0 or device.type == "meta":
        return torch.empty((n,), dtype=dtype, device=device)
    # 64-bit results: count in int32 (exact below 2**31), widen afterwards.
    kernel_dtype = torch.int32 if dtype in dtypes.COMPUTED_IN_32_BITS else dtype
    out = launch.run("iota", device, params={"n": n, "dtype": dtypes.jax_name(kernel_dtype)})
    return out if kernel_dtype == dtype else out.to(dtype)


def iota_fake(n, *, dtype=None, device=None):
    dtype = _check(n, dtype)
    return torch.empty((n,), dtype=dtype, device=checks.factory_device(OP, device, fake=True))


registration.define(
    OP,
    iota_implementation,
    schema="(SymInt n, *, ScalarType? dtype=None, Device? device=None) -> Tensor",
    fake=iota_fake,
)


# torch.ops.pallas.iota, skipping the dispatcher on plain eager calls.
call = registration.direct_caller(torch.ops.pallas.iota.default)


def iota(n: int, *, dtype=None, device=None) -> torch.Tensor:
    """[0, 1, ..., n-1], like `torch.arange(n)` (int64 unless `dtype` says).

    In float16 and bfloat16 each integer is rounded once to the nearest
    value, as torch.arange rounds on CUDA; torch.arange on CPU rounds some
    positions a step lower (see this module's docstring)."""
    checks.size(OP, "n", n)  # before the dispatcher, which refuses a float n with a RuntimeError
    return call(n, dtype=dtype, device=checks.caller_device(device))


def reference(n: int, dtype) -> torch.Tensor:
    """Each integer rounded once to `dtype` (the op's rule; torch.arange on
    CPU rounds some float16/bfloat16 positions differently)."""
    return torch.arange(n, dtype=torch.float64).to(dtype)


def examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """A ragged length in int64 (the default) and in int32."""
    if requires_grad:
        return []
    return [
        registry.Example((3001,), {"device": device}, reference(3001, torch.int64), 0.0),
        registry.Example((11,), {"dtype": torch.int32, "device": device},
                         reference(11, torch.int32), 0.0),
    ]


registry.register(registry.OpInfo(
    name="iota",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.iota",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.iota",
        "triton": "torch_pallas.kernels.triton.iota",
    },
    function=iota,
    torch_function=torch.arange,
    examples=examples,
))
