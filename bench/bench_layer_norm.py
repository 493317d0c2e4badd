"""pallas::layer_norm against torch's F.layer_norm (what nn.LayerNorm, and so
GPT-2's and other transformers models' norms, run), forward and
forward+backward, in GB/s (x and out forward; x, dy and dx backward) and
the ratio to torch.

CPU: float32, 4096 x 4096 (the issue's goal: forward+backward at least 1.2x
as fast as the module it replaces, eager). GPU: bfloat16, 16384 x 4096."""

from __future__ import annotations

import pytest
import torch

from conftest import record
from providers import DEVICE, SMOKE, prepare, shape_cases, synchronize
from torch_pallas.ops import layer_norm as layer_norm_op

if SMOKE:
    SHAPES, DTYPE = [(37, 64)], torch.float32
elif DEVICE.type == "cuda":
    SHAPES, DTYPE = [(16384, 4096)], torch.bfloat16
else:
    SHAPES, DTYPE = [(4096, 4096)], torch.float32

CASES, IDS = shape_cases(SHAPES, (64, 256))


def inputs(shape, requires_grad):
    x = torch.randn(shape, device=DEVICE, dtype=DTYPE, requires_grad=requires_grad)
    weight = (torch.rand(shape[-1], device=DEVICE) + 0.5).to(DTYPE).requires_grad_(requires_grad)
    bias = torch.randn(shape[-1], device=DEVICE, dtype=DTYPE, requires_grad=requires_grad)
    return x, weight, bias


def check(out, x, weight, bias):
    ref = layer_norm_op.reference(x.detach().cpu(), (x.shape[-1],), weight.detach().cpu(),
                                  bias.detach().cpu())
    bound = layer_norm_op.error_bound(x.detach().cpu(), ref, x.shape[-1])
    assert ((out.detach().cpu().double() - ref).abs() <= bound * 4).all()


@pytest.mark.parametrize("provider,shape", CASES, ids=IDS)
def test_layer_norm_forward(benchmark, provider, shape):
    x, weight, bias = inputs(shape, requires_grad=False)
    run = prepare(provider, "layer_norm", (x, (x.shape[-1],), weight, bias))
    benchmark.group = f"layer_norm {'x'.join(map(str, shape))}"
    out = benchmark(run)
    check(out, x, weight, bias)
    record(benchmark, provider, op="layer_norm", dtype=DTYPE, shape=shape,
           work=2.0 * x.numel() * x.element_size(), unit="GB/s")


@pytest.mark.parametrize("provider,shape", CASES, ids=IDS)
def test_layer_norm_forward_backward(benchmark, provider, shape):
    x, weight, bias = inputs(shape, requires_grad=True)
    grad = torch.randn_like(x)
    forward = prepare(provider, "layer_norm", (x, (x.shape[-1],), weight, bias))

    def step():
        out = forward()
        grads = torch.autograd.grad(out, (x, weight, bias), grad)
        synchronize()
        return out, grads

    benchmark.group = f"layer_norm_fwd_bwd {'x'.join(map(str, shape))}"
    out, grads = benchmark(step)
    check(out, x, weight, bias)
    assert all(g.isfinite().all() for g in grads)
    record(benchmark, provider, op="layer_norm_fwd_bwd", dtype=DTYPE, shape=shape,
           work=5.0 * x.numel() * x.element_size(), unit="GB/s")
