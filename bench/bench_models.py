"""A transformers Llama converted with `torch_pallas.nn.replace_linear`
against the same model unconverted, in one run: a training step, the first
pass over a batch of changing lengths (every new length builds kernels:
torch_pallas.runtime.shape_buckets bounds how many) and `generate` with the KV
cache. Throughput in tokens/s and the ratio to torch. And a training step of
the model patched by `torch_pallas.transformers.apply` (norms, rotary
embeddings, SwiGLU, Linear layers, attention, and the LM head with its loss
fused) against the unpatched one at vocabulary 32000, with each step's peak
memory (bench/memory.py: a fresh process's peak resident set on the CPU,
torch's allocator's peak on a GPU) in the JSON as `peak_bytes` (and
`peak_vs_torch`). And the same for a mixture of experts, Qwen3-MoE and
Mixtral (8 experts, top-2, expert width 768, hidden 512, 2 layers): a
training step on transformers' default experts against apply()'s.

The two models are timed side by side, round by round: each round of the
converted model follows one round of the unconverted one, timed too (the
`Partner` below), so that both see the same machine. The converted model's
`ratio_to_torch` is the partner's median over its median from those
alternating rounds, and `ratio_to_torch_paired` the median of the rounds'
own ratios (each round against the torch round before it: on a machine
whose speed swings for seconds at a time, the steadier of the two); the
torch provider's own row times the unconverted model alone, as every
suite's torch row does (its ratio to the converted model's
is `ratio_to_torch_separate`, which moves with the load between the two
tests on a shared machine).

CPU: vocabulary 4096, hidden 512, 2 layers, 8 heads (4 key/value heads),
intermediate 1376; training batch 4 x 256 tokens, in float32 and with the
models in bfloat16, and in float32 at hidden 1024 (16 heads, 8 key/value
heads, intermediate 2752); the patched step in float32 at vocabulary
32000; the changing lengths
are 100, 110, ..., 190 tokens at batch 4, each compile cache cleared
before a round: a fresh process's first pass, in-process, with an empty
disk cache (the first process) or one an earlier pass filled (the next
process); `generate` 32
tokens greedily from a 16-token prompt at batch 1.

    OMP_WAIT_POLICY=PASSIVE pytest bench/bench_models.py --benchmark-only -n 0
"""

from __future__ import annotations

import copy
import functools
import os
import statistics
import time
from pathlib import Path

import pytest
import torch
import transformers  # a test dependency (the [test] extra)

import memory
import torch_pallas.transformers
from conftest import record
from providers import DEVICE, SMOKE
from torch_pallas.nn import replace_linear
from torch_pallas.runtime import backends, compile_cache, disk_cache, shape_buckets


if SMOKE:
    CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)
    WIDE = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    TRAIN, LENGTHS, BATCH, PROMPT, NEW_TOKENS = (1, 8), (5, 7), 1, 4, 2
    ROUNDS = {"step": 1, "lengths": 1, "generate": 1}
else:
    CONFIG = dict(vocab_size=4096, hidden_size=512, intermediate_size=1376, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4)
    WIDE = dict(hidden_size=1024, intermediate_size=2752, num_attention_heads=16,
                num_key_value_heads=8)
    TRAIN, LENGTHS, BATCH, PROMPT, NEW_TOKENS = (4, 256), tuple(range(100, 200, 10)), 4, 16, 32
    ROUNDS = {"step": 7, "lengths": 5, "generate": 9}

BACKEND = backends.default_for(DEVICE).name  # what the converted model's matmuls run on
PROVIDERS = ("torch", f"pallas[{BACKEND}]")  # the unconverted model, the converted one


def build_models(**overrides):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**CONFIG, **overrides}, max_position_embeddings=512,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).to(DEVICE)
    return {"torch": model, PROVIDERS[1]: replace_linear(copy.deepcopy(model))}


MODELS = build_models()


