"""JAX programs of several TPU kernels, as the JAX forms (torch_pallas.jax)
make them, compiled for an abstract TPU v5e or v6e with libtpu's
compile-only client: no chip needed.

tests/tpu_builds.py compiles each kernel build alone, one `jax.jit` each.
Under one jit XLA also fuses a kernel's call with what is around it, and
that fusion can compile differently: in a `lax.scan` that stacks a kernel's
outputs, XLA fused the call with the dynamic-update-slice writing its
output and compiled the fusion under its own 16 MiB of scoped VMEM, not the
limit the kernel asked Mosaic for (chip.kernel; libtpu 0.0.42). The
chunked linear_cross_entropy failed so at every realistic vocabulary while
each of its kernels compiled alone. Here: that loss, and the kernels that
ask for a VMEM limit (matmul, grouped_mm, attention's backward) inside a
scan over layers, forward and backward, bfloat16. And the loss's memory
against the unfused loss's (XLA's analysis of each compiled program, beyond
its arguments): a padded copy of the 1 GiB weight once doubled it; likewise
token_log_probs (both outputs, forward and backward, at Qwen's vocabulary)
against XLA's unfused twin (MEMORY_GOALS: each pair's bound).

    python tests/tpu_programs.py [--chips v5e,v6e] [--tier default|all]

prints {chip: {program: "ok" or the error's first lines, "memory": {program:
bytes}}} as JSON on stdout (libtpu's settings, as tests/tpu_builds.py: set
before JAX starts).
"""

from __future__ import annotations

import tpu_builds

LAYERS = 2  # a scan over stacked weights, its outputs stacked
# (fused loss, the unfused loss) on the same inputs: their memory compared
UNFUSED_PAIR = ("linear_cross_entropy 8192 tokens x 4096, V 128256",
                "the unfused loss (bfloat16 logits, float32 log-softmax), the same")


# token_log_probs (GRPO's per-token log-probs at a temperature and the entropy)
# against XLA's unfused twin on the same inputs: the goal is at most
# 0.3x its memory on v5e
TEMPERATURE, ENTROPY_BONUS = 0.7, 0.01
LOG_PROBS_PAIR = ("token_log_probs 8192 tokens x 4096, V 151936",
                  "the unfused log-probs and entropy (logits / T, log_softmax, gather), the same")
# The copy the TPU matmul makes of an operand whose dimension no block
# divides, padded to whole blocks: Qwen's 151936 x 4096 bfloat16 head (V =
# 128 x 1187, a prime), 1.2 GiB, in the products over the vocabulary. A
# known defect of the matmul (its N and K are padded outside the kernel; a
# partial last block and a masked K tail would need no copy), allowed for
# by name until it is fixed: the pair's goal counts the rest.
PADDED_HEAD_BYTES = 151936 * 4096 * 2
# each pair's fused program's memory at most this share of its twin's, plus
# the bytes allowed for a known copy
MEMORY_GOALS = {UNFUSED_PAIR: (0.25, 0), LOG_PROBS_PAIR: (0.3, PADDED_HEAD_BYTES)}


def log_probs_loss(log_probs, entropy, weights):
    """A policy-gradient loss of the per-token log-probs and entropies: the
    log-probs weighted by each token's advantage, with an entropy bonus."""
    return -(weights * log_probs).sum() - ENTROPY_BONUS * entropy.sum()


def fused_log_probs_loss(x, w, t, weights):
    import torch_pallas.jax as tpj

    return log_probs_loss(*tpj.token_log_probs(x, w, t, temperature=TEMPERATURE,
                                               return_entropy=True), weights)


def unfused_log_probs_loss(x, w, t, weights):
    """The loss as a trainer computes it without the fused op (TRL's
    selective_log_softmax and entropy_from_logits): the whole logits over
    the temperature, in float32."""
    import jax
    import jax.numpy as jnp

    z = jnp.dot(x, w.T).astype(jnp.float32) / TEMPERATURE
    log_p = jax.nn.log_softmax(z, -1)
    log_probs = jnp.take_along_axis(log_p, t[:, None], 1)[:, 0]
    entropy = -(jnp.exp(log_p) * log_p).sum(-1)
    return log_probs_loss(log_probs, entropy, weights)


def unfused_loss(x, w, t):
    """The loss as a model computes it without the fused op."""
    import jax
    import jax.numpy as jnp

    z = jnp.dot(x, w.T).astype(jnp.float32)
    return jnp.mean(jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, t[:, None], 1)[:, 0])


def _scan_layers(layer):
    """sum over LAYERS of layer(x, weights[i]), each layer's output stacked
    by a lax.scan, as a function of (x, weights) to differentiate."""
    import jax

    def program(x, weights):
        _, outs = jax.lax.scan(lambda carry, w: (carry, layer(x, w)), None, weights)
        return outs.astype("float32").sum()

    return program


