"""pallas::swiglu against torch's composition `F.silu(gate) * up` (what a
transformers gated MLP runs), forward and forward+backward, in GB/s (the
bytes a fused kernel moves: gate, up and out forward; dy, gate, up, d_gate
and d_up backward) and the ratio to torch.

CPU: float32, 4096 x 4096 (the issue's goal: forward+backward at least 1.2x
as fast as the module it replaces, eager). GPU: bfloat16, 16384 x 14336."""

from __future__ import annotations

import pytest
import torch

from conftest import record
from providers import DEVICE, SMOKE, prepare, shape_cases, synchronize
from torch_pallas.ops import swiglu as swiglu_op

if SMOKE:
    SHAPES, DTYPE = [(37, 64)], torch.float32
elif DEVICE.type == "cuda":
    SHAPES, DTYPE = [(16384, 14336)], torch.bfloat16
else:
    SHAPES, DTYPE = [(4096, 4096)], torch.float32

CASES, IDS = shape_cases(SHAPES, (64, 256))


def inputs(shape, requires_grad):
    return [torch.randn(shape, device=DEVICE, dtype=DTYPE, requires_grad=requires_grad)
            for _ in range(2)]


def check(out, gate, up):
    ref = swiglu_op.reference(gate.detach().cpu(), up.detach().cpu())
    assert ((out.detach().cpu().double() - ref).abs() <= swiglu_op.error_bound(gate, ref) * 4).all()


@pytest.mark.parametrize("provider,shape", CASES, ids=IDS)
def test_swiglu_forward(benchmark, provider, shape):
    gate, up = inputs(shape, requires_grad=False)
    run = prepare(provider, "swiglu", (gate, up))
    benchmark.group = f"swiglu {'x'.join(map(str, shape))}"
    out = benchmark(run)
    check(out, gate, up)
    record(benchmark, provider, op="swiglu", dtype=DTYPE, shape=shape,
           work=3.0 * gate.numel() * gate.element_size(), unit="GB/s")


@pytest.mark.parametrize("provider,shape", CASES, ids=IDS)
def test_swiglu_forward_backward(benchmark, provider, shape):
    gate, up = inputs(shape, requires_grad=True)
    grad = torch.randn_like(gate)
    forward = prepare(provider, "swiglu", (gate, up))

    def step():
        out = forward()
        grads = torch.autograd.grad(out, (gate, up), grad)
        synchronize()
        return out, grads

    benchmark.group = f"swiglu_fwd_bwd {'x'.join(map(str, shape))}"
    out, grads = benchmark(step)
    check(out, gate, up)
    assert all(g.isfinite().all() for g in grads)
    record(benchmark, provider, op="swiglu_fwd_bwd", dtype=DTYPE, shape=shape,
           work=8.0 * gate.numel() * gate.element_size(), unit="GB/s")
