"""pallas::token_log_probs against the unfused path a GRPO trainer runs
(TRL's: the full logits over the temperature, `log_softmax`, the targets'
gather and the entropy), forward+backward through both outputs (a loss
weighting each token's log-prob, plus an entropy bonus): speed in GFLOP/s
(the unfused path's three products, 6 x tokens x hidden x vocabulary
FLOPs; the op makes a fourth, recomputing the logits in its backward), the
ratio to torch, and the peak memory of one step above its inputs
(`peak_bytes`, measured in a fresh process by bench/memory.py;
`peak_vs_torch` its ratio to torch's).

CPU: 4096 tokens, hidden 1024, vocabularies 32000 (Llama 2's) and 151936
(Qwen's), float32 and bfloat16 (the issue's goal: peak memory at most 1/4
of the unfused path's, forward+backward at most 1.1x its time). GPU:
bfloat16, 8192 tokens, hidden 4096, vocabulary 151936 (TRL issue 7244's
H100 figures: 59 ms and 19.9 GiB unfused; its target for a fused kernel
60-80 ms at about 6 GiB)."""

from __future__ import annotations

import pytest
import torch

from conftest import record
from memory import peaks
from providers import DEVICE, SMOKE, prepare, providers, shape_cases, synchronize
from torch_pallas.ops import token_log_probs as op

TEMPERATURE = 0.7
ENTROPY_BONUS = 0.01

if SMOKE:
    SHAPES, DTYPES = [(37, 16, 100)], [torch.float32]
elif DEVICE.type == "cuda":
    SHAPES, DTYPES = [(8192, 4096, 151936)], [torch.bfloat16]
else:
    SHAPES, DTYPES = [(4096, 1024, 32000), (4096, 1024, 151936)], [torch.float32, torch.bfloat16]

CASES, IDS = shape_cases(SHAPES, (64, 32, 300))
ROUNDS = 1 if SMOKE else 3


def inputs(shape, dtype, seed=0):
    tokens, hidden, vocab = shape
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator) * hidden**-0.5
    w = torch.randn(vocab, hidden, generator=generator)
    target = torch.randint(0, vocab, (tokens,), generator=generator)
    weights = torch.randn(tokens, generator=generator)  # a policy gradient's, per token
    return (x.to(DEVICE, dtype).requires_grad_(), w.to(DEVICE, dtype).requires_grad_(),
            target.to(DEVICE), weights.to(DEVICE))


def step_of(provider, x, w, target, weights):
    """One forward+backward by `provider`: (log-probs, entropy, d_input,
    d_weight) of the loss -sum(weights * log_probs) - bonus * sum(entropy)."""
    forward = prepare(provider, "token_log_probs", (x, w, target),
                      {"temperature": TEMPERATURE, "return_entropy": True})

    def step():
        log_probs, entropy = forward()
        loss = -(weights * log_probs).sum() - ENTROPY_BONUS * entropy.sum()
        grads = torch.autograd.grad(loss, (x, w))
        synchronize()
        return log_probs, entropy, *grads

    return step


def workload(provider_name: str, shape: list, dtype: str):
    """A step for bench/memory.py's fresh process."""
    provider = next(p for p in providers() if p.name == provider_name)
    return step_of(provider, *inputs(tuple(shape), getattr(torch, dtype)))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("provider,shape", CASES, ids=IDS)
def test_token_log_probs_forward_backward(benchmark, provider, shape, dtype):
    x, w, target, weights = inputs(shape, dtype)
    benchmark.group = (f"token_log_probs_fwd_bwd {'x'.join(map(str, shape))} "
                       f"{str(dtype).removeprefix('torch.')}")
    log_probs, entropy, dx, dw = benchmark.pedantic(
        step_of(provider, x, w, target, weights), rounds=ROUNDS, iterations=1, warmup_rounds=1)
    ref_log_probs, ref_entropy = op.reference(x, w, target, temperature=TEMPERATURE)
    for found, ref in ((log_probs, ref_log_probs), (entropy, ref_entropy)):
        bound = op.error_bound(x, w, ref, TEMPERATURE) * 4
        assert ((found.double().cpu() - ref).abs() <= bound).all()
    assert dx.isfinite().all() and dw.isfinite().all()
    record(benchmark, provider, op="token_log_probs_fwd_bwd", dtype=dtype, shape=shape,
           work=6.0 * x.shape[0] * x.shape[1] * w.shape[0], unit="GFLOP/s")
    if not (provider.simulated or SMOKE):
        (benchmark.extra_info["peak_bytes"],) = peaks(
            "bench_token_log_probs:workload",
            [(provider.name, list(shape), str(dtype).removeprefix("torch."))], device=DEVICE)
