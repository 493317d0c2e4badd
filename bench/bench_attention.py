"""pallas::attention against torch's scaled_dot_product_attention, forward
and forward+backward, in TFLOP/s (4·N·H·L·S·E per forward, halved when
causal; a backward counts 2.5 forwards) and the ratio to torch.

CPU: float32, N=4, H=8, L=S=512 and 1024, E=64, causal and not (the
issue's goal: >= 0.8x torch at 512). GPU: bfloat16, E=128, L=S=4096 (N=4)
and 8192 (N=2), H=16, causal and not, against torch's flash backend."""

from __future__ import annotations

import pytest
import torch

from conftest import record
from providers import DEVICE, SMOKE, prepare, providers, synchronize
from torch_pallas.kernels.attention_shapes import AttentionDims, attention_flops
from torch_pallas.ops import attention as attention_op

if SMOKE:
    SHAPES = [(1, 2, 37, 16)]  # (N, H, L=S, E)
    DTYPE = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
elif DEVICE.type == "cuda":
    SHAPES, DTYPE = [(4, 16, 4096, 128), (2, 16, 8192, 128)], torch.bfloat16
else:
    SHAPES, DTYPE = [(4, 8, 512, 64), (4, 8, 1024, 64)], torch.float32



def serves(provider) -> bool:
    """The Mosaic GPU kernels take 16-bit inputs only."""
    mosaic_gpu = provider.backend is not None and provider.backend.startswith("mosaic_gpu")
    return provider.kind != "jax" and not (mosaic_gpu and DTYPE == torch.float32)


# The simulators only at the smallest size: they time a simulation.
PROVIDERS = [p for p in providers() if serves(p)]
CASES = [(p, shape, causal) for p in PROVIDERS for shape in SHAPES for causal in (False, True)
         if not p.simulated or (shape == min(SHAPES) and not SMOKE)]  # smoke: no simulations
IDS = [f"{p.name}-{'x'.join(map(str, s))}-{'causal' if c else 'full'}" for p, s, c in CASES]


def inputs(shape, requires_grad):
    n, h, l, e = shape
    return [torch.randn(n, h, l, e, device=DEVICE, dtype=DTYPE, requires_grad=requires_grad)
            for _ in range(3)]


def flops(shape, causal) -> float:
    n, h, l, e = shape
    return attention_flops(AttentionDims(n, h, h, l, l, e, e), causal)


def check(out, q, k, v, causal):
    """A benchmark of a wrong result is worthless."""
    ref = attention_op.reference(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(),
                                 is_causal=causal)
    bound = attention_op.error_bound(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), ref)
    assert ((out.detach().cpu().double() - ref).abs() <= bound * 4).all()


@pytest.mark.parametrize("provider,shape,causal", CASES, ids=IDS)
def test_attention_forward(benchmark, provider, shape, causal):
    q, k, v = inputs(shape, requires_grad=False)
    run = prepare(provider, "attention", (q, k, v), {"is_causal": causal})
    benchmark.group = f"attention {'x'.join(map(str, shape))} {'causal' if causal else 'full'}"
    out = benchmark(run)
    check(out, q, k, v, causal)
    record(benchmark, provider, op="attention", dtype=DTYPE, shape=shape,
           work=flops(shape, causal), unit="TFLOP/s")


@pytest.mark.parametrize("provider,shape,causal", CASES, ids=IDS)
def test_attention_forward_backward(benchmark, provider, shape, causal):
    q, k, v = inputs(shape, requires_grad=True)
    grad = torch.randn_like(q)
    forward = prepare(provider, "attention", (q, k, v), {"is_causal": causal})

    def step():
        out = forward()
        grads = torch.autograd.grad(out, (q, k, v), grad)
        synchronize()
        return out, grads

    benchmark.group = (f"attention_fwd_bwd {'x'.join(map(str, shape))} "
                       f"{'causal' if causal else 'full'}")
    out, grads = benchmark(step)
    check(out, q, k, v, causal)
    assert all(g.isfinite().all() for g in grads)
    record(benchmark, provider, op="attention_fwd_bwd", dtype=DTYPE, shape=shape,
           work=3.5 * flops(shape, causal), unit="TFLOP/s")