class Partner:
    """The unconverted model's call, run and timed before each round of the
    converted one (a `benchmark.pedantic` setup): the two alternate, so a
    change in the machine's load moves both."""

    def __init__(self, call, then=None):
        self.call, self.then, self.times = call, then, []

    def __call__(self):
        start = time.perf_counter()
        self.call()
        self.times.append(time.perf_counter() - start)
        if self.then is not None:
            self.then()


def timed(benchmark, provider, function, *, rounds, partner_call, setup=None):
    """`function()` timed by pytest-benchmark over `rounds` rounds after a
    warm-up (`setup` before each): for the converted model, each round
    after one timed round of `partner_call()`, the unconverted model's."""
    if provider == "torch":
        return benchmark.pedantic(function, setup=setup, rounds=rounds, iterations=1,
                                  warmup_rounds=0 if setup else 1)
    partner = Partner(partner_call, then=setup)
    if setup is None:  # warm both (a round with a setup starts afresh anyway)
        partner_call(), function()
    result = benchmark.pedantic(function, setup=partner, rounds=rounds, iterations=1)
    if benchmark.stats is None:  # --benchmark-disable: run once, nothing timed
        return result
    benchmark.extra_info["torch_median_interleaved"] = statistics.median(partner.times)
    # Each round against the torch round just before it: the median of
    # those paired ratios (speed, torch's time over this one's) follows the
    # machine's slow and fast spells less than the ratio of the medians.
    own = benchmark.stats.stats.data
    benchmark.extra_info["torch_rounds_interleaved"] = list(partner.times)
    benchmark.extra_info["ratio_to_torch_paired"] = statistics.median(
        t / c for t, c in zip(partner.times, own))
    return result


class Provider:  # what conftest.record reads
    def __init__(self, name):
        self.name = name
        self.backend = None if name == "torch" else BACKEND


def train_step(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    for p in model.parameters():
        p.grad = None
    return loss.detach()


@functools.cache
def models_in(dtype: torch.dtype, wide: bool = False) -> dict:
    """The two models with their parameters in `dtype`, at hidden 512 (or
    WIDE's sizes): made once."""
    if wide:
        return {name: model.to(dtype) for name, model in build_models(**WIDE).items()}
    if dtype == torch.float32:
        return MODELS
    return {name: copy.deepcopy(model).to(dtype) for name, model in MODELS.items()}


# bfloat16: the 16-bit GEMMs (on CPU, oneDNN's through XLA; kernels/tpu/matmul.py).
# Its loss is compared within bfloat16's rounding of the two models' sums.
STEP_DTYPES = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# (dtype, wide): the float32 step at both widths, the bfloat16 one at hidden 512.
STEPS = [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)]


@pytest.mark.parametrize(("dtype", "wide"), STEPS, ids=lambda v: (
    str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else ("wide" if v else "h")))
@pytest.mark.parametrize("provider", PROVIDERS)
def test_training_step(benchmark, provider, dtype, wide):
    models = models_in(dtype, wide)
    hidden = (WIDE if wide else CONFIG)["hidden_size"]
    ids = torch.randint(0, CONFIG["vocab_size"], TRAIN, device=DEVICE)
    benchmark.group = f"llama train step {TRAIN[0]}x{TRAIN[1]} h={hidden}" + (
        "" if dtype == torch.float32 else f" {str(dtype).removeprefix('torch.')}")
    loss = timed(benchmark, provider, lambda: train_step(models[provider], ids),
                 rounds=ROUNDS["step"], partner_call=lambda: train_step(models["torch"], ids))
    expected = train_step(models["torch"], ids)
    tolerance = STEP_DTYPES[dtype]
    torch.testing.assert_close(loss, expected, rtol=tolerance, atol=tolerance)
    record(benchmark, Provider(provider), op="llama_train_step", dtype=dtype,
           shape=(*TRAIN, hidden), work=TRAIN[0] * TRAIN[1], unit="tokens/s")


