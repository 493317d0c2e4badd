"""pallas::grouped_mm, a mixture of experts' grouped GEMM, against torch.

Two suites, forward and forward+backward, each with its ratio to torch in
the same run:

- the op: the experts' gate-and-up product of a Qwen3-MoE-shaped layer,
  (tokens x top-k, hidden) times (experts, hidden, 2 x expert width) given
  as transformers passes it (the transposed view of (G, N, K) weights), on
  ragged groups, against `torch.nn.functional.grouped_mm` (on the CPU its
  per-group fallback), in TFLOP/s or GFLOP/s;
- the layer: transformers' Qwen3-MoE sparse block (router, top-k, experts)
  with its experts on each implementation: "torch" is transformers'
  default, "grouped_mm" (F.grouped_mm, torch's fastest path on both the CPU
  and a GPU), "torch[eager]" its loop over the experts hit, and
  "pallas[...]" the experts on pallas::grouped_mm and pallas::swiglu
  (torch_pallas.transformers.register()); tokens/s. transformers'
  "batched_mm" gathers one weight matrix per (token, expert) pair: at this
  size 8192 x 1536 x 1024 floats (48 GiB), so it runs in the smoke run
  only.

CPU: float32, 4096 tokens, hidden 1024, 8 experts, top-2, expert width 768
(the issue's layer). GPU: bfloat16, 16384 tokens, hidden 2048, 128
experts, top-8, width 768 (Qwen3-30B-A3B's experts).

    OMP_WAIT_POLICY=PASSIVE pytest bench/bench_grouped_mm.py --benchmark-only -n 0
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import transformers

import torch_pallas.transformers
from conftest import record
from providers import DEVICE, SMOKE, prepare, shape_cases, synchronize
from torch_pallas.ops import grouped_mm as grouped_mm_op
from torch_pallas.runtime import backends

if SMOKE:
    LAYER = dict(tokens=24, hidden=32, experts=4, top_k=2, width=24)
    DTYPE = torch.float32
elif DEVICE.type == "cuda":
    LAYER = dict(tokens=16384, hidden=2048, experts=128, top_k=8, width=768)
    DTYPE = torch.bfloat16
else:
    LAYER = dict(tokens=4096, hidden=1024, experts=8, top_k=2, width=768)
    DTYPE = torch.float32
SIMULATED_LAYER = dict(tokens=24, hidden=32, experts=4, top_k=2, width=24)
LAYER_NAME = "{tokens} tokens, hidden {hidden}, {experts} experts top-{top_k}, width {width}".format(
    **LAYER)


# --- the op ----------------------------------------------------------------

def product_shape(layer) -> tuple[int, int, int, int]:
    """(rows, K, N, groups) of the layer's gate-and-up product."""
    return (layer["tokens"] * layer["top_k"], layer["hidden"], 2 * layer["width"],
            layer["experts"])


OP_CASES, OP_IDS = shape_cases([product_shape(LAYER)], product_shape(SIMULATED_LAYER))


def routed_offs(rows: int, groups: int, generator) -> torch.Tensor:
    """Cumulative ends of `groups` ragged groups over `rows` (a router's
    uneven split: sizes drawn around rows / groups, none a tile multiple)."""
    weights = torch.rand(groups, generator=generator) + 0.5
    sizes = (weights / weights.sum() * rows).floor().to(torch.int64)
    sizes[-1] += rows - sizes.sum()
    return sizes.cumsum(0).to(torch.int32).to(DEVICE)


def op_inputs(shape, requires_grad: bool):
    rows, k, n, groups = shape
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(rows, k, generator=generator).to(DEVICE, DTYPE)
    weight = (torch.randn(groups, n, k, generator=generator) / k ** 0.5).to(DEVICE, DTYPE)
    a.requires_grad_(requires_grad), weight.requires_grad_(requires_grad)
    return a, weight, routed_offs(rows, groups, generator)


