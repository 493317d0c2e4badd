"""bench/tpu_check.py: the TPU kernels against JAX's own on a TPU chip.

Each case is a torch call of an op (forward, then backward) whose kernel
calls are recorded without running them (`record`): their inputs, static
parameters and the config the `tpu` backend picks. Each recorded kernel is
then compiled for the chip and timed alone on device arrays (no host
copies), against XLA's or JAX's own kernel for the same work (`jnp.dot`,
splash attention, megablox `gmm`/`tgmm`, `jax.lax.ragged_dot`, the fused
jnp expression), in interleaved rounds, medians; and one call through CPU
torch tensors (`torch_pallas.backend("tpu")`) with its copies.

    python bench/tpu_check.py --out results/      # on a TPU machine
    python bench/tpu_check.py --compile-only      # anywhere with libtpu: every
                                                  # case compiled for an abstract v5e

Writes tpu_check.json and tpu_check.md (the speed table with each ratio
against its goal) under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
import time

COMPILE_ONLY = "--compile-only" in sys.argv
if COMPILE_ONLY:  # libtpu's compile-only client on a CPU machine (notes in docs/tpu.md)
    os.environ.update(JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
                      TPU_ACCELERATOR_TYPE="v5litepod-1", TPU_WORKER_HOSTNAMES="localhost")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import torch_pallas  # noqa: E402
import torch_pallas.jax as tpj  # noqa: E402
from torch_pallas.jax import calls  # noqa: E402
from torch_pallas.kernels.shapes import fitted_block  # noqa: E402
from torch_pallas.runtime import bridge, registry  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import tpu_builds  # noqa: E402  (the kernel calls of an op, recorded: tests/tpu_builds.py)

ROUNDS = 10


def chip():
    if COMPILE_ONLY:
        from jax.experimental import topologies

        return topologies.get_topology_desc(
            topology_name="v5e:1x1", platform="tpu", chip_config_name="default",
            chips_per_host_bounds=(1, 1, 1), num_slices=1, wrap=(False, False, False)).devices[0]
    return jax.devices("tpu")[0]


DEVICE = chip()


# --- the kernels an op call makes, recorded ------------------------------------------

def _kernel(build, config=None):
    """The build's TPU kernel as the `tpu` backend builds it for the chip
    (or with `config`): a function of JAX arrays."""
    function = tpu_builds.entry(build, DEVICE)
    return function if config is None else functools.partial(function, config=config)


def record(call) -> list[dict]:
    """The kernel calls `call()` makes, in order, each {op, avals, params,
    inputs (NumPy), config, build}, run on nothing (tests/tpu_builds.py's
    Recorder: each returns zeros of its outputs' shapes, so a backward can
    follow)."""
    with tpu_builds.Recorder(keep_inputs=True) as recorder:
        call()
    return [dict(op=build.kernel, avals=build.avals, params=build.params, inputs=inputs,
                 config=_kernel(build).keywords["config"], build=build)
            for build, inputs in recorder.calls]


# --- timing -------------------------------------------------------------------------

def _compiled(function, args):
    sharding = jax.sharding.SingleDeviceSharding(DEVICE)
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    # without a chip, the JAX-side forms build the `tpu` kernels for it too
    building = calls.building_for_tpu(DEVICE) if COMPILE_ONLY else contextlib.nullcontext()
    with jax.default_device(DEVICE), building:
        return jax.jit(function).lower(*shapes).compile()


def _on_chip(args):
    return [jax.device_put(a, DEVICE) for a in args]


MEMORY = {}  # each compiled function's XLA memory analysis, by name (the last compare's)
REPEATS = 5  # calls dispatched back to back per timing: the host's dispatch overlaps them


def compare(functions: dict, args: dict, *, skip_failures: bool = False) -> dict:
    """Each function compiled for the chip; on a chip, the median seconds of
    one call over ROUNDS interleaved rounds, each round REPEATS calls in a
    row (a call's dispatch, ~0.5 ms on this machine, overlaps the previous
    call's run, as in a model's step). None: compile-only. With
    `skip_failures`, a function that fails to compile gets its error's
    first line instead of a time."""
    compiled, failed = {}, {}
    for name, f in functions.items():
        try:
            compiled[name] = _compiled(f, args[name])
            MEMORY[name] = compiled[name].memory_analysis()
        except Exception as e:
            if not skip_failures:
                raise
            failed[name] = str(e).splitlines()[0][:160]
    if COMPILE_ONLY:
        return {**{name: None for name in compiled}, **failed}
    placed = {name: _on_chip(args[name]) for name in compiled}
    for name, f in compiled.items():
        jax.block_until_ready(f(*placed[name]))  # warm
    times = {name: [] for name in compiled}
    for _ in range(ROUNDS):
        for name, f in compiled.items():
            start = time.perf_counter()
            for _ in range(REPEATS - 1):
                f(*placed[name])
            jax.block_until_ready(f(*placed[name]))
            times[name].append((time.perf_counter() - start) / REPEATS)
    return {**{name: statistics.median(t) for name, t in times.items()}, **failed}


def ours(calls) -> tuple[dict, dict]:
    """(functions, args) of recorded kernel calls, each named by its op and
    position (a backward's kernels follow its forward's)."""
    functions, args = {}, {}
    for i, call in enumerate(calls):
        functions[f"{i}:{call['op']}"] = _kernel(call["build"])
        args[f"{i}:{call['op']}"] = call["inputs"]
    return functions, args


def forward_and_backward(calls) -> tuple[list, list]:
    """Recorded calls of a forward and its backward, split at the first
    backward kernel."""
    first = next(i for i, c in enumerate(calls) if c["op"].endswith("backward"))
    return calls[:first], calls[first:]


# --- the cases ----------------------------------------------------------------------

RESULTS = []


def row(case: str, ours_s, theirs: dict, *, work: float, unit: str, goal: str):
    """One line of the table: our time, each reference's, and the ratio
    (theirs / ours: > 1 means ours is faster)."""
    entry = dict(case=case, ours_ms=None if ours_s is None else ours_s * 1e3, goal=goal,
                 references={})
    for name, t in theirs.items():
        entry["references"][name] = dict(
            ms=None if t is None else t * 1e3,
            ratio=None if (t is None or ours_s is None) else t / ours_s)
    if ours_s is not None and work:
        entry[unit] = work / ours_s / (1e12 if unit == "TFLOP/s" else 1e9)
    RESULTS.append(entry)
    print(json.dumps(entry), flush=True)


def rand(*shape, dtype=torch.bfloat16, grad=False):
    return torch.randn(*shape).to(dtype).requires_grad_(grad)


def matmul_case(n: int, dtype: torch.dtype):
    a, b = rand(n, n, dtype=dtype), rand(n, n, dtype=dtype)
    calls = record(lambda: torch_pallas.matmul(a, b))
    (call,) = calls
    functions, args = ours(calls)
    precision = jax.lax.Precision.HIGHEST if dtype == torch.float32 else None
    functions["jnp.dot"] = functools.partial(jnp.dot, precision=precision)
    args["jnp.dot"] = [x.reshape(x.shape[-2:]) for x in call["inputs"]]
    t = compare(functions, args)
    mine = t.pop(next(iter(functions)))
    row(f"matmul {str(dtype).removeprefix('torch.')} {n}^3 ({call['config']})", mine, t,
        work=2.0 * n ** 3, unit="TFLOP/s", goal=">= 1.0x jnp.dot")


def _splash_heads(mask, heads, blocks, compute=None, fused=False):
    """Splash attention over `heads` heads of `mask` (one head's
    splash_attention_mask) at (query, key) blocks, its forward taking
    `compute` keys at a time (all of a block: None), its backward one fused
    kernel (dq with dk and dv) or two: a function of (H, L, D) arrays."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    sizes = sk.BlockSizes(block_q=blocks[0], block_kv=blocks[1],
                          block_kv_compute=compute or blocks[1], block_q_dkv=blocks[0],
                          block_kv_dkv=blocks[1], block_kv_dkv_compute=blocks[1],
                          block_q_dq=None if fused else blocks[0],
                          block_kv_dq=None if fused else blocks[1], use_fused_bwd_kernel=fused)
    return sk.make_splash_mha(sm.MultiHeadMask([mask] * heads), block_sizes=sizes,
                              head_shards=1, q_seq_shards=1)