# Each program's cover is in another of the default run's: the V 32000 loss's
# in the V 128256 one's (the same kernels, its chunks in a scan), the
# matmul's in both losses' products (compiling each: 11-15 s).
EXHAUSTIVE_ONLY = ("linear_cross_entropy 4096 tokens x 4096, V 32000",
                   "matmul 4096 x 4096 x 4096 in a scan of 2 layers")


def programs(tier: str = "all"):
    """name -> (function to value_and_grad in its first two arguments, its
    arguments as (shape, dtype)); the `default` tier without
    EXHAUSTIVE_ONLY."""
    import jax.numpy as jnp

    import torch_pallas.jax as tpj

    bf16, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    tokens, hidden = 4096, 4096
    ends = jnp.asarray([300, 1100, 1500, 2300, 2301, 3000, 3700, 4096], i32)

    def loss(vocab, rows=tokens):
        return [((rows, hidden), bf16), ((vocab, hidden), bf16), ((rows,), i32)]

    every = {
        # 4 chunks of 1024 rows in a scan; d_input's product (1024 x 32000 @
        # 32000 x 4096) in blocks of 1024 x 1024 x 3200, 29 MiB
        f"linear_cross_entropy {tokens} tokens x {hidden}, V 32000": (
            lambda x, w, t: tpj.linear_cross_entropy(x, w, t), loss(32000)),
        # Llama 3's vocabulary, 8192 tokens: 16 chunks of 512 rows
        UNFUSED_PAIR[0]: (lambda x, w, t: tpj.linear_cross_entropy(x, w, t), loss(128256, 8192)),
        UNFUSED_PAIR[1]: (unfused_loss, loss(128256, 8192)),
        # Qwen's vocabulary, 8192 tokens (32 chunks of 256 rows), both
        # outputs; per-token weights (advantages) as a fourth argument
        LOG_PROBS_PAIR[0]: (fused_log_probs_loss, [*loss(151936, 8192), ((8192,), f32)]),
        LOG_PROBS_PAIR[1]: (unfused_log_probs_loss, [*loss(151936, 8192), ((8192,), f32)]),
        f"matmul {tokens} x {hidden} x {hidden} in a scan of {LAYERS} layers": (
            _scan_layers(tpj.matmul),
            [((tokens, hidden), bf16), ((LAYERS, hidden, hidden), bf16)]),
        f"grouped_mm {tokens} x {hidden} x 1792, 8 groups, in a scan of {LAYERS} layers": (
            _scan_layers(lambda x, w: tpj.grouped_mm(x, w, ends)),
            [((tokens, hidden), bf16), ((LAYERS, 8, hidden, 1792), bf16)]),
        f"attention causal B1 H8 L8192 D128 in a scan of {LAYERS} layers": (
            _scan_layers(lambda q, kv: tpj.attention(q, kv[0], kv[1], is_causal=True)),
            [((1, 8, 8192, 128), bf16), ((LAYERS, 2, 1, 8, 8192, 128), bf16)]),
        # a tokenizer's padding mask, traced: the batch as packed sequences
        "attention causal, padded batch B4 H8 L2048 D128 (padding_mask traced)": (
            lambda q, kv, mask: tpj.attention(q, kv[0], kv[1], is_causal=True,
                                              padding_mask=mask).astype("float32").sum(),
            [((4, 8, 2048, 128), bf16), ((2, 4, 8, 2048, 128), bf16), ((4, 2048), jnp.bool_)]),
    }
    assert set(EXHAUSTIVE_ONLY) <= set(every)
    return {name: program for name, program in every.items()
            if tier == "all" or name not in EXHAUSTIVE_ONLY}


def report(chips, tier: str = "all") -> dict:
    import jax

    from torch_pallas.jax import calls

    results = {}
    for chip in chips:
        device = tpu_builds.abstract_device(chip)
        sharding = jax.sharding.SingleDeviceSharding(device)
        results[chip] = {"memory": {}}
        for name, (function, args) in programs(tier).items():
            shapes = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in args]
            grad = jax.value_and_grad(function, (0, 1))
            try:
                with jax.default_device(device), calls.building_for_tpu(device):
                    memory = jax.jit(grad).lower(*shapes).compile().memory_analysis()
                results[chip][name] = "ok"
                results[chip]["memory"][name] = (memory.temp_size_in_bytes
                                                 + memory.output_size_in_bytes)
            except Exception as e:  # noqa: BLE001 (each program's error, reported)
                results[chip][name] = f"{type(e).__name__}: {str(e)[:600]}"
    return results


def main(argv=None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chips", default="v5e,v6e")
    parser.add_argument("--tier", default="all", choices=("default", "all"))
    args = parser.parse_args(argv)
    tpu_builds.print_json_alone("tpu_programs", lambda: report(
        [c for c in args.chips.split(",") if c], args.tier))


if __name__ == "__main__":
    main()
