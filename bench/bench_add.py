"""pallas::add against torch.add: GB/s on sizes well past the L2 cache, and
the bridge's cost on small tensors (the torch op against the same compiled
kernel called on JAX arrays: `time_vs_jax`)."""

from __future__ import annotations

import pytest
import torch

from conftest import record
from providers import DEVICE, SMOKE, prepare, providers

if SMOKE:
    SIZES, SMALL = [1000], [1, 64]
elif DEVICE.type == "cuda":
    SIZES, SMALL = [2**24, 2**26, 2**28], [1, 64, 1024, 4096]
else:
    SIZES, SMALL = [2**20, 2**22, 2**24], [1, 64, 1024, 4096]

CASES = [(p, n) for p in providers() for n in SIZES if not p.simulated or n == min(SIZES)]


def add_case(benchmark, provider, n, group, rounds=None):
    x = torch.randn(n, device=DEVICE)
    y = torch.randn(n, device=DEVICE)
    run = prepare(provider, "add", (x, y), {}, (x, y), {"out_shape": (n,)})
    benchmark.group = group
    if rounds:  # microseconds per call: many rounds for a stable median
        out = benchmark.pedantic(run, rounds=rounds, warmup_rounds=rounds // 10)
    else:
        out = benchmark(run)
    if provider.kind != "jax":
        torch.testing.assert_close(out, x + y)
    record(benchmark, provider, op="add", dtype=torch.float32, shape=(n,),
           work=3.0 * 4 * n, unit="GB/s")


@pytest.mark.parametrize("provider,n", CASES, ids=[f"{p.name}-{n}" for p, n in CASES])
def test_add(benchmark, provider, n):
    add_case(benchmark, provider, n, f"add {n} float32")


OVERHEAD = [p for p in providers() if p.backend in ("interpret", "mosaic_gpu") and p.kind != "torch"]


@pytest.mark.parametrize("provider", OVERHEAD, ids=lambda p: p.name)
@pytest.mark.parametrize("n", SMALL)
def test_bridge_overhead(benchmark, provider, n):
    add_case(benchmark, provider, n, f"add-overhead {n} float32", rounds=20 if SMOKE else 2000)
