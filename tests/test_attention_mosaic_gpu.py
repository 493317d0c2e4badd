"""The Hopper attention kernels (kernels/mosaic_gpu/attention.py and
attention_backward.py): simulated in Mosaic GPU interpret mode
(`mosaic_gpu_interpret`) against the float64 reference of
tests/attention_reference.py on small ragged calls (decode, L > S causal,
S = 1, GQA and MQA, every mask kind, odd head dims, both 16-bit dtypes,
dropout), and
lowered for sm_90a with every configuration select_config ships (the
simulator checks values; the lowering checks wgmma layouts and dtypes, SMEM
budget and the MLIR verifier, which the simulator skips).

The simulator is slow (seconds per kernel), so the calls are small; each
case runs the forward and, on the forward's own o and lse, the backward.
select_config gives the simulator the one-warpgroup form of the kernels
(attention_blocks.tile_pipeline); the hardware's warp-specialized form is
simulated where the machine has the cores for it.

Spans (windows, packed sequences) and softcap: the same checks on calls
with them, alone and with GQA, a mask and dropout; key blocks no row reaches
are NaN in one of them, which only skipping them keeps out of the results.
"""

from __future__ import annotations

import dataclasses
import os
import types

import jax
import jax.numpy as jnp
import pytest
import torch

from attention_reference import Case, bound, make_case, run_kernel, torch_error
from helpers import assert_within
from torch_pallas.kernels.mosaic_gpu import attention as forward, attention_backward as backward
from torch_pallas.kernels.mosaic_gpu.tiles import HOPPER_SMEM_BYTES
from torch_pallas.base import jax_env

FORWARD = "torch_pallas.kernels.mosaic_gpu.attention"
BACKWARD = "torch_pallas.kernels.mosaic_gpu.attention_backward"
SIMULATOR = "mosaic_gpu_interpret"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
H100 = types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3", core_count=132)


def lse_bound(ref_lse):
    """Scores and their log-sum-exp are float32 in every dtype."""
    return 1e-4 + 1e-5 * ref_lse.abs()


def run_forward(case):
    return run_kernel(FORWARD, SIMULATOR, case.inputs, **case.params)


def run_backward(case, o, do, lse):
    inputs = (case.q, case.k, case.v, o, do, lse) + case.backward_extra
    return run_kernel(BACKWARD, SIMULATOR, inputs, **case.params)


def check_forward(case, o, lse, ref, errors):
    what = f"attention (mosaic_gpu) {case.q.dtype}"
    assert o.dtype == case.q.dtype and lse.dtype == torch.float32
    assert_within(o, ref[0], bound(errors[0], case.q.dtype), f"{what}: o")
    hidden = torch.isinf(ref[1])
    assert torch.equal(lse == float("inf"), hidden), \
        f"{what}: lse is +inf exactly where no key is visible"
    assert_within(lse[~hidden], ref[1][~hidden], lse_bound(ref[1][~hidden]), f"{what}: lse")


def check_gradients(case, grads, ref, errors):
    for name, grad, expected, err in zip(("dq", "dk", "dv"), grads, ref[2], errors[1:]):
        assert grad.dtype == case.q.dtype and grad.shape == expected.shape, name
        magnitude = max(1.0, expected.abs().max().item())
        assert_within(grad, expected, bound(err, case.q.dtype, magnitude),
                      f"attention backward (mosaic_gpu) {case.q.dtype}: {name}")


def check_case(case):
    o, lse = run_forward(case)
    do = torch.randn(o.shape).to(o.dtype)
    ref, errors = torch_error(case, do)
    check_forward(case, o, lse, ref, errors)
    check_gradients(case, run_backward(case, o, do, lse), ref, errors)