def _splash(batch, heads, length, blocks, compute=None, fused=False):
    """Causal splash attention (_splash_heads) of (B, H, L, D) arrays."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    return jax.vmap(_splash_heads(sm.CausalMask((length, length)), heads, blocks, compute,
                                  fused))


# splash's fastest on v5e (2026-12-06, B2 H16 L4096): 1024 x 1024 blocks,
# the forward 512 keys at a time (1.503 ms against 1.629 all at once), the
# backward fused (fwd+bwd 4.50 ms against 5.40 in two kernels)
SPLASH_FASTEST = dict(blocks=(1024, 1024), compute=512, fused=True)


def attention_case(batch: int, heads: int, length: int, dim: int = 128):
    q, k, v = (rand(batch, heads, length, dim, grad=True) for _ in range(3))
    scale = dim ** -0.5

    def step():
        out = torch_pallas.attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))

    forward, backward = forward_and_backward(record(step))
    f_fns, f_args = ours(forward)
    b_fns, b_args = ours(backward)
    qs = [np.asarray(bridge.to_kernel_argument(t.detach())) for t in (q, k, v)]
    refs, ref_args = {}, {}
    for blocks, compute, fused in (((512, 512), None, False), ((1024, 512), None, False),
                                   ((512, 1024), None, False), ((1024, 1024), None, False),
                                   tuple(SPLASH_FASTEST.values())):
        splash = _splash(batch, heads, length, blocks, compute, fused)
        label = f"splash {blocks}" + (f" compute {compute}" if compute else "") + (
            " fused bwd" if fused else "")
        refs[label] = lambda q, k, v, s=splash: s(q * scale, k, v)
        refs[f"{label} fwd+bwd"] = jax.grad(
            lambda q, k, v, s=splash: s(q * scale, k, v).astype(jnp.float32).sum(),
            argnums=(0, 1, 2))
    layout = [x.transpose(0, 2, 1, 3) for x in qs]  # (B, L, H, D)
    refs["xla"] = functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                    implementation="xla")
    refs["xla fwd+bwd"] = jax.grad(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                     implementation="xla")
        .astype(jnp.float32).sum(), argnums=(0, 1, 2))
    # the JAX-side form (torch_pallas.jax) of the same op: the same kernels
    # under one jax.jit, its gradient through the backward kernels
    refs["torch_pallas.jax"] = lambda q, k, v: tpj.attention(q, k, v, is_causal=True)
    refs["torch_pallas.jax fwd+bwd"] = jax.grad(
        lambda q, k, v: tpj.attention(q, k, v, is_causal=True).astype(jnp.float32).sum(),
        argnums=(0, 1, 2))
    for name in refs:
        ref_args[name] = layout if name.startswith("xla") else qs
    t = compare({**f_fns, **b_fns, **refs}, {**f_args, **b_args, **ref_args})
    fwd = sum(t[n] for n in f_fns) if not COMPILE_ONLY else None
    both = None if COMPILE_ONLY else fwd + sum(t[n] for n in b_fns)
    flops = 4.0 * batch * heads * length * length * dim / 2  # causal
    name = f"attention causal bf16 B{batch} H{heads} L{length} D{dim}"
    splash_f = {n: t[n] for n in refs if n.startswith("splash") and "fwd+bwd" not in n}
    splash_b = {n: t[n] for n in refs if n.startswith("splash") and "fwd+bwd" in n}
    best_f = min(splash_f, key=lambda n: splash_f[n] or 0)
    best_b = min(splash_b, key=lambda n: splash_b[n] or 0)
    row(f"{name} forward ({forward[0]['config'].block_q}x{forward[0]['config'].block_k})", fwd,
        {f"best {best_f}": t[best_f], "xla": t["xla"], "torch_pallas.jax": t["torch_pallas.jax"]},
        work=flops, unit="TFLOP/s", goal=">= 1.0x splash, >= 1.0x xla")
    row(f"{name} forward+backward", both, {f"best {best_b}": t[best_b],
                                           "xla fwd+bwd": t["xla fwd+bwd"],
                                           "torch_pallas.jax": t["torch_pallas.jax fwd+bwd"]},
        work=3.5 * flops, unit="TFLOP/s", goal=">= 1.0x splash, >= 1.0x xla")


def attention_spans_case(kind: str, heads: int = 16, length: int = 8192, dim: int = 128,
                         span: int = 1024, sequences: int = 4):
    """Attention whose rows see spans of keys, forward and forward+backward:
    a causal sliding window of `span` keys (`window_size=(span - 1, 0)`), or
    `sequences` packed causal sequences (varlen_attention); against splash
    attention at its fastest settings (attention_case) with the same mask
    (LocalMask, or segment ids)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    if kind == "window":
        q, k, v = (rand(1, heads, length, dim, grad=True) for _ in range(3))

        def call():
            return torch_pallas.attention(q, k, v, window_size=(span - 1, 0))

        one = sm.LocalMask((length, length), window_size=(span - 1, 0), offset=0)
        segments = None
        visible = sum(min(i + 1, span) for i in range(length))
    else:
        q, k, v = (rand(length, heads, dim, grad=True) for _ in range(3))  # (T, H, D)
        each = length // sequences
        cu = torch.arange(0, length + 1, each, dtype=torch.int32)

        def call():
            return torch_pallas.varlen_attention(q, k, v, cu, cu, each, each,
                                                 window_size=(-1, 0))

        one = sm.CausalMask((length, length))
        ids = jnp.arange(length, dtype=jnp.int32) // each
        segments = sk.SegmentIds(q=ids, kv=ids)
        visible = sequences * each * (each + 1) // 2

    def step():
        out = call()
        out.backward(torch.ones_like(out))

    forward, backward = forward_and_backward(record(step))
    f_fns, f_args = ours(forward)
    b_fns, b_args = ours(backward)
    heads_first = [np.asarray(bridge.to_kernel_argument(t.detach())) for t in (q, k, v)]
    heads_first = [x[0] if kind == "window" else x.transpose(1, 0, 2) for x in heads_first]
    splash = _splash_heads(one, heads, **SPLASH_FASTEST)
    scale = dim ** -0.5
    refs = {"splash": lambda q, k, v: splash(q * scale, k, v, segment_ids=segments),
            "splash fwd+bwd": jax.grad(
                lambda q, k, v: splash(q * scale, k, v, segment_ids=segments)
                .astype(jnp.float32).sum(), argnums=(0, 1, 2))}
    t = compare({**f_fns, **b_fns, **refs},
                {**f_args, **b_args, **{n: heads_first for n in refs}})
    fwd = None if COMPILE_ONLY else sum(t[n] for n in f_fns)
    both = None if COMPILE_ONLY else fwd + sum(t[n] for n in b_fns)
    flops = 4.0 * heads * visible * dim
    name = (f"attention bf16 H{heads} L{length} D{dim}, "
            + (f"causal window {span}" if kind == "window" else f"{sequences} packed causal "
               f"sequences"))
    goal = ">= 1.0x splash"
    row(f"{name}, forward", fwd, {"splash at its fastest": t["splash"]},
        work=flops, unit="TFLOP/s", goal=goal)
    row(f"{name}, forward+backward", both, {"splash at its fastest": t["splash fwd+bwd"]},
        work=3.5 * flops, unit="TFLOP/s", goal=goal)


