"""pallas::iota against torch.arange: GB/s written, on sizes well past the
L2 cache."""

from __future__ import annotations

import pytest
import torch

from conftest import record
from providers import DEVICE, SMOKE, prepare, providers

SIZES = [1000] if SMOKE else ([2**24, 2**26, 2**28] if DEVICE.type == "cuda" else [2**20, 2**22, 2**24])
CASES = [(p, n) for p in providers() for n in SIZES if not p.simulated or n == min(SIZES)]


@pytest.mark.parametrize("provider,n", CASES, ids=[f"{p.name}-{n}" for p, n in CASES])
def test_iota(benchmark, provider, n):
    run = prepare(provider, "iota", (n,), {"dtype": torch.int32, "device": DEVICE},
                  (), {"n": n, "dtype": "int32"})
    benchmark.group = f"iota {n} int32"
    out = benchmark(run)
    if provider.kind != "jax":
        assert torch.equal(out, torch.arange(n, dtype=torch.int32, device=DEVICE))
    record(benchmark, provider, op="iota", dtype=torch.int32, shape=(n,),
           work=4.0 * n, unit="GB/s")