# The patched step: every kind `apply` knows, the LM head's logits never
# held (at vocabulary 32000 they are the step's largest tensors).
PATCHED_VOCAB = CONFIG["vocab_size"] if SMOKE else 32000


def patched_model(provider: str):
    """The Llama at PATCHED_VOCAB, unpatched ("torch") or patched by
    torch_pallas.transformers.apply, in training mode."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**CONFIG, "vocab_size": PATCHED_VOCAB},
                                      max_position_embeddings=512, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).to(DEVICE).train()
    if provider != "torch":
        torch_pallas.transformers.apply(model)
    return model


@functools.cache
def patched_models() -> dict:
    return {name: patched_model(name) for name in PROVIDERS}


def patched_step_ids():
    generator = torch.Generator().manual_seed(2)
    return torch.randint(0, PATCHED_VOCAB, TRAIN, generator=generator).to(DEVICE)


def patched_training_step(provider: str):
    """A training step of `provider`'s model: what bench/memory.py measures
    (on the CPU in a fresh process, which imports this module)."""
    model, ids = patched_model(provider), patched_step_ids()
    return lambda: train_step(model, ids)


@pytest.mark.parametrize("provider", PROVIDERS)
def test_patched_training_step(benchmark, provider):
    models, ids = patched_models(), patched_step_ids()
    benchmark.group = f"llama train step {TRAIN[0]}x{TRAIN[1]} vocab {PATCHED_VOCAB}, apply()"
    loss = timed(benchmark, provider, lambda: train_step(models[provider], ids),
                 rounds=ROUNDS["step"], partner_call=lambda: train_step(models["torch"], ids))
    torch.testing.assert_close(loss, train_step(models["torch"], ids), rtol=1e-4, atol=1e-4)
    # The smoke run leaves out the fresh processes (some 15 s each): at its
    # sizes the figure says nothing.
    benchmark.extra_info["peak_bytes"] = None if SMOKE else memory.peak_bytes(
        "bench_models:patched_training_step", provider, device=DEVICE)
    record(benchmark, Provider(provider), op="llama_patched_train_step", dtype=torch.float32,
           shape=(*TRAIN, CONFIG["hidden_size"]), work=TRAIN[0] * TRAIN[1], unit="tokens/s")


def first_pass_of_lengths(model):
    losses = []
    for length in LENGTHS:
        ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, length),
                            generator=torch.Generator().manual_seed(length))
        losses.append(train_step(model, ids.to(DEVICE)))
    return torch.stack(losses)


def fresh_process(disk: Path):
    """What a process starts with: no kernel built, no size seen, and the
    kernels on disk in `disk` (an empty directory: the first process ever)."""
    def setup():
        os.environ[disk_cache.ENV_VAR] = str(disk)
        compile_cache.clear()
        shape_buckets.reset()

    return setup


# The smoke run (tests/test_bench.py) times the first process only: the
# next one runs the same code with the kernels loaded from disk.
@pytest.mark.parametrize("process", ["first"] if SMOKE else ["first", "next"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_changing_lengths_first_pass(benchmark, provider, process, tmp_path, monkeypatch):
    """The first pass over the lengths in a process: the first process on
    the machine (every kernel built), or a next one (the first one's kernels
    on disk)."""
    monkeypatch.setenv(disk_cache.ENV_VAR, str(tmp_path))
    model = MODELS[provider]
    rounds = ROUNDS["lengths"]
    if process == "first":
        disks = iter([tmp_path / f"empty{i}" for i in range(rounds + 1)])
        setup = lambda: fresh_process(next(disks))()  # noqa: E731
    else:
        fresh_process(tmp_path / "warm")()
        first_pass_of_lengths(model)  # an earlier process fills the disk cache
        setup = fresh_process(tmp_path / "warm")
    benchmark.group = f"llama {process} process, lengths {LENGTHS[0]}..{LENGTHS[-1]} x{BATCH}"
    losses = timed(benchmark, provider, lambda: first_pass_of_lengths(model), rounds=rounds,
                   partner_call=lambda: first_pass_of_lengths(MODELS["torch"]), setup=setup)
    torch.testing.assert_close(losses, first_pass_of_lengths(MODELS["torch"]),
                               rtol=1e-4, atol=1e-4)
    record(benchmark, Provider(provider), op=f"llama_lengths_{process}_process",
           dtype=torch.float32, shape=(BATCH, len(LENGTHS)), work=BATCH * sum(LENGTHS),
           unit="tokens/s")


@pytest.mark.parametrize("provider", PROVIDERS)
def test_generate_with_kv_cache(benchmark, provider):
    model = MODELS[provider]
    prompt = torch.randint(0, CONFIG["vocab_size"], (1, PROMPT),
                           generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def generate(model=model):
        with torch.no_grad():
            return model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False, use_cache=True, pad_token_id=0)

    benchmark.group = f"llama generate {NEW_TOKENS} tokens"
    tokens = timed(benchmark, provider, generate, rounds=ROUNDS["generate"],
                   partner_call=lambda: generate(MODELS["torch"]))
    assert tokens.shape == (1, PROMPT + NEW_TOKENS)
    record(benchmark, Provider(provider), op="llama_generate", dtype=torch.float32,
           shape=(1, NEW_TOKENS), work=NEW_TOKENS, unit="tokens/s")


# --- a mixture of experts: transformers' default experts against apply() --
# Qwen3-MoE and Mixtral from configs, their experts on transformers' default
# ("grouped_mm": F.grouped_mm) against the model patched by apply() (experts
# on pallas::grouped_mm and pallas::swiglu, norms, attention and the rest).
if SMOKE:
    MOE = dict(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, width=24)
else:
    MOE = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, width=768)
MOE_FAMILIES = ("qwen3_moe", "mixtral")


def moe_config(family: str):
    shared = {k: v for k, v in MOE.items() if k not in ("num_experts", "width")}
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**shared, num_experts=MOE["num_experts"],
                                           moe_intermediate_size=MOE["width"],
                                           max_position_embeddings=512)
    return transformers.MixtralConfig(**shared, num_local_experts=MOE["num_experts"],
                                      intermediate_size=MOE["width"], max_position_embeddings=512)


def moe_model(family: str, provider: str):
    """`family` from its config in training mode: transformers' default
    experts ("torch") or patched by torch_pallas.transformers.apply."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(family)).to(DEVICE).train()
    if provider != "torch":
        torch_pallas.transformers.apply(model)
    return model