def check_op(out, a, weight, offs):
    ref = grouped_mm_op.reference(a.detach().cpu(), weight.detach().cpu().mT, offs=offs.cpu())
    bound = grouped_mm_op.error_bound(a, ref, a.shape[1]) * 4
    assert ((out.detach().cpu().double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("provider,shape", OP_CASES, ids=OP_IDS)
def test_grouped_mm_forward(benchmark, provider, shape):
    a, weight, offs = op_inputs(shape, requires_grad=False)
    run = prepare(provider, "grouped_mm", (a, weight.mT), {"offs": offs})
    benchmark.group = f"grouped_mm {'x'.join(map(str, shape))}"
    out = benchmark(run)
    check_op(out, a, weight, offs)
    rows, k, n, _ = shape
    record(benchmark, provider, op="grouped_mm", dtype=DTYPE, shape=shape,
           work=2.0 * rows * k * n, unit="TFLOP/s" if DEVICE.type == "cuda" else "GFLOP/s")


@pytest.mark.parametrize("provider,shape", OP_CASES, ids=OP_IDS)
def test_grouped_mm_forward_backward(benchmark, provider, shape):
    a, weight, offs = op_inputs(shape, requires_grad=True)
    grad = torch.randn(shape[0], shape[2], device=DEVICE, dtype=DTYPE)
    forward = prepare(provider, "grouped_mm", (a, weight.mT), {"offs": offs})

    def step():
        out = forward()
        grads = torch.autograd.grad(out, (a, weight), grad)
        synchronize()
        return out, grads

    benchmark.group = f"grouped_mm_fwd_bwd {'x'.join(map(str, shape))}"
    out, grads = benchmark(step)
    check_op(out, a, weight, offs)
    assert all(g.isfinite().all() for g in grads)
    rows, k, n, _ = shape
    record(benchmark, provider, op="grouped_mm_fwd_bwd", dtype=DTYPE, shape=shape,
           work=6.0 * rows * k * n, unit="TFLOP/s" if DEVICE.type == "cuda" else "GFLOP/s")


# --- the layer -------------------------------------------------------------

BACKEND = backends.default_for(DEVICE).name
# (provider name, transformers' experts implementation)
IMPLEMENTATIONS = {"torch": "grouped_mm", "torch[eager]": "eager",
                   f"pallas[{BACKEND}]": "pallas"}
if SMOKE:
    IMPLEMENTATIONS["torch[batched_mm]"] = "batched_mm"


@functools.cache
def layers() -> dict[str, torch.nn.Module]:
    """The Qwen3-MoE sparse block, one copy per implementation, same weights."""
    torch_pallas.transformers.register()
    config = transformers.Qwen3MoeConfig(
        hidden_size=LAYER["hidden"], moe_intermediate_size=LAYER["width"],
        num_experts=LAYER["experts"], num_experts_per_tok=LAYER["top_k"], norm_topk_prob=True)
    torch.manual_seed(0)
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    block = block.to(DEVICE, DTYPE)
    found = {}
    for name, implementation in IMPLEMENTATIONS.items():
        layer = copy.deepcopy(block)
        layer.experts.config = copy.copy(config)
        layer.experts.config._experts_implementation = implementation
        found[name] = layer
    return found


def layer_input(requires_grad: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, LAYER["tokens"], LAYER["hidden"], generator=generator)
    return x.to(DEVICE, DTYPE).requires_grad_(requires_grad)


class LayerProvider:  # what conftest.record reads
    def __init__(self, name):
        self.name = name
        self.backend = BACKEND if name.startswith("pallas") else None


def layer_tolerance():
    return dict(rtol=2e-2, atol=2e-2) if DTYPE != torch.float32 else dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("provider", IMPLEMENTATIONS)
def test_moe_layer_forward(benchmark, provider):
    x = layer_input(requires_grad=False)
    layer = layers()[provider]

    def run():
        with torch.no_grad():
            out = layer(x)
        synchronize()
        return out

    benchmark.group = f"qwen3-moe layer, {LAYER_NAME}"
    out = benchmark(run)
    with torch.no_grad():
        torch.testing.assert_close(out, layers()["torch"](x), **layer_tolerance())
    record(benchmark, LayerProvider(provider), op="moe_layer", dtype=DTYPE,
           shape=tuple(LAYER.values()), work=LAYER["tokens"], unit="tokens/s")


@pytest.mark.parametrize("provider", IMPLEMENTATIONS)
def test_moe_layer_forward_backward(benchmark, provider):
    x = layer_input(requires_grad=True)
    layer = layers()[provider]
    grad = torch.randn_like(x)

    def step():
        out = layer(x)
        grads = torch.autograd.grad(out, (x, *layer.parameters()), grad)
        synchronize()
        return out.detach(), grads

    benchmark.group = f"qwen3-moe layer fwd+bwd, {LAYER_NAME}"
    out, grads = benchmark(step)
    torch.testing.assert_close(out, layers()["torch"](x).detach(), **layer_tolerance())
    assert all(g.isfinite().all() for g in grads)
    record(benchmark, LayerProvider(provider), op="moe_layer_fwd_bwd", dtype=DTYPE,
           shape=tuple(LAYER.values()), work=LAYER["tokens"], unit="tokens/s")
