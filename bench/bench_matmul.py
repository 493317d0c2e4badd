"""pallas::matmul against torch.matmul: GFLOP/s and the ratio to torch.

CPU: float32, bfloat16 and float16 squares 256..2048. GPU: bfloat16 and float16 squares
1024..8192, 4096x8192x4096, and LLM shapes (M in 16, 128, 2048, 8192;
K = 4096; N in 4096, 14336). Also one MLP step, gelu(x @ w), torch's
against the Pallas matmul's (CPU 512^3 and 1024^3, GPU 4096^3)."""

from __future__ import annotations

import pytest
import torch

from conftest import record
from providers import DEVICE, SMOKE, prepare, providers, synchronize
from torch_pallas.ops import matmul as matmul_op
from torch_pallas.ops.matmul import float32_precision

if SMOKE:  # on a GPU in a 16-bit dtype: mosaic_gpu multiplies float32 only as TF32
    SHAPES, DTYPES = [(64, 48, 80)], [torch.float32 if DEVICE.type == "cpu" else torch.bfloat16]
elif DEVICE.type == "cuda":
    SHAPES = [(n, n, n) for n in (1024, 2048, 4096, 8192)] + [(4096, 8192, 4096)] + [
        (m, 4096, n) for m in (16, 128, 2048, 8192) for n in (4096, 14336)
    ]
    DTYPES = [torch.bfloat16, torch.float16]
else:
    SHAPES = [(n, n, n) for n in (256, 512, 1024, 2048)]
    DTYPES = [torch.float32, torch.bfloat16, torch.float16]

CASES = [
    (p, shape)
    for p in providers()
    for shape in SHAPES
    if not p.simulated or shape == min(SHAPES)  # simulators: the smallest only
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("provider,shape", CASES, ids=[f"{p.name}-{'x'.join(map(str, s))}" for p, s in CASES])
def test_matmul(benchmark, provider, shape, dtype):
    m, k, n = shape
    a = torch.randn(m, k, device=DEVICE, dtype=dtype)
    b = torch.randn(k, n, device=DEVICE, dtype=dtype)
    params = {"transpose_a": False, "transpose_b": False}
    if dtype == torch.float32:  # as the op passes it: the same compiled kernel
        params["precision"] = float32_precision()
    run = prepare(provider, "matmul", (a, b), {}, (a.reshape(1, m, k), b.reshape(1, k, n)), params)
    benchmark.group = f"matmul {m}x{k}x{n} {str(dtype).removeprefix('torch.')}"
    out = benchmark(run)
    if provider.kind != "jax":  # a benchmark of a wrong result is worthless
        ref = matmul_op.reference(a.cpu(), b.cpu())
        err = (out.cpu().double().reshape(ref.shape) - ref).abs()
        assert (err <= matmul_op.error_bound(a.cpu(), b.cpu(), ref)).all()
    record(benchmark, provider, op="matmul", dtype=dtype, shape=shape,
           work=2.0 * m * n * k, unit="GFLOP/s")


# One MLP step, gelu(x @ w): the matmul starts right after a parallel torch
# op, as it does inside a model. On CPU this shows torch's OpenMP workers
# competing with a large kernel (docs/performance.md: "Mixing with torch's CPU ops");
# run it with and without OMP_WAIT_POLICY=PASSIVE to compare.
STEP_SHAPES = SHAPES if SMOKE else [(n, n, n) for n in ((512, 1024) if DEVICE.type == "cpu" else (4096,))]
STEP_CASES = [(p, shape) for p in providers() if p.kind != "jax" and not p.simulated
              for shape in STEP_SHAPES]
GELU_SLOPE = 1.13  # max |gelu'|: an error in its input grows at most this much


@pytest.mark.parametrize("provider,shape", STEP_CASES,
                         ids=[f"{p.name}-{'x'.join(map(str, s))}" for p, s in STEP_CASES])
def test_matmul_then_gelu(benchmark, provider, shape):
    m, k, n = shape
    dtype = DTYPES[0]
    x = torch.randn(m, k, device=DEVICE, dtype=dtype)
    w = torch.randn(k, n, device=DEVICE, dtype=dtype) / k**0.5
    matmul = prepare(provider, "matmul", (x, w))

    def step():
        out = torch.nn.functional.gelu(matmul())
        synchronize()
        return out

    benchmark.group = f"matmul_gelu {m}x{k}x{n} {str(dtype).removeprefix('torch.')}"
    out = benchmark(step)
    ref = matmul_op.reference(x.cpu(), w.cpu())
    bound = GELU_SLOPE * matmul_op.error_bound(x.cpu(), w.cpu(), ref)
    err = (out.cpu().double() - torch.nn.functional.gelu(ref)).abs()
    assert (err <= bound + 4 * torch.finfo(dtype).eps * ref.abs()).all()
    record(benchmark, provider, op="matmul_gelu", dtype=dtype, shape=shape,
           work=2.0 * m * n * k, unit="GFLOP/s")
