"""pallas::linear_cross_entropy against torch's composition
`F.cross_entropy(F.linear(x, W).float(), target)` (what a causal LM's head
and loss run), forward+backward: speed in GFLOP/s (the three products,
6 x tokens x hidden x vocabulary FLOPs), the ratio to torch, and the peak
memory of one step above its inputs (`peak_bytes`, measured in a fresh
process by bench/memory.py; `peak_vs_torch` its ratio to torch's).

CPU: float32, 4096 tokens, hidden 1024, vocabulary 32000 (the issue's goal:
peak memory at most 1/4 of torch's, with equal loss and gradients, at
least 0.8x its speed). GPU: bfloat16, 8192 tokens, hidden 4096,
vocabulary 128256 (Llama 3's)."""

from __future__ import annotations

import pytest
import torch

from conftest import record
from memory import peaks
from providers import DEVICE, SMOKE, prepare, providers, shape_cases, synchronize
from torch_pallas.ops import linear_cross_entropy as lce_op

if SMOKE:
    SHAPES, DTYPE = [(37, 16, 100)], torch.float32
elif DEVICE.type == "cuda":
    SHAPES, DTYPE = [(8192, 4096, 128256)], torch.bfloat16
else:
    SHAPES, DTYPE = [(4096, 1024, 32000)], torch.float32

CASES, IDS = shape_cases(SHAPES, (64, 32, 300))
ROUNDS = 1 if SMOKE else 3  # a CPU step at the full size takes about 20 s


def inputs(shape, seed=0):
    tokens, hidden, vocab = shape
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator) * hidden**-0.5
    w = torch.randn(vocab, hidden, generator=generator)
    target = torch.randint(0, vocab, (tokens,), generator=generator)
    return (x.to(DEVICE, DTYPE).requires_grad_(), w.to(DEVICE, DTYPE).requires_grad_(),
            target.to(DEVICE))


def step_of(provider, x, w, target):
    """One forward+backward by `provider`, returning (loss, d_input, d_weight)."""
    forward = prepare(provider, "linear_cross_entropy", (x, w, target))

    def step():
        loss = forward()
        grads = torch.autograd.grad(loss, (x, w))
        synchronize()
        return loss, *grads

    return step


def workload(provider_name: str, shape: list):
    """A step for bench/memory.py's fresh process."""
    provider = next(p for p in providers() if p.name == provider_name)
    return step_of(provider, *inputs(tuple(shape)))


@pytest.mark.parametrize("provider,shape", CASES, ids=IDS)
def test_linear_cross_entropy_forward_backward(benchmark, provider, shape):
    x, w, target = inputs(shape)
    benchmark.group = f"linear_cross_entropy_fwd_bwd {'x'.join(map(str, shape))}"
    loss, dx, dw = benchmark.pedantic(step_of(provider, x, w, target), rounds=ROUNDS,
                                      iterations=1, warmup_rounds=1)
    ref = lce_op.reference(x, w, target)
    assert abs(loss.item() - ref.item()) <= lce_op.error_bound(x, w, ref).item() * 4
    assert dx.isfinite().all() and dw.isfinite().all()
    record(benchmark, provider, op="linear_cross_entropy_fwd_bwd", dtype=DTYPE, shape=shape,
           work=6.0 * x.shape[0] * x.shape[1] * w.shape[0], unit="GFLOP/s")
    # The smoke run leaves out the fresh process (seconds): at its sizes
    # the figure says nothing.
    if not (provider.simulated or SMOKE):
        (benchmark.extra_info["peak_bytes"],) = peaks(
            "bench_linear_cross_entropy:workload", [(provider.name, list(shape))], device=DEVICE)
