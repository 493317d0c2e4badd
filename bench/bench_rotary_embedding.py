"""pallas::rotary_embedding against torch's composition (transformers'
`apply_rotary_pos_emb`: q * cos + rotate_half(q) * sin, and k alike),
forward and forward+backward, on q and k as a Llama attention layer makes
them (`proj(x).view(B, S, H, D).transpose(1, 2)`, grouped kv heads) with
the layer's cos and sin (1, S, D), in GB/s (the bytes a fused kernel
moves: q, k, cos and sin read and q_embed, k_embed written forward; as
much again backward) and the ratio to torch; each call's peak memory
(bench/memory.py) in the JSON as `peak_bytes`.

CPU: float32, batch 1, 32 heads, 8 kv heads, 2048 tokens, head size 128
(Llama's). GPU: bfloat16, batch 4, 4096 tokens."""

from __future__ import annotations

import pytest
import torch

import memory
from conftest import record
from providers import DEVICE, SMOKE, prepare, providers, shape_cases, synchronize
from torch_pallas.ops import rotary_embedding as rope

# (batch, heads, kv heads, tokens, head size)
if SMOKE:
    SHAPE, DTYPE = (1, 4, 2, 8, 16), torch.float32
elif DEVICE.type == "cuda":
    SHAPE, DTYPE = (4, 32, 8, 4096, 128), torch.bfloat16
else:
    SHAPE, DTYPE = (1, 32, 8, 2048, 128), torch.float32

CASES, IDS = shape_cases([SHAPE], (1, 4, 2, 64, 64))


def inputs(shape, requires_grad):
    """(q, k, cos, sin): q and k split into heads off their projections,
    the angles of positions 0..S-1 (base 10000)."""
    b, h, kv, s, d = shape

    def heads(n):
        projected = torch.randn(b, s, n * d, device=DEVICE, dtype=DTYPE,
                                requires_grad=requires_grad)
        return projected.view(b, s, n, d).transpose(1, 2)

    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, device=DEVICE, dtype=torch.float32) / d)
    angles = torch.arange(s, device=DEVICE, dtype=torch.float32)[:, None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)[None]
    return heads(h), heads(kv), angles.cos().to(DTYPE), angles.sin().to(DTYPE)


def call(provider, shape, backward: bool):
    """One forward (and backward) of `provider` on fresh inputs: what the
    benchmark times and bench/memory.py measures."""
    q, k, cos, sin = inputs(shape, requires_grad=backward)
    forward = prepare(provider, "rotary_embedding", (q, k, cos, sin))
    if not backward:
        return forward
    grads = [torch.randn(x.shape, device=DEVICE, dtype=DTYPE) for x in (q, k)]

    def step():
        outs = forward()
        dq, dk = torch.autograd.grad(outs, (q, k), grads)
        synchronize()
        return outs, (dq, dk)

    step.inputs = (q, k, cos, sin)
    return step


def workload(provider_name: str, shape: list, backward: bool):
    """bench/memory.py's entry: `call` for a provider named as in the JSON."""
    (provider,) = [p for p in providers() if p.name == provider_name]
    return call(provider, tuple(shape), backward)


def check(outs, q, k, cos, sin):
    refs = rope.reference(q, k, cos, sin)
    for x, out, ref in zip((q, k), outs, refs):
        bound = rope.error_bound(x, cos, sin, ref) * 4
        assert ((out.detach().cpu().double() - ref).abs() <= bound).all()


def record_memory(benchmark, provider, shape, backward: bool):
    """The call's peak memory; None on the smoke run (fresh processes of
    some seconds each, at sizes that say nothing) and on the simulators."""
    benchmark.extra_info["peak_bytes"] = (
        None if SMOKE or provider.simulated
        else memory.peak_bytes("bench_rotary_embedding:workload", provider.name, list(shape),
                               backward, device=DEVICE))


def q_shape(shape) -> tuple:
    """q's (B, H, S, D), the size the JSON and the plots show (the kv heads
    are in the group's name)."""
    b, h, _, s, d = shape
    return (b, h, s, d)


def moved_bytes(shape) -> float:
    b, h, kv, s, d = shape
    return (2 * b * (h + kv) * s * d + 2 * s * d) * torch.finfo(DTYPE).bits / 8


@pytest.mark.parametrize("provider,shape", CASES, ids=IDS)
def test_rotary_embedding_forward(benchmark, provider, shape):
    q, k, cos, sin = inputs(shape, requires_grad=False)
    run = prepare(provider, "rotary_embedding", (q, k, cos, sin))
    benchmark.group = f"rotary_embedding {'x'.join(map(str, shape))}"
    outs = benchmark(run)
    check(outs, q, k, cos, sin)
    record_memory(benchmark, provider, shape, backward=False)
    record(benchmark, provider, op="rotary_embedding", dtype=DTYPE, shape=q_shape(shape),
           work=moved_bytes(shape), unit="GB/s")


@pytest.mark.parametrize("provider,shape", CASES, ids=IDS)
def test_rotary_embedding_forward_backward(benchmark, provider, shape):
    step = call(provider, shape, backward=True)
    benchmark.group = f"rotary_embedding_fwd_bwd {'x'.join(map(str, shape))}"
    outs, grads = benchmark(step)
    check(outs, *step.inputs)
    assert all(g.isfinite().all() for g in grads)
    record_memory(benchmark, provider, shape, backward=True)
    record(benchmark, provider, op="rotary_embedding_fwd_bwd", dtype=DTYPE, shape=q_shape(shape),
           work=2 * moved_bytes(shape), unit="GB/s")
