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


# --- packed sequences and sliding windows (pallas::varlen_attention) --------
#
# A padding-free batch: 8 causal sequences of 64 to 1024 tokens packed into
# one row (about half the padded batch's rows are padding), against SDPA
# on the padded batch (8, H, 1024, E), causal; and a 4096-token causal
# window of 512 keys against the same op's full causal attention.

if SMOKE:
    PACKED_LENGTHS, HEADS, HEAD_DIM, WINDOW_TOKENS, WINDOW = [7, 19, 3], 2, 16, 64, 8
else:
    PACKED_LENGTHS, HEADS, HEAD_DIM = [1024, 130, 700, 64, 512, 300, 900, 400], 8, 64
    WINDOW_TOKENS, WINDOW = 4096, 512
PALLAS = next(p for p in providers() if p.kind == "pallas" and not p.simulated)


def _packed_call(name: str, requires_grad: bool):
    """(forward, leaves, the check of its output) of the padded batch on
    SDPA ("torch-padded") or the packed one on varlen_attention."""
    from torch_pallas.ops import varlen_attention as varlen_op

    lengths, longest = PACKED_LENGTHS, max(PACKED_LENGTHS)
    tokens = sum(lengths)
    q, k, v = (torch.randn(tokens, HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
               for _ in range(3))
    cu = varlen_op.random_sequences(lengths, DEVICE)
    if name == "torch-padded":
        padded = [torch.zeros(len(lengths), HEADS, longest, HEAD_DIM, device=DEVICE, dtype=DTYPE)
                  for _ in range(3)]
        for t, src in zip(padded, (q, k, v)):
            start = 0
            for b, n in enumerate(lengths):
                t[b, :, :n] = src[start:start + n].transpose(0, 1)
                start += n
        leaves = [t.requires_grad_(requires_grad) for t in padded]

        def forward():
            return torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
    else:
        leaves = [t.requires_grad_(requires_grad) for t in (q, k, v)]

        def forward():
            return varlen_op.varlen_attention(*leaves, cu, cu, longest, longest,
                                              window_size=(-1, 0))
    return forward, leaves


def _window_call(name: str, requires_grad: bool):
    """The window on the op ("window"), the op's full causal attention
    ("full-causal"), or SDPA with the window as a dense (L, L) mask
    ("torch-masked": stock PyTorch's way to the same result)."""
    q, k, v = (torch.randn(1, HEADS, WINDOW_TOKENS, HEAD_DIM, device=DEVICE, dtype=DTYPE,
                           requires_grad=requires_grad) for _ in range(3))
    if name == "torch-masked":
        i = torch.arange(WINDOW_TOKENS, device=DEVICE)
        band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - WINDOW)

        def forward():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band)
        return forward, [q, k, v]
    window = (WINDOW - 1, 0) if name == "window" else (-1, -1)

    def forward():
        return attention_op.attention(q, k, v, is_causal=True, window_size=window)
    return forward, [q, k, v]


def _timed(benchmark, forward, leaves, backward: bool):
    if not backward:
        return benchmark(forward)
    out = forward()
    grad = torch.randn_like(out)

    def step():
        grads = torch.autograd.grad(forward(), leaves, grad)
        synchronize()
        return grads

    return benchmark(step)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
@pytest.mark.parametrize("name", ["torch-padded", "pallas-packed"])
def test_packed_sequences(benchmark, name, backward):
    forward, leaves = _packed_call(name, requires_grad=backward)
    benchmark.group = f"packed {len(PACKED_LENGTHS)} sequences {'fwd_bwd' if backward else 'fwd'}"
    result = _timed(benchmark, forward, leaves, backward)
    assert all(t.isfinite().all() for t in (result if backward else [result]))
    provider = providers()[0] if name.startswith("torch") else PALLAS
    causal_flops = sum(attention_flops(AttentionDims(1, HEADS, HEADS, n, n, HEAD_DIM, HEAD_DIM),
                                       True) for n in PACKED_LENGTHS)
    record(benchmark, provider, op="varlen_attention" + ("_fwd_bwd" if backward else ""),
           dtype=DTYPE, shape=[sum(PACKED_LENGTHS), HEADS, HEAD_DIM],
           work=causal_flops * (3.5 if backward else 1), unit="TFLOP/s")


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
@pytest.mark.parametrize("name", ["torch-masked", "full-causal", "window"])
def test_sliding_window(benchmark, name, backward):
    """The window against SDPA with its dense mask ("torch") and against the
    op's own full causal attention (the issue's 3x: the ratio of those two
    medians), FLOPs counted for the keys each computes."""
    forward, leaves = _window_call(name, requires_grad=backward)
    benchmark.group = f"window {WINDOW} of {WINDOW_TOKENS} {'fwd_bwd' if backward else 'fwd'}"
    result = _timed(benchmark, forward, leaves, backward)
    assert all(t.isfinite().all() for t in (result if backward else [result]))
    keys = (WINDOW_TOKENS + 1) / 2 if name == "full-causal" else WINDOW
    work = 4 * HEADS * WINDOW_TOKENS * keys * HEAD_DIM
    provider = {"torch-masked": providers()[0], "window": PALLAS,
                "full-causal": type(PALLAS)(f"{PALLAS.name} full causal", PALLAS.backend,
                                            PALLAS.kind)}[name]
    record(benchmark, provider, op="attention_window" + ("_fwd_bwd" if backward else ""),
           dtype=DTYPE, shape=[1, HEADS, WINDOW_TOKENS, HEAD_DIM],
           work=work * (3.5 if backward else 1), unit="TFLOP/s")