def grouped_mm_case(rows: int, k: int, n: int, groups: int = 8):
    from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm, tgmm

    rng = np.random.default_rng(0)
    sizes = rng.multinomial(rows, rng.dirichlet(np.ones(groups)))
    offs = torch.tensor(np.cumsum(sizes), dtype=torch.int32)
    x, w = rand(rows, k, grad=True), rand(groups, k, n, grad=True)

    def step():
        y = torch_pallas.grouped_mm(x, w, offs=offs)
        y.backward(torch.ones_like(y))

    calls = record(step)
    fwd_calls, bwd_calls = calls[:1], calls[1:]
    f_fns, f_args = ours(fwd_calls)
    b_fns, b_args = ours(bwd_calls)
    xs, ws = (np.asarray(bridge.to_kernel_argument(t.detach())) for t in (x, w))
    dy = np.ones((rows, n), xs.dtype)
    group_sizes = sizes.astype(np.int32)
    refs = {}
    # megablox's tiling (tm, tk, tn): 512 x 1024 x 1024, and with N's or K's
    # 1024 cut to divide 1792 (896), as ours are
    fit = functools.partial(fitted_block, align=128)
    for label, (tk, tn) in (("1024", (1024, 1024)), ("fitted", (fit(k, 1024), fit(n, 1024)))):
        refs[f"megablox gmm {label}"] = lambda a, b, g, tk=tk, tn=tn: gmm(
            a, b, g, preferred_element_type=jnp.bfloat16, tiling=(512, tk, tn))
        refs[f"megablox gmm+tgmm bwd {label}"] = lambda a, b, g, dy, tk=tk, tn=tn: (
            gmm(dy, b, g, preferred_element_type=jnp.bfloat16, tiling=(512, tn, tk),
                transpose_rhs=True),
            tgmm(a.T, dy, g, preferred_element_type=jnp.bfloat16, tiling=(512, tk, tn)))
    refs.update({
        "ragged_dot": lambda a, b, g: jax.lax.ragged_dot(a, b, g),
        "ragged_dot bwd": lambda a, b, g, dy: jax.vjp(
            lambda a, b: jax.lax.ragged_dot(a, b, g), a, b)[1](dy),
    })
    ref_args = {name: [xs, ws, group_sizes] + ([dy] if "bwd" in name else []) for name in refs}
    t = compare({**f_fns, **b_fns, **refs}, {**f_args, **b_args, **ref_args})
    fwd = None if COMPILE_ONLY else sum(t[n] for n in f_fns)
    bwd = None if COMPILE_ONLY else sum(t[n] for n in b_fns)
    flops = 2.0 * rows * k * n
    name = f"grouped_mm bf16 {groups} groups, {rows} x {k} x {n}"
    def best(prefix):
        names = [n for n in refs if n.startswith(prefix + " ")]
        chosen = min(names, key=lambda n: t[n] or 0)
        return {f"{prefix} ({chosen.rsplit(' ', 1)[1]})": t[chosen]}

    row(f"{name} forward ({fwd_calls[0]['config']})", fwd,
        {**best("megablox gmm"), "ragged_dot": t["ragged_dot"]},
        work=flops, unit="TFLOP/s", goal=">= 1.0x megablox, >= 1.0x ragged_dot")
    row(f"{name} backward", bwd, {**best("megablox gmm+tgmm bwd"),
                                  "ragged_dot": t["ragged_dot bwd"]},
        work=2 * flops, unit="TFLOP/s", goal=">= 1.0x megablox, >= 1.0x ragged_dot")


