"""torch.ops.pallas.iota(n, *, dtype=None, device=None): [0, 1, ..., n-1],
like torch.arange(n) (int64 by default).

Each value is the integer rounded once to the dtype (torch.arange in
bfloat16 rounds some values past 4096 differently). The kernel counts in
int32 and writes the output dtype; int64 and float64
results are widened from 32 bits, exact for every n accepted (n < 2**31).
"""

from __future__ import annotations

import torch

from torch_pallas import dtypes, library
from torch_pallas.launch import launch
from torch_pallas.ops import checks

OP = "pallas::iota"
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.float64)


def _check(n, dtype) -> torch.dtype:
    checks.size(OP, "n", n)
    torch._check(
        n <= dtypes.INT32_MAX,
        lambda: f"{OP}: n={n} is too large; the kernel counts in int32 (n < 2**31)",
    )
    dtype = torch.int64 if dtype is None else dtype
    checks.dtype_in(OP, "dtype", dtype, DTYPES)
    return dtype


def iota_implementation(n, *, dtype=None, device=None):
    dtype = _check(n, dtype)
    device = checks.factory_device(device)
    if n == 0 or device.type == "meta":
        return torch.empty((n,), dtype=dtype, device=device)
    # 64-bit results: count in int32 (exact below 2**31), widen afterwards.
    kernel_dtype = torch.int32 if dtype in dtypes.COMPUTED_IN_32_BITS else dtype
    out = launch("iota", device, params={"n": n, "dtype": dtypes.jax_name(kernel_dtype)})
    return out.to(dtype)


def iota_fake(n, *, dtype=None, device=None):
    dtype = _check(n, dtype)
    return torch.empty((n,), dtype=dtype, device=checks.factory_device(device))


iota = library.define(
    OP,
    iota_implementation,
    schema="(SymInt n, *, ScalarType? dtype=None, Device? device=None) -> Tensor",
    fake=iota_fake,
    compile_path=iota_implementation,
)