# (id, make_case keywords): each a ragged canonical call, small for the
# simulator; the forward and, on its o and lse, the backward.
CASES = [
    ("gqa-ragged-bf16", dict(b=1, hq=4, hkv=2, l=37, s=45, e=32, dtype=BF16)),
    # Dropout's mask hashed per tile from global indices, over several blocks.
    ("mqa-causal-multiblock-E40-Ev24-dropout", dict(b=1, hq=2, hkv=1, l=70, s=150, e=40, ev=24,
                                                    causal=True, dtype=F16, dropout_p=0.3)),
    ("decode-mqa", dict(b=1, hq=4, hkv=1, l=1, s=45, e=64, dtype=BF16)),
    ("causal-L>S-shared-f32-mask", dict(b=1, hq=2, hkv=1, l=50, s=20, e=32, causal=True,
                                        dtype=F16, mask="shared", mask_dtype=F32)),
    ("full-f32-mask-E24", dict(b=1, hq=2, hkv=2, l=20, s=45, e=24, dtype=BF16, mask="full",
                               mask_dtype=F32)),
    ("empty-rows-causal", dict(b=1, hq=2, hkv=1, l=37, s=45, e=32, dtype=F16,
                               mask="empty_rows", causal=True)),
    ("batch-mask", dict(b=2, hq=1, hkv=1, l=9, s=30, e=32, dtype=BF16, mask="batch")),
    ("S=1-heads-mask", dict(b=1, hq=2, hkv=1, l=9, s=1, e=32, dtype=F16, mask="heads")),
    ("E128-Ev64", dict(b=1, hq=1, hkv=1, l=20, s=33, e=128, ev=64, dtype=BF16)),
]