def rows_case(name: str, call, reference, copy, arrays: list, moved_bytes: float):
    """A memory-bound op's forward kernel against its fused jnp expression
    and against `copy`, the plainest XLA program that reads and writes the
    same arrays (the chip's ceiling for those bytes: sweep_bandwidth)."""
    calls = record(call)
    f_fns, f_args = ours(calls[:1])
    jnp_args = [np.asarray(bridge.to_kernel_argument(a.detach())) for a in arrays]
    t = compare({**f_fns, "xla (jnp)": reference, "xla copy": copy},
                {**f_args, "xla (jnp)": jnp_args, "xla copy": jnp_args})
    mine = None if COMPILE_ONLY else t[next(iter(f_fns))]
    row(f"{name} ({calls[0]['config']})", mine,
        {"xla (jnp)": t["xla (jnp)"], "xla copy, the same bytes": t["xla copy"]},
        work=moved_bytes, unit="GB/s", goal=">= 85% of 819 GB/s, >= 1.0x xla")


def memory_bound_cases(n: int = 8192):
    x, w, b = rand(n, n), rand(n), rand(n)

    def rms(x, w):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)
        return (y * w.astype(jnp.float32)).astype(x.dtype)

    def layer(x, w, b):
        xf = x.astype(jnp.float32)
        mean = xf.mean(-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(((xf - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
        return (y * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)

    def swiglu(g, u):
        gf = g.astype(jnp.float32)
        return (gf * jax.nn.sigmoid(gf) * u.astype(jnp.float32)).astype(g.dtype)

    size = 2.0 * n * n  # bytes of one bf16 (n, n)

    def scaled(x, *vectors):  # reads x (the vectors are small), writes as much
        return x * 2

    rows_case(f"rms_norm bf16 {n}x{n}", lambda: torch_pallas.rms_norm(x, (n,), w, eps=1e-6),
              rms, scaled, [x, w], 2 * size)
    rows_case(f"layer_norm bf16 {n}x{n}", lambda: torch_pallas.layer_norm(x, (n,), w, b),
              layer, scaled, [x, w, b], 2 * size)
    g, u = rand(n, n), rand(n, n)
    rows_case(f"swiglu bf16 {n}x{n}", lambda: torch_pallas.swiglu(g, u), swiglu,
              lambda g, u: g + u, [g, u], 3 * size)
    heads, length, dim = 32, n // 4, 128
    q, k = rand(1, heads, length, dim), rand(1, heads, length, dim)
    cos, sin = rand(1, length, dim), rand(1, length, dim)

    def rotary(q, k, c, s):
        def rot(x):
            half = x.shape[-1] // 2
            return jnp.concatenate([-x[..., half:], x[..., :half]], -1)
        c, s = c[:, None], s[:, None]
        return ((q * c + rot(q) * s).astype(q.dtype), (k * c + rot(k) * s).astype(k.dtype))

    rows_case(f"rotary_embedding bf16 q,k (1, {heads}, {length}, {dim})",
              lambda: torch_pallas.rotary_embedding(q, k, cos, sin), rotary,
              lambda q, k, c, s: (q * 2, k * 2), [q, k, cos, sin],
              4 * 2.0 * heads * length * dim)


def linear_cross_entropy_case(tokens: int = 8192, hidden: int = 4096, vocab: int = 128256):
    """Forward+backward of the loss through the JAX-side form (the torch
    op's kernels, chunked, under one jax.jit) against the unfused loss as a
    model computes it (bfloat16 logits, then float32 log-softmax): time, and
    each compiled program's memory beyond its arguments (XLA's analysis)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((tokens, hidden), np.float32), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((vocab, hidden), np.float32) * 0.02, jnp.bfloat16)
    t = jnp.asarray(rng.integers(0, vocab, tokens), jnp.int32)

    def unfused(x, w, t):
        z = jnp.dot(x, w.T).astype(jnp.float32)
        return jnp.mean(jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, t[:, None], 1)[:, 0])

    functions = {
        "ours": jax.value_and_grad(lambda x, w, t: tpj.linear_cross_entropy(x, w, t), (0, 1)),
        "unfused xla": jax.value_and_grad(unfused, (0, 1)),
    }
    MEMORY.clear()
    times = compare(functions, {name: [x, w, t] for name in functions}, skip_failures=True)

    def gib(name):  # a program that does not fit the chip: its error
        if name not in MEMORY:
            return times.pop(name)
        return f"{(MEMORY[name].temp_size_in_bytes + MEMORY[name].output_size_in_bytes) / 2**30:.2f} GiB"

    memory = {name: gib(name) for name in functions}
    name = f"linear_cross_entropy bf16 {tokens} tokens, hidden {hidden}, V={vocab}, fwd+bwd"
    row(f"{name} (memory beyond the arguments: ours {memory['ours']}; unfused "
        f"{memory['unfused xla']})", times.get("ours"),
        {n: v for n, v in times.items() if n != "ours"}, work=3 * 2.0 * tokens * hidden * vocab,
        unit="TFLOP/s", goal="memory <= 0.25x, time <= 1.1x the unfused loss")


def token_log_probs_case(tokens: int = 8192, hidden: int = 4096, vocab: int = 151936):
    """Forward+backward of a GRPO-like loss of the per-token log-probs at
    temperature 0.7 and their entropies (tests/tpu_programs.py's: the
    log-probs weighted per token, an entropy bonus) through the JAX-side
    form against XLA's unfused twin (the whole float32 logits over the
    temperature, log_softmax, the targets' gather, the entropy): time, and
    each compiled program's memory beyond its arguments."""
    import tpu_programs  # tests/, beside tpu_builds

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((tokens, hidden), np.float32), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((vocab, hidden), np.float32) * 0.02, jnp.bfloat16)
    t = jnp.asarray(rng.integers(0, vocab, tokens), jnp.int32)
    a = jnp.asarray(rng.standard_normal(tokens), jnp.float32)  # per-token advantages
    functions = {
        "ours": jax.value_and_grad(tpu_programs.fused_log_probs_loss, (0, 1)),
        "unfused xla": jax.value_and_grad(tpu_programs.unfused_log_probs_loss, (0, 1)),
    }
    MEMORY.clear()
    times = compare(functions, {name: [x, w, t, a] for name in functions}, skip_failures=True)

    def gib(name):  # a program that does not fit the chip: its error
        if name not in MEMORY:
            return times.pop(name)
        return f"{(MEMORY[name].temp_size_in_bytes + MEMORY[name].output_size_in_bytes) / 2**30:.2f} GiB"

    memory = {name: gib(name) for name in functions}
    name = (f"token_log_probs bf16 {tokens} tokens, hidden {hidden}, V={vocab}, T "
            f"{tpu_programs.TEMPERATURE}, log-probs and entropy, fwd+bwd")
    row(f"{name} (memory beyond the arguments: ours {memory['ours']}; unfused "
        f"{memory['unfused xla']})", times.get("ours"),
        {n: v for n, v in times.items() if n != "ours"}, work=3 * 2.0 * tokens * hidden * vocab,
        unit="TFLOP/s", goal="memory <= 0.3x, time <= 1.1x the unfused log-probs")


def through_torch_case(n: int = 4096):
    """One matmul call on CPU torch tensors through the `tpu` backend:
    host -> chip -> host with the kernel, against the kernel alone."""
    if COMPILE_ONLY:
        return
    a, b = rand(n, n), rand(n, n)
    with torch_pallas.backend("tpu"):
        torch_pallas.matmul(a, b)  # compile
        times = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            torch_pallas.matmul(a, b)
            times.append(time.perf_counter() - start)
    host = a.numpy(force=True) if a.dtype != torch.bfloat16 else a.view(torch.int16).numpy()
    start = time.perf_counter()
    jax.block_until_ready(jax.device_put(host, DEVICE))
    copy = time.perf_counter() - start
    row(f"matmul bf16 {n}^3 through CPU torch tensors (one operand host->chip: "
        f"{copy * 1e3:.2f} ms)", statistics.median(times), {}, work=2.0 * n ** 3,
        unit="TFLOP/s", goal="the copies' cost, measured")


def sweep(name: str, calls, variants: dict):
    """Each recorded call's kernel with each config of `variants` (label ->
    a function of the call's own config giving another): times, as the
    chip's blocks were chosen."""
    for call in calls:
        functions, args = {}, {}
        for label, vary in variants.items():
            functions[label] = _kernel(call["build"], vary(call["config"]))
            args[label] = call["inputs"]
        t = compare(functions, args, skip_failures=True)
        line = dict(sweep=f"{name}: {call['op']} {call['avals'][:2]}",
                    ms={k: (v * 1e3 if isinstance(v, float) else v) for k, v in t.items()})
        RESULTS.append(line)
        print(json.dumps(line), flush=True)


def attention_sweep():
    """Attention's blocks around the chosen 1024 x 1024, each kernel alone."""
    for batch, length in ((2, 4096), (1, 8192)):
        q, k, v = (rand(batch, 16, length, 128, grad=True) for _ in range(3))

        def step():
            out = torch_pallas.attention(q, k, v, is_causal=True)
            out.backward(torch.ones_like(out))

        variants = {
            f"{bq}x{bk}": (lambda c, bq=bq, bk=bk: dataclasses.replace(c, block_q=bq, block_k=bk))
            for bq, bk in ((512, 512), (512, 1024), (1024, 512), (1024, 1024), (2048, 512),
                           (2048, 1024), (256, 2048), (512, 2048))}
        # the backward's dq in a kernel of its own (the forward has none);
        # the forward's and dk/dv's key blocks in sub-steps
        variants["1024x1024 dq apart"] = lambda c: dataclasses.replace(
            c, block_q=1024, block_k=1024, fused_dq_bytes=0)
        variants["1024x1024 all keys at once"] = lambda c: dataclasses.replace(
            c, block_q=1024, block_k=1024, block_k_compute=None)
        for bq, bk, bkc in ((1024, 1024, 512), (1024, 1024, 256), (1024, 1024, 128),
                            (2048, 1024, 256), (1024, 2048, 256), (1024, 2048, 512),
                            (512, 1024, 256)):
            variants[f"{bq}x{bk} compute {bkc}"] = (
                lambda c, bq=bq, bk=bk, bkc=bkc: dataclasses.replace(
                    c, block_q=bq, block_k=bk, block_k_compute=bkc))
        sweep(f"attention causal B{batch} H16 L{length}", record(step), variants)


def window_sweep():
    """Sliding windows of 1024, 2048 and 4096 keys at L8192 in blocks around
    the chosen ones (attention_blocks.NARROW_WINDOW_BLOCKS up to 1024 keys):
    for a window of 1024, 1024-blocks visit 2048 keys a query block,
    512-blocks 1536 in three times the steps (v5e's schedule: a 512 x 512
    body 1134 bundles, a 1024 x 1024 one 4660)."""
    q, k, v = (rand(1, 16, 8192, 128, grad=True) for _ in range(3))
    around = ((512, 512, None), (1024, 1024, 512), (512, 1024, 512))
    smaller = ((1024, 512, None), (512, 512, 256), (256, 512, None), (512, 256, None),
               (256, 256, None))
    for span in (1024, 2048, 4096):
        def window_step(span=span):
            out = torch_pallas.attention(q, k, v, window_size=(span - 1, 0))
            out.backward(torch.ones_like(out))

        sweep(f"attention window {span} B1 H16 L8192", record(window_step), {
            f"{bq}x{bk} compute {bkc}": (lambda c, bq=bq, bk=bk, bkc=bkc: dataclasses.replace(
                c, block_q=bq, block_k=bk, block_k_compute=bkc))
            for bq, bk, bkc in around + (smaller if span == 1024 else ())})


def grouped_mm_sweep():
    """grouped_mm's tiles around the chosen ones (Mixtral-like, 8 groups)."""
    rng = np.random.default_rng(0)
    offs = torch.tensor(np.cumsum(rng.multinomial(16384, rng.dirichlet(np.ones(8)))),
                        dtype=torch.int32)
    x, w = rand(16384, 4096, grad=True), rand(8, 4096, 1792, grad=True)

    def moe():
        y = torch_pallas.grouped_mm(x, w, offs=offs)
        y.backward(torch.ones_like(y))

    def tiles(m=1.0, n=1.0, k=1.0):  # the chosen tiles scaled
        return lambda c: dataclasses.replace(c, block_m=int(c.block_m * m),
                                             block_n=int(c.block_n * n),
                                             block_k=int(c.block_k * k))

    sweep("grouped_mm 16384 x 4096 x 1792", record(moe), {
        "chosen": tiles(), "rows / 2": tiles(m=0.5), "rows x 2": tiles(m=2),
        "N / 2": tiles(n=0.5), "N x 2": tiles(n=2), "K / 2": tiles(k=0.5), "K x 2": tiles(k=2),
        "N x 2, K / 2": tiles(n=2, k=0.5), "512 x 1024 x 1024 (padded)": (
            lambda c: dataclasses.replace(c, block_m=512, block_n=1024, block_k=1024))})


def matmul_sweep():
    """Matmul's blocks (rows x N x K) at 4096^3 and 8192^3, bfloat16."""
    for size in (4096, 8192):
        a, b = rand(size, size), rand(size, size)
        sweep(f"matmul bf16 {size}^3", record(lambda: torch_pallas.matmul(a, b)), {
            f"{bm}x{bn}x{bk}": (lambda c, t=(bm, bn, bk): dataclasses.replace(
                c, block_m=t[0], block_n=t[1], block_k=t[2]))
            for bm, bn, bk in ((512, 1024, 1024), (1024, 1024, 512), (512, 2048, 512),
                               (1024, 512, 1024), (256, 1024, 1024), (512, 1024, 2048),
                               (1024, 1024, 1024), (2048, 1024, 256), (1024, 1024, 2048),
                               (1024, 1024, 4096), (512, 1024, 4096), (2048, 1024, 1024),
                               (1024, 2048, 1024), (2048, 2048, 512))})


def rms_norm_sweep():
    """rms_norm's row blocks at 8192 x 8192."""
    n = 8192
    xs, ws = rand(n, n, grad=True), rand(n, grad=True)

    def norm():
        y = torch_pallas.rms_norm(xs, (n,), ws, eps=1e-6)
        y.backward(torch.ones_like(y))

    sweep("rms_norm 8192 x 8192", record(norm), {
        f"{r} rows": (lambda c, r=r: dataclasses.replace(c, block_rows=r))
        for r in (16, 32, 64, 128, 256)})


def bandwidth_sweep(n: int = 8192):
    """What the chip's HBM gives a read and a write of n x n bfloat16 (the
    memory-bound kernels' goal is 85% of 819 GB/s): XLA's `2 * x`, and a
    Pallas kernel doing the same as ours do (emit_pipeline over blocks of
    whole rows) by rows a block and the input's buffers (2: double
    buffering, emit_pipeline's default; 3: one more copy in flight)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    from torch_pallas.kernels.tpu.cores import tensorcore_mesh

    def doubled(rows: int, buffers: int):
        def kernel(x_hbm, o_hbm):
            def body(x_ref, o_ref):
                o_ref[...] = x_ref[...] * 2

            mode = {} if buffers == 2 else {"pipeline_mode": pl.Buffered(buffers)}
            pltpu.emit_pipeline(
                body, grid=(n // rows,),
                in_specs=[pl.BlockSpec((rows, n), lambda i: (i, 0), **mode)],
                out_specs=[pl.BlockSpec((rows, n), lambda i: (i, 0))])(x_hbm, o_hbm)

        return pl.kernel(kernel, out_type=jax.ShapeDtypeStruct((n, n), jnp.bfloat16),
                         mesh=tensorcore_mesh(1))

    functions = {"xla 2 * x": lambda x: x * 2}
    # 256 rows in 3 buffers (and 2 out): 20 MiB, past Mosaic's 16 MiB default
    for rows, buffers in ((32, 2), (32, 3), (64, 2), (64, 3), (128, 2), (128, 3), (256, 2)):
        functions[f"pallas {rows} rows, {buffers} buffers"] = doubled(rows, buffers)
    x = np.asarray(bridge.to_kernel_argument(rand(n, n)))
    t = compare(functions, {name: [x] for name in functions}, skip_failures=True)
    line = dict(sweep=f"HBM read + write, bf16 {n} x {n}",
                ms={k: (v * 1e3 if isinstance(v, float) else v) for k, v in t.items()},
                gb_s={k: 4.0 * n * n / v / 1e9 for k, v in t.items() if isinstance(v, float)})
    RESULTS.append(line)
    print(json.dumps(line), flush=True)


def bounds_case():
    """Where the chip's values leave an example's bound: the worst element
    of each example of the ops that did, its reference, value and bound."""
    for info in registry.ops():
        if info.name not in ("swiglu", "linear_cross_entropy_backward"):
            continue
        with torch_pallas.backend("tpu"):
            for example in info.examples(torch.device("cpu"), False):
                out = info.overload(*example.args, **example.kwargs)
                outs = out if isinstance(out, tuple) else (out,)
                refs = example.expected if isinstance(example.expected, tuple) else (
                    example.expected,)
                bounds = example.bound if isinstance(example.bound, tuple) else (example.bound,)
                for i, (o, r, b) in enumerate(zip(outs, refs, bounds)):
                    if o.numel() == 0:
                        continue
                    err = (o.double() - r.double()).abs()
                    b = torch.as_tensor(b, dtype=torch.float64).expand_as(err)
                    worst = int((err - b).argmax()) if err.numel() else 0
                    line = dict(bounds=f"{info.name} output {i} {o.dtype} {tuple(o.shape)}",
                                ref=r.double().flatten()[worst].item(),
                                got=o.double().flatten()[worst].item(),
                                err=err.flatten()[worst].item(),
                                bound=b.flatten()[worst].item(),
                                rel=(err / r.double().abs().clamp_min(1e-30)).max().item(),
                                beyond=int((err > b).sum()))
                    if example.args and isinstance(example.args[0], torch.Tensor):
                        line["first_input_at_worst"] = example.args[0].double().flatten()[
                            worst % example.args[0].numel()].item()
                    RESULTS.append(line)
                    print(json.dumps(line), flush=True)


CASES = {
    "matmul": lambda: [matmul_case(n, d) for d in (torch.bfloat16, torch.float32)
                       for n in (4096, 8192)],
    "attention": lambda: [attention_case(2, 16, 4096), attention_case(1, 16, 8192)],
    "attention_spans": lambda: [attention_spans_case("window"), attention_spans_case("packed")],
    "grouped_mm": lambda: [grouped_mm_case(8192, 4096, 1792), grouped_mm_case(16384, 4096, 1792)],
    "memory_bound": memory_bound_cases,
    "linear_cross_entropy": lambda: [linear_cross_entropy_case(tokens)
                                     for tokens in (2048, 4096, 8192)],
    "token_log_probs": lambda: [token_log_probs_case(tokens) for tokens in (4096, 8192)],
    "through_torch": through_torch_case,
    "bounds": bounds_case,
    "sweep_attention": attention_sweep,
    "sweep_attention_window": window_sweep,
    "sweep_grouped_mm": grouped_mm_sweep,
    "sweep_matmul": matmul_sweep,
    "sweep_rms_norm": rms_norm_sweep,
    "sweep_bandwidth": bandwidth_sweep,
}


def raise_vmem_limit(limit: int):
    """Every `pl.kernel` the kernels build from now on takes `limit` bytes
    of scoped VMEM (the kernels pass no compiler parameters of their own)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    kernel = pl.kernel

    def limited(*args, **kwargs):
        kwargs.setdefault("compiler_params", pltpu.CompilerParams(vmem_limit_bytes=limit))
        return kernel(*args, **kwargs)

    pl.kernel = limited


def table() -> str:
    lines = ["| case | ours | rate | reference: time, ratio (theirs / ours) | goal |",
             "|---|---|---|---|---|"]
    for r in RESULTS:
        if "case" not in r:  # sweeps and bound diagnostics: in the JSON
            continue
        rate = next((f"{r[u]:.1f} {u}" for u in ("TFLOP/s", "GB/s") if u in r), "")
        refs = "; ".join(f"{n}: {v['ms']:.3f} ms" + ("" if v["ratio"] is None else
                                                      f", {v['ratio']:.2f}x")
                         for n, v in r["references"].items() if v["ms"] is not None)
        ours_ms = "-" if r["ours_ms"] is None else f"{r['ours_ms']:.3f} ms"
        lines.append(f"| {r['case']} | {ours_ms} | {rate} | {refs} | {r['goal']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--case", action="append", choices=list(CASES))
    parser.add_argument("--vmem-limit-mib", type=int, help="every TPU kernel compiled with "
                        "this limit on scoped VMEM (Mosaic's default: 16 MiB), to time blocks "
                        "that do not fit the default")
    args = parser.parse_args()
    if args.vmem_limit_mib:
        raise_vmem_limit(args.vmem_limit_mib * 2**20)
    print(f"device: {DEVICE.device_kind}; jax {jax.__version__}", flush=True)
    failed = []
    for name in args.case or list(CASES):
        try:
            CASES[name]()
        except Exception as e:  # report every case
            failed.append(name)
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tpu_check.json"), "w") as f:
        json.dump(dict(device=DEVICE.device_kind, jax=jax.__version__, results=RESULTS,
                       failed=failed), f, indent=1, default=str)
    with open(os.path.join(args.out, "tpu_check.md"), "w") as f:
        f.write(table() + "\n")
    print(table())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