@functools.cache
def moe_models(family: str) -> dict:
    return {name: moe_model(family, name) for name in PROVIDERS}


def moe_step_ids():
    generator = torch.Generator().manual_seed(3)
    return torch.randint(0, MOE["vocab_size"], TRAIN, generator=generator).to(DEVICE)


def moe_training_step(family: str, provider: str):
    """A training step of `family` by `provider` (bench/memory.py's workload)."""
    model, ids = moe_model(family, provider), moe_step_ids()
    return lambda: train_step(model, ids)


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_moe_training_step(benchmark, provider, family):
    models, ids = moe_models(family), moe_step_ids()
    benchmark.group = f"{family} train step {TRAIN[0]}x{TRAIN[1]}, apply()"
    loss = timed(benchmark, provider, lambda: train_step(models[provider], ids),
                 rounds=ROUNDS["step"], partner_call=lambda: train_step(models["torch"], ids))
    torch.testing.assert_close(loss, train_step(models["torch"], ids), rtol=1e-4, atol=1e-4)
    benchmark.extra_info["peak_bytes"] = None if SMOKE else memory.peak_bytes(
        "bench_models:moe_training_step", family, provider, device=DEVICE)
    record(benchmark, Provider(provider), op=f"{family}_train_step", dtype=torch.float32,
           shape=(*TRAIN, MOE["hidden_size"]), work=TRAIN[0] * TRAIN[1], unit="tokens/s")