@pytest.mark.parametrize("kwargs", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_simulated_attention_matches_float64(kwargs):
    check_case(make_case(**kwargs))


@pytest.mark.slow
def test_simulated_head_dim_256_many_blocks():
    """Head dims 256 / 200 (the smallest blocks and pipelines select_config
    ships) over several query and key blocks, with a per-head mask and
    causal."""
    check_case(make_case(b=1, hq=2, hkv=1, l=65, s=100, e=256, ev=200, dtype=BF16,
                         mask="heads", causal=True))


# Spans (kernels/attention_shapes.py) and softcap: each case's forward and
# backward against the float64 reference, as CASES. The kernels' tiles are 64
# query rows (block_kv 128 forward, 64 backward) in the simulator.
SPAN_CASES = [
    # A top-left window with causal folded into it; L != S, ragged.
    ("window-5-0-causal-L<S", dict(b=1, hq=2, hkv=1, l=70, s=100, e=32, dtype=F16,
                                   window=(5, 0), causal=True)),
    ("window-3-2", dict(b=1, hq=1, hkv=1, l=80, s=66, e=32, dtype=BF16, window=(3, 2))),
    # Packed sequences, causal (bottom-right): an empty one, Lq > Lk (its
    # first rows see nothing), Lq < Lk, rows and keys past the last one.
    ("packed-sequences-causal", dict(b=1, hq=2, hkv=1, l=140, s=150, e=32, dtype=BF16,
                                     sequences=[(20, 30), (0, 10), (50, 20), (30, 80)],
                                     causal=True)),
    ("softcap", dict(b=1, hq=2, hkv=2, l=37, s=45, e=32, dtype=BF16, softcap=5.0)),
    ("softcap-window-gqa", dict(b=1, hq=4, hkv=2, l=70, s=130, e=40, ev=24, dtype=F16,
                                window=(20, 10), softcap=2.0)),
    ("window-causal-f32-mask", dict(b=1, hq=2, hkv=1, l=70, s=90, e=32, dtype=F16,
                                    window=(30, 0), causal=True, mask="heads",
                                    mask_dtype=F32)),
    ("window-dropout", dict(b=1, hq=2, hkv=1, l=70, s=90, e=32, dtype=BF16, window=(30, 30),
                            dropout_p=0.3)),
]


@pytest.mark.parametrize("kwargs", [c[1] for c in SPAN_CASES], ids=[c[0] for c in SPAN_CASES])
def test_simulated_spans_and_softcap_match_float64(kwargs):
    check_case(make_case(**kwargs))


def test_spans_never_read_key_blocks_no_row_reaches():
    """Two packed sequences, a causal window of 10 keys (bottom-right): the
    first's 64 queries see keys 310..383 of its 384, the second's its keys
    384..447; keys 448..575 belong to none. Keys 0..255 and 512..575 (whole
    blocks of 64 and 128 keys) are NaN: the forward and dQ kernels must
    never load them (a zero weight times NaN is NaN), and the dK/dV kernel
    visits no query block for them (their gradients are exact zeros)."""
    case = make_case(b=1, hq=2, hkv=1, l=128, s=576, e=32, dtype=F16, window=(10, 0),
                     causal=True, sequences=[(64, 384), (64, 64)])
    do = torch.randn(case.q.shape).to(case.q.dtype)
    ref, errors = torch_error(case, do)
    k, v = case.k.clone(), case.v.clone()
    for unreached in (slice(0, 256), slice(512, 576)):
        k[:, :, unreached], v[:, :, unreached] = float("nan"), float("nan")
    poisoned = dataclasses.replace(case, k=k, v=v)
    o, lse = run_forward(poisoned)
    check_forward(case, o, lse, ref, errors)
    grads = run_backward(poisoned, o, do, lse)
    check_gradients(case, grads, ref, errors)
    for grad in grads[1:]:
        assert torch.equal(grad[:, :, :256], torch.zeros_like(grad[:, :, :256]))


def simulate(case, do, forward_config, backward_config):
    """The forward (and with `do`, the backward on its o and lse) simulated
    with the given configs; torch tensors out."""
    interpret = jax_env.gpu_interpret_params(detect_races=False)
    dtype = jnp.dtype(str(case.q.dtype).removeprefix("torch."))

    def as_jax(t):
        return jnp.asarray(t.float().numpy(), jnp.float32 if t.dtype == F32 else dtype)

    def as_torch(x):
        return torch.from_dlpack(x.astype(jnp.float32)).to(case.q.dtype if x.dtype == dtype
                                                           else F32)

    def as_operand(t):  # spans stay int32
        return jnp.asarray(t.numpy()) if t.dtype == torch.int32 else as_jax(t)

    q, k, v = map(as_jax, (case.q, case.k, case.v))
    extra = tuple(map(as_operand, case.extra))
    backward_extra = tuple(map(as_operand, case.backward_extra))
    params = dict(case.params, interpret=interpret)
    try:
        o, lse = jax.block_until_ready(jax.jit(lambda *a: forward.attention(
            *a, **params, config=forward_config))(q, k, v, *extra))
        grads = None
        if do is not None:
            grads = jax.block_until_ready(jax.jit(lambda *a: backward.attention_backward(
                *a, **params, config=backward_config))(q, k, v, o, as_jax(do), lse,
                                                       *backward_extra))
    except Exception:
        jax_env.reset_simulator("mosaic_gpu")
        raise
    return as_torch(o), as_torch(lse), None if grads is None else tuple(map(as_torch, grads))


def test_simulated_persistent_grid_with_several_programs():
    """Two programs share the tiles (forward: 2 heads x 4 query blocks,
    causal, the longest first; backward: 2 key tiles of the key/value head,
    4 query tiles): each runs one pipeline per tile on the same barriers and
    SMEM."""
    case = make_case(b=1, hq=2, hkv=1, l=200, s=70, e=32, causal=True, dtype=F16,
                     mask="heads")
    do = torch.randn(case.q.shape[:-1] + (case.v.shape[-1],)).to(F16)
    o, lse, grads = simulate(
        case, do,
        forward.AttentionConfig(64, 64, 2, compute_wgs=1, warp_specialized=False,
                                num_programs=2),
        backward.BackwardConfig(64, 64, 2, compute_wgs=1, warp_specialized=False,
                                num_programs=2))
    ref, errors = torch_error(case, do)
    check_forward(case, o, lse, ref, errors)
    check_gradients(case, grads, ref, errors)


# The simulator runs each warpgroup of a warp-specialized kernel on one of
# XLA's CPU worker threads, held while it waits at a barrier; with no more
# workers (one per core) than simulated warpgroups the simulation can
# deadlock (seen on a 2-core machine), so those run where the cores suffice.
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# The warp-specialized kernels' calls: GQA, a per-head mask, ragged; causal,
# or packed causal sequences (an empty one, rows past the last; tiles whose
# pipelines start past block 0, or have no step) with a softcap.
WARP_SPECIALIZED_CASES = {
    "causal": dict(causal=True),
    "sequences-softcap": dict(causal=True, sequences=[(30, 20), (0, 10), (50, 60)],
                              softcap=3.0),
}


@pytest.mark.parametrize("kind", list(WARP_SPECIALIZED_CASES))
@pytest.mark.parametrize("compute_wgs", [1, 2])
def test_simulated_warp_specialized_kernels(compute_wgs, kind):
    """The hardware's kernels (a memory warpgroup beside one or two compute
    warpgroups) on two programs: GQA, causal, a per-head mask, ragged."""
    if CORES < compute_wgs + 2:
        pytest.skip(f"{CORES} CPU cores: the simulator needs {compute_wgs + 2} to run "
                    f"{compute_wgs + 1} warpgroups without deadlocking")
    case = make_case(b=1, hq=4, hkv=2, l=140 if kind != "causal" else 70, s=100, e=40, ev=24,
                     dtype=BF16, mask="heads", **WARP_SPECIALIZED_CASES[kind])
    do = torch.randn(case.q.shape[:-1] + (case.v.shape[-1],)).to(BF16)
    o, lse, grads = simulate(
        case, do,
        forward.AttentionConfig(64, 64, 2, compute_wgs=compute_wgs, num_programs=2),
        backward.BackwardConfig(64, 64, 2, compute_wgs=compute_wgs, num_programs=2))
    ref, errors = torch_error(case, do)
    check_forward(case, o, lse, ref, errors)
    check_gradients(case, grads, ref, errors)


def test_causal_never_reads_key_blocks_above_the_diagonal():
    """Keys and values past the first 128 are NaN: a causal call for 64
    query rows must never load them (even a zero weight times NaN is NaN);
    the dK/dV kernel gives those keys exact zeros (no query sees them)."""
    case = make_case(b=1, hq=2, hkv=1, l=64, s=200, e=32, causal=True, dtype=F16)
    do = torch.randn(case.q.shape).to(case.q.dtype)
    ref, errors = torch_error(case, do)
    k, v = case.k.clone(), case.v.clone()
    k[:, :, 128:], v[:, :, 128:] = float("nan"), float("nan")
    poisoned = Case(case.q, k, v, None, causal=True, scale=case.scale)
    o, lse = run_forward(poisoned)
    check_forward(case, o, lse, ref, errors)
    dq, dk, dv = run_backward(poisoned, o, do, lse)
    assert_within(dq, ref[2][0], bound(errors[1], F16, max(1.0, ref[2][0].abs().max().item())),
                  "dq")
    assert torch.equal(dk[:, :, 64:], torch.zeros_like(dk[:, :, 64:]))
    assert torch.equal(dv[:, :, 64:], torch.zeros_like(dv[:, :, 64:]))


def test_float32_is_refused_and_16_bit_is_not():
    for spec in (forward.KERNEL, backward.KERNEL):
        avals = (((1, 2, 8, 32), "float32"), ((1, 2, 8, 32), "float32"), ((1, 2, 8, 32), "float32"))
        reason = spec.refusal("mosaic_gpu", avals, {"scale": 0.1, "causal": False})
        assert reason is not None and "float32" in reason and "float16 or bfloat16" in reason
        spans = (((8, 2), "int32"),) + ((((8, 2), "int32"),) if spec is backward.KERNEL else ())
        reason = spec.refusal("mosaic_gpu", avals + spans,
                              {"scale": 0.1, "causal": False, "spans": True, "softcap": 5.0})
        assert reason is not None and "float32" in reason
        assert spec.refusal("mosaic_gpu", tuple((s, "bfloat16") for s, _ in avals), {}) is None


def test_a_config_past_the_shared_memory_budget_is_refused():
    config = forward.AttentionConfig(block_q=64, block_kv=128, max_concurrent_steps=4)
    assert config.smem_bytes("bfloat16", 256, 256) > HOPPER_SMEM_BYTES
    with pytest.raises(ValueError, match="shared memory"):
        config.check("bfloat16", 256, 256)
    with pytest.raises(ValueError, match="multiples of 64"):
        backward.BackwardConfig(block_q=32, block_kv=64, max_concurrent_steps=2).check(
            "float16", 64, 64)


# Lowering for sm_90a. select_config's choice depends on the query length (at
# most 64 rows or more), the head dims padded to 64 and the mask's dtype:
# every configuration it can return is lowered, for the call that needs the
# most shared memory of those it is chosen for (causal, GQA).
PADDED_DIMS = (64, 128, 192, 256)
MASK_DTYPES = (None, "bfloat16", "float32")


def shipped(spec, saved: bool) -> dict:
    """{config: (smem bytes, q_len, E, Ev, mask dtype)} over every call class."""
    witnesses = {}
    for l in (1, 300):
        for e in PADDED_DIMS:
            for ev in PADDED_DIMS:
                for mask_dtype in MASK_DTYPES:
                    avals = attention_avals(e, ev, mask_dtype, l=l, saved=saved)
                    config = spec.config("mosaic_gpu", avals, {"scale": 0.1, "causal": True}, H100)
                    need = config.smem_bytes("bfloat16", e, ev, mask_dtype)
                    need = max(need.values()) if isinstance(need, dict) else need
                    if config not in witnesses or witnesses[config][0] < need:
                        witnesses[config] = (need, l, e, ev, mask_dtype)
    return witnesses


def aval(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def lower_for_hopper(f, avals) -> str:
    text = jax.jit(f).trace(*[aval(*a) for a in avals]).lower(
        lowering_platforms=("cuda",)).as_text()
    # the custom call, not this file's name in the module's locations
    assert "custom_call @mosaic_gpu" in text, "no Mosaic GPU kernel in the lowered module"
    return text


def attention_avals(e, ev, mask_dtype, dtype="bfloat16", b=2, hq=4, hkv=2, l=300, s=500,
                    mask_heads=1, saved=False, dropout=False, spans=False):
    """Avals of a forward call, or with `saved` of a backward call (with
    `spans`, the spans (and key spans) after the mask; with `dropout`, the
    rows' keys last)."""
    avals = (((b, hq, l, e), dtype), ((b, hkv, s, e), dtype), ((b, hkv, s, ev), dtype))
    if saved:
        avals += (((b, hq, l, ev), dtype), ((b, hq, l, ev), dtype), ((b, hq, l), "float32"))
    avals += () if mask_dtype is None else (((b, mask_heads, l, s), mask_dtype),)
    if spans:
        avals += (((l, 2), "int32"),) + ((((s, 2), "int32"),) if saved else ())
    return avals + ((((b, hq, l), "int32"),) if dropout else ())


def lower_params(causal, dropout_p, **extra):
    return ({"scale": 0.125, "causal": causal} | ({"dropout_p": dropout_p} if dropout_p else {})
            | extra)


def lower_forward(avals, causal, config=None, dropout_p=0.0, **extra):
    params = lower_params(causal, dropout_p, **extra)
    config = config or forward.KERNEL.config("mosaic_gpu", avals, params, H100)
    lower_for_hopper(lambda *a: forward.attention(*a, **params, config=config, interpret=None),
                     avals)
    return config


def lower_backward(avals, causal, config=None, dropout_p=0.0, **extra):
    params = lower_params(causal, dropout_p, **extra)
    config = config or backward.KERNEL.config("mosaic_gpu", avals, params, H100)
    lower_for_hopper(lambda *a: backward.attention_backward(*a, **params, config=config,
                                                            interpret=None), avals)
    return config


FORWARD_CONFIGS = sorted(shipped(forward.KERNEL, saved=False).items(), key=str)
BACKWARD_CONFIGS = sorted(shipped(backward.KERNEL, saved=True).items(), key=str)


@pytest.mark.parametrize("config,witness", FORWARD_CONFIGS,
                         ids=[str(c[1][1:]) for c in FORWARD_CONFIGS])
def test_every_shipped_forward_config_lowers_for_hopper(config, witness):
    _, l, e, ev, mask_dtype = witness
    config.check("bfloat16", e, ev, mask_dtype)
    lower_forward(attention_avals(e, ev, mask_dtype, l=l, mask_heads=4), causal=True,
                  config=config)


@pytest.mark.parametrize("config,witness", BACKWARD_CONFIGS,
                         ids=[str(c[1][1:]) for c in BACKWARD_CONFIGS])
def test_every_shipped_backward_config_lowers_for_hopper(config, witness):
    _, l, e, ev, mask_dtype = witness
    config.check("bfloat16", e, ev, mask_dtype)
    lower_backward(attention_avals(e, ev, mask_dtype, l=l, saved=True, mask_heads=4),
                   causal=True, config=config)


def test_shipped_configs_cover_both_warpgroup_counts():
    """On a GPU: warp-specialized, two compute warpgroups for long queries,
    one for decoding (and for head dims whose tiles leave no room for two
    with a pipeline), one program per SM. In the simulator: one warpgroup
    doing both jobs, on one program."""
    assert {c.compute_wgs for c, _ in FORWARD_CONFIGS} == {1, 2}
    assert {c.compute_wgs for c, _ in BACKWARD_CONFIGS} == {1, 2}
    for config, _ in FORWARD_CONFIGS + BACKWARD_CONFIGS:
        assert config.warp_specialized and config.num_programs == H100.core_count, config
    for config, _ in FORWARD_CONFIGS:  # every forward overlaps its copies
        assert config.max_concurrent_steps >= 2, config
    assert forward.KERNEL.config("mosaic_gpu", attention_avals(128, 128, None, l=1), {},
                                 H100).compute_wgs == 1
    assert forward.KERNEL.config("mosaic_gpu", attention_avals(128, 128, None, l=65), {},
                                 H100).compute_wgs == 2
    for spec, saved in ((forward.KERNEL, False), (backward.KERNEL, True)):
        config = spec.config(SIMULATOR, attention_avals(128, 128, None, l=300, saved=saved), {},
                             None)
        assert (config.warp_specialized, config.compute_wgs, config.num_programs) == (False, 1, 1)


def test_the_simulators_configs_lower_for_hopper():
    """The one-warpgroup kernels the simulator runs are hardware kernels too."""
    for e, mask_dtype in ((64, None), (256, "float32")):
        avals = attention_avals(e, e, mask_dtype, mask_heads=4)
        config = forward.KERNEL.config(SIMULATOR, avals, {}, None)
        lower_forward(avals, True, dataclasses.replace(config, num_programs=H100.core_count))
        avals = attention_avals(e, e, mask_dtype, mask_heads=4, saved=True)
        config = backward.KERNEL.config(SIMULATOR, avals, {}, None)
        lower_backward(avals, True, dataclasses.replace(config, num_programs=H100.core_count))


@pytest.mark.parametrize("e,ev,mask_dtype,causal,mask_heads,dropout_p", [
    (40, 24, "float16", True, 4, 0.0),  # odd head dims, a per-head 16-bit mask
    (128, 128, "float32", False, 1, 0.0),  # not causal, a shared float32 mask
    (256, 64, None, False, 1, 0.0),
    (256, 256, "float32", True, 4, 0.5),  # dropout where shared memory is tightest
], ids=str)
def test_call_classes_lower_for_hopper(e, ev, mask_dtype, causal, mask_heads, dropout_p):
    dtype = "float16" if mask_dtype == "float16" else "bfloat16"
    lower_forward(attention_avals(e, ev, mask_dtype, dtype, mask_heads=mask_heads,
                                  dropout=dropout_p > 0), causal, dropout_p=dropout_p)
    lower_backward(attention_avals(e, ev, mask_dtype, dtype, mask_heads=mask_heads, saved=True,
                                   dropout=dropout_p > 0), causal, dropout_p=dropout_p)


def test_decode_and_mqa_lower_for_hopper():
    avals = attention_avals(128, 128, "float16", "float16", b=1, hq=8, hkv=1, l=1, s=4096,
                            mask_heads=8)
    assert lower_forward(avals, causal=False).compute_wgs == 1


@pytest.mark.parametrize("e,mask_dtype,dropout_p,simulators", [
    (64, None, 0.0, False),  # two compute warpgroups
    (256, "float32", 0.5, False),  # one, where shared memory is tightest
    (128, "bfloat16", 0.0, True),  # the simulator's one-warpgroup kernels
], ids=str)
def test_spans_and_softcap_lower_for_hopper(e, mask_dtype, dropout_p, simulators):
    """Spans (the pipelines' dynamic start and length from the spans in
    GMEM, the rows' spans in SMEM) and softcap, forward and backward."""
    extra = {"spans": True, "softcap": 30.0}
    for saved, kernel, lower in ((False, forward.KERNEL, lower_forward),
                                 (True, backward.KERNEL, lower_backward)):
        avals = attention_avals(e, e, mask_dtype, mask_heads=4, saved=saved,
                                dropout=dropout_p > 0, spans=True)
        params = lower_params(False, dropout_p, **extra)
        if simulators:
            config = dataclasses.replace(kernel.config(SIMULATOR, avals, params, None),
                                         num_programs=H100.core_count)
        else:
            config = kernel.config("mosaic_gpu", avals, params, H100)
            assert config.compute_wgs == (2 if e == 64 else 1), config
        lower(avals, False, config, dropout_p=dropout_p, **extra)