# A padded batch (a tokenizer's attention_mask) on transformers' pallas
# path, the batch folded into packed sequences (torch_pallas/transformers/
# attention.py, padded_attention): with an all-ones mask, as a trace sees
# one, against the same batch without a mask ("unpadded", what an eager
# all-ones mask takes); with left padding (a quarter to a half of each
# row), against SDPA with transformers' dense (B, 1, L, L) mask.

if SMOKE:
    PADDED_BATCH, PADDED_TOKENS = 2, 24
else:
    PADDED_BATCH, PADDED_TOKENS = 4, 1024


def _padded_call(name: str, requires_grad: bool):
    from torch_pallas.transformers import attention as hf_attention

    shape = (PADDED_BATCH, HEADS, PADDED_TOKENS, HEAD_DIM)
    q, k, v = (torch.randn(shape, device=DEVICE, dtype=DTYPE, requires_grad=requires_grad)
               for _ in range(3))
    mask = torch.ones(PADDED_BATCH, PADDED_TOKENS, dtype=torch.bool, device=DEVICE)
    if name.endswith("left-padded"):
        for b in range(PADDED_BATCH):
            mask[b, :PADDED_TOKENS * (b + 1) // (2 * PADDED_BATCH) + PADDED_TOKENS // 4] = False
    if name == "pallas-unpadded":
        def forward():
            return attention_op.attention(q, k, v, is_causal=True)
    elif name.startswith("pallas"):
        def forward():
            return hf_attention.padded_attention(q, k, v, mask, 0.0, None, None, 0.0, None)
    else:
        i = torch.arange(PADDED_TOKENS, device=DEVICE)
        dense = (i[None, :] <= i[:, None]) & mask[:, None, None, :]

        def forward():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    return forward, [q, k, v]


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
@pytest.mark.parametrize("name", ["pallas-unpadded", "pallas-folded-all-ones",
                                  "torch-masked-left-padded", "pallas-folded-left-padded"])
def test_padded_batch(benchmark, name, backward):
    """The fold's cost: an all-ones mask folded against no mask (the
    issue's "the speed of no mask"), and a left-padded batch folded against
    SDPA with the dense mask; FLOPs counted as the unpadded causal batch's
    for all four (so the TFLOP/s compare times)."""
    forward, leaves = _padded_call(name, requires_grad=backward)
    benchmark.group = (f"padded batch {PADDED_BATCH} x {PADDED_TOKENS} "
                       f"{'fwd_bwd' if backward else 'fwd'}")
    result = _timed(benchmark, forward, leaves, backward)
    assert all(t.isfinite().all() for t in (result if backward else [result]))
    dims = AttentionDims(PADDED_BATCH, HEADS, HEADS, PADDED_TOKENS, PADDED_TOKENS, HEAD_DIM,
                         HEAD_DIM)
    provider = providers()[0] if name.startswith("torch") else type(PALLAS)(
        f"{PALLAS.name} {name.removeprefix('pallas-')}", PALLAS.backend, PALLAS.kind)
    record(benchmark, provider, op="attention_padded" + ("_fwd_bwd" if backward else ""),
           dtype=DTYPE, shape=[PADDED_BATCH, HEADS, PADDED_TOKENS, HEAD_DIM],
           work=attention_flops(dims, True) * (3.5 if backward else 1), unit="TFLOP/s")
