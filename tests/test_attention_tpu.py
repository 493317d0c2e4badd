"""The TPU attention kernels (kernels/tpu/attention.py, attention_backward.py)
against the float64 reference of tests/attention_reference.py: on
`interpret` (the batched body, JAX's generic interpreter) across shapes,
masks, GQA, causal, dtypes and dropout, including forced small blocks that
take the key-chunk loops; on `tpu_interpret` (the pipelined TPU body, 2
simulated TensorCores, race detection) on a few tiny multi-block cases;
lowered for a TPU; and the batched body's memory bound."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from attention_reference import bound, make_case, torch_error
from torch_pallas.kernels.tpu import attention_blocks
from torch_pallas.kernels.tpu.attention_blocks import AttentionConfig, Body
from torch_pallas.base import dtypes, jax_env
from torch_pallas.ops import attention as attention_op
from torch_pallas.runtime import backends, bridge, registry, simulators

FORWARD = "torch_pallas.kernels.tpu.attention"
BACKWARD = "torch_pallas.kernels.tpu.attention_backward"


def run(module, backend_name, inputs, *, config=None, detect_races=False, **params):
    """One kernel file's KERNEL on torch CPU tensors, as backend
    `backend_name` runs it (tests/attention_reference.run_kernel), with
    `config` in place of the one the kernel picks when given."""
    import jax

    backend = backends.get(backend_name)
    spec = registry._load(module)
    avals = tuple((tuple(t.shape), dtypes.jax_name(t.dtype)) for t in inputs)
    device = torch.device("cpu")
    execution = backend.execution(device=device, takes_inputs=True, detect_races=detect_races)
    if config is None:
        config = spec.config(backend.name, avals, params, backends.jax_device(device))
    kernel = jax.jit(functools.partial(spec.run, **params, config=config, **execution))
    arrays = [bridge.to_kernel_argument(t.contiguous()) for t in inputs]
    if backend.simulated:
        out = simulators.run(backend, kernel, arrays, detect_races=detect_races,
                             describe=lambda: f"{module} on {backend_name}")
    else:
        out = kernel(*arrays)
    return tuple(bridge.to_torch(a) for a in out)


def assert_within(name, out, ref, err_bound):
    assert out.shape == ref.shape, (name, out.shape, ref.shape)
    assert torch.isfinite(out).all(), f"{name}: non-finite values"
    err = (out.double() - ref).abs()
    bad = err > err_bound
    if bad.any():
        where = bad.nonzero()[:5].tolist()
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {err.numel()} beyond the bound; max error "
            f"{err.max().item():.3g}, worst ratio {(err / err_bound).max().item():.3g}; first at "
            f"{where}: got {[out[tuple(i)].item() for i in where]}, "
            f"want {[ref[tuple(i)].item() for i in where]}")


def check(backend_name, case, *, config=None, detect_races=False, backward=True, run_on=None):
    """Forward (o, lse) and, with `backward`, (dq, dk, dv) against the float64
    reference, within twice torch's own error plus the dtype's floor; the
    kernels run on `run_on` where given (the case with keys no row sees
    changed)."""
    dtype = case.q.dtype
    params = case.params
    run_on = run_on or case
    o, lse = run(FORWARD, backend_name, run_on.inputs, config=config,
                 detect_races=detect_races, **params)
    assert o.dtype == dtype and lse.dtype == torch.float32
    do = torch.randn(o.shape).to(dtype) if backward else None
    ref, errors = torch_error(case, do)
    assert_within("o", o, ref[0], bound(errors[0], dtype))
    # lse: +inf exactly where the reference's row sees nothing, else close.
    empty = ref[1] == float("inf")
    assert torch.equal(lse == float("inf"), empty), "lse: +inf rows differ"
    assert_within("lse", torch.where(empty, 0, lse), torch.where(empty, 0, ref[1]),
                  torch.full_like(ref[1], 4 * bound(torch.zeros(()), dtype).item()))
    if not backward:
        return
    grads = run(BACKWARD, backend_name,
                (run_on.q, run_on.k, run_on.v, o, do, lse, *run_on.backward_extra),
                config=config, detect_races=detect_races, **params)
    for name, g, r, e in zip(("dq", "dk", "dv"), grads, ref[2], errors[1:]):
        assert g.dtype == dtype
        assert_within(name, g, r, bound(e, dtype, max(1.0, r.abs().max().item())))


# ---------------------------------------------------------------------------
# interpret: the batched body

SHAPES = {  # make_case keywords
    "gqa_ragged": dict(),
    "decode": dict(l=1, s=45),
    "one_key": dict(l=9, s=1),
    "l_gt_s_causal": dict(l=50, s=20, causal=True),
    "odd_dims_causal": dict(e=40, ev=24, causal=True),
    "mqa": dict(hq=4, hkv=1, e=128, ev=64),
    "mha_e256": dict(b=1, hq=2, hkv=2, l=20, s=33, e=256, ev=256),
    # select_config's causal blocks: three 200-row query blocks (x 2 heads),
    # three 367-key chunks (the last one padded).
    "causal_chunks_shared_mask": dict(b=1, hq=2, hkv=1, l=600, s=1100, causal=True,
                                      mask="shared"),
    # Shorter causal rows: five 60-row query blocks (x 2 heads), three
    # 100-key chunks, those above the diagonal skipped.
    "causal_square_blocks": dict(b=1, hq=2, hkv=1, l=300, s=300, causal=True),
    # 129-256 keys come in 128-key chunks: two 100-key chunks here.
    "short_key_chunks": dict(b=1, hq=2, hkv=1, l=200, s=200, mask="heads"),
}


@pytest.mark.parametrize("kw", SHAPES.values(), ids=SHAPES.keys())
def test_interpret_shapes(kw):
    check("interpret", make_case(**kw))


MASKS = [("full", False), ("batch", True), ("heads", False), ("shared", True),
         ("empty_rows", False), ("empty_rows", True)]


@pytest.mark.parametrize("mask,causal", MASKS, ids=[f"{m}{'_causal' * c}" for m, c in MASKS])
def test_interpret_masks(mask, causal):
    check("interpret", make_case(mask=mask, causal=causal))


DTYPE_CASES = {
    "float16": dict(dtype=torch.float16, causal=True),
    "bfloat16": dict(dtype=torch.bfloat16, e=24, ev=40),
    "bfloat16_f32_mask": dict(dtype=torch.bfloat16, mask="heads", mask_dtype=torch.float32),
    "float16_mask": dict(dtype=torch.float16, mask="empty_rows", causal=True),
}


@pytest.mark.parametrize("kw", DTYPE_CASES.values(), ids=DTYPE_CASES.keys())
def test_interpret_dtypes(kw):
    check("interpret", make_case(**kw))


# Blocks small enough that the batched body loops: several (batch, head)
# blocks, query blocks, and key chunks with the online softmax (and, in the
# backward, dk/dv accumulated across query blocks).
SMALL = AttentionConfig(Body.BATCHED, block_q=16, block_k=16, block_b=1, block_h=1)


@pytest.mark.parametrize("kw", [dict(causal=True, mask="empty_rows"), dict(mask="heads", hkv=1),
                                dict(l=70, s=23, causal=True, dtype=torch.bfloat16),
                                dict(b=1, l=40, s=53, mask="heads", dropout_p=0.3)],
                         ids=["causal_empty_rows", "mqa_heads_mask", "bf16_l_gt_s",
                              "dropout_heads_mask"])
def test_interpret_chunked(kw):
    check("interpret", make_case(**kw), config=SMALL)


# Spans (windows, packed sequences) and softcap, on both block sizes.
SPAN_CASES = {
    "window_causal_l_ne_s": dict(l=37, s=45, window=(5, 0), causal=True),
    "window_both_sides": dict(l=30, s=26, window=(3, 2), dtype=torch.bfloat16),
    # An empty sequence, Lq > Lk (rows that see nothing), Lq < Lk, rows
    # past the last sequence.
    "packed_causal": dict(b=1, l=40, s=44, sequences=[(5, 7), (0, 3), (9, 9), (6, 4), (12, 9)],
                          causal=True, dtype=torch.float16),
    "softcap_causal": dict(softcap=3.0, causal=True),
    "packed_softcap_gqa_mask": dict(b=1, hq=4, hkv=2, l=40, s=44, softcap=2.0, mask="heads",
                                    sequences=[(5, 7), (0, 3), (9, 9), (6, 4), (12, 9)]),
    "window_dropout": dict(window=(4, 1), dropout_p=0.3, dtype=torch.bfloat16),
}


@pytest.mark.parametrize("blocks", ["select_config", "small"])
@pytest.mark.parametrize("kw", SPAN_CASES.values(), ids=SPAN_CASES.keys())
def test_interpret_spans_and_softcap(kw, blocks):
    check("interpret", make_case(**kw), config=SMALL if blocks == "small" else None)


# A window's width as the kernels' span_width hint: select_config's slab
# blocks (128 rows, each taking its band of keys at once), and where a
# block's spans reach further than the slab (packed sequences whose
# diagonals differ), the chunk loop instead.
SLAB_CASES = {
    "window_slab": dict(b=1, hq=4, hkv=2, l=300, s=300, window=(20, 0), causal=True),
    "window_slab_softcap_dropout_bf16": dict(b=1, hq=2, hkv=2, l=260, s=290, window=(9, 3),
                                             softcap=3.0, dropout_p=0.2,
                                             dtype=torch.bfloat16),
    "packed_blocks_past_the_slab": dict(b=1, hq=2, hkv=1, l=300, s=300,
                                        sequences=[(150, 40), (150, 260)], window=(10, 0)),
}


@pytest.mark.parametrize("kw", SLAB_CASES.values(), ids=SLAB_CASES.keys())
def test_interpret_window_slabs(kw):
    case = make_case(**kw)
    config = attention_blocks.select_config("interpret", attention_blocks.AttentionDims(
        *case.q.shape[:2], case.k.shape[1], case.q.shape[2], case.k.shape[2],
        case.q.shape[3], case.v.shape[3]), case.params)
    assert 0 < config.slabs[0] < case.k.shape[2] and config.block_q == 128, config
    check("interpret", case)


def test_interpret_packed_slab_ladder(monkeypatch):
    """Packed sequences without a window: select_config's ladder of slabs,
    each query block taking the narrowest that holds its keys, and, with
    the ladder capped below the longest sequence, the chunk loop for the
    blocks that reach further; causal and not, GQA, softcap."""
    monkeypatch.setattr(attention_blocks, "PACKED_SLAB_MOST", 100)
    for causal in (True, False):
        case = make_case(b=1, hq=4, hkv=2, l=290, s=300, causal=causal, softcap=4.0,
                         sequences=[(30, 20), (200, 210), (0, 5), (60, 65)])
        config = attention_blocks.select_config("interpret", attention_blocks.AttentionDims(
            *case.q.shape[:2], case.k.shape[1], case.q.shape[2], case.k.shape[2],
            case.q.shape[3], case.v.shape[3]), case.params)
        assert len(config.slabs) >= 2 and config.slabs[-1] < 200, config
        check("interpret", case)


def unreachable_blocks_poisoned(case, block: int = 16):
    """The case with NaN in every `block`-key block that no `block`-row
    query block's spans reach: finite, correct results prove the kernels
    never touch those blocks (a visited block's masked keys still enter
    p @ v as 0 * value, so only whole blocks can be poisoned)."""
    spans = case.spans
    reached = torch.zeros(-(-case.k.shape[2] // block), dtype=torch.bool)
    for first in range(0, spans.shape[0], block):
        last = min(first + block, spans.shape[0]) - 1
        reached[spans[first, 0] // block: -(-spans[last, 1] // block)] = True
    poisoned = ~reached.repeat_interleave(block)[:case.k.shape[2]]
    assert poisoned.sum() >= case.k.shape[2] // 2, "the case should skip most blocks"
    k, v = case.k.clone(), case.v.clone()
    k[:, :, poisoned] = float("nan")
    v[:, :, poisoned] = float("nan")
    return dataclasses.replace(case, k=k, v=v)


def packed_with_gaps(hq=2, hkv=1):
    """Two packed sequences of 16 queries and 64 keys, each window (3, 0):
    rows see at most 4 keys, near the end of their sequence's, so half the
    16-key blocks are out of every query block's reach."""
    case = make_case(b=1, hq=hq, hkv=hkv, l=32, s=128, sequences=[(16, 64), (16, 64)],
                     window=(3, 0))
    return case


def test_interpret_skips_the_blocks_no_span_reaches():
    case = packed_with_gaps()
    check("interpret", case, config=SMALL, run_on=unreachable_blocks_poisoned(case))


def test_interpret_bounded_memory():
    """select_config keeps every float32 score block of the batched body (and
    the mask block read with it) cache-sized, far below any memory budget,
    for long sequences and many heads; small problems are packed into few
    blocks."""
    from torch_pallas.kernels.tpu import attention, attention_backward

    def config(spec, b, hq, hkv, l, s, causal=False, mask=False, e=64):
        avals = [((b, hq, l, e), "float32"), ((b, hkv, s, e), "float32"),
                 ((b, hkv, s, e), "float32")]
        if spec is attention_backward.KERNEL:
            avals += [((b, hq, l, e), "float32")] * 2 + [((b, hq, l), "float32")]
        if mask:
            avals.append(((b, hq, l, s), "float32"))
        return spec.config("interpret", tuple(avals), {"scale": 0.1, "causal": causal})

    for spec in (attention.KERNEL, attention_backward.KERNEL):
        small = config(spec, 2, 4, 2, 37, 45)  # everything in one block
        assert (small.block_b, small.block_h, small.block_q, small.block_k) == (2, 2, 37, 45)
        for b, hq, hkv, l, s, mask in [(1, 1, 1, 16384, 16384, False),
                                       (4, 32, 8, 16384, 16384, False),
                                       (2, 8, 8, 16384, 16384, True),
                                       (1, 256, 1, 8192, 8192, False),
                                       (1, 8, 8, 1, 1_000_000, False),
                                       (1, 1, 1, 100_000, 64, False)]:
            for causal in (False, True):
                cfg = config(spec, b, hq, hkv, l, s, causal, mask)
                assert cfg.body is Body.BATCHED
                rows = cfg.block_b * cfg.block_h * (hq // hkv) * cfg.block_q
                assert rows * cfg.block_k * 4 <= 4 * 2**20, (b, hq, hkv, l, s, causal, cfg)
                assert cfg.block_q >= min(l, 8) and cfg.block_k >= min(s, 64), cfg


# ---------------------------------------------------------------------------
# tpu_interpret: the pipelined TPU body, 2 TensorCores, races detected

# 16-row query blocks so that the tiny cases take several blocks each way.
TPU_SMALL = AttentionConfig(Body.PIPELINED, block_q=16, block_k=128,
                            head_multiple=attention_blocks.LANES)

TPU_CASES = {
    # dk/dv's grid (1, 1, 2, 2 * 2) splits the key blocks over the cores;
    # dropout's mask hashed per (16-row, 128-key) block from global indices.
    "gqa_causal_bf16_f32_heads_mask_dropout": dict(b=1, hq=2, hkv=1, l=24, s=150, e=8,
                                                   causal=True, mask="heads",
                                                   dtype=torch.bfloat16,
                                                   mask_dtype=torch.float32, dropout_p=0.4),
    # B = Hq = 1: the 3 query blocks split unevenly over the cores.
    "one_head_causal_empty_rows": dict(b=1, hq=1, hkv=1, l=40, s=20, e=24, ev=8, causal=True,
                                       mask="empty_rows"),
}


# The backward's dq fused into the dk/dv kernel (a float32 accumulator of
# every query row of the key/value head, added to block by block), as a chip
# with VMEM to spare runs it, or in a kernel of its own. Fused, only (B, Hkv)
# splits over the TensorCores, and it runs fused only where the pairs divide
# evenly among them: the fused cases take two (batch, kv head) pairs.
FUSED_DQ = {"dq_fused": 2**20, "dq_apart": 0}


def two_pairs(kw):
    return {**kw, "b": 2} if "sequences" not in kw else {**kw, "hq": 4, "hkv": 2}


@pytest.mark.parametrize("fused_dq_bytes", FUSED_DQ.values(), ids=FUSED_DQ.keys())
@pytest.mark.parametrize("kw", TPU_CASES.values(), ids=TPU_CASES.keys())
def test_tpu_interpret_race_free(kw, fused_dq_bytes):
    config = dataclasses.replace(TPU_SMALL, fused_dq_bytes=fused_dq_bytes)
    case = make_case(**(two_pairs(kw) if fused_dq_bytes else kw))
    check("tpu_interpret", case, config=config, detect_races=True)


# 256-key blocks made 128 keys at a time (the sub-steps of the forward and
# of dk/dv, as on a chip): the mask, dropout's factors and the causal and
# padded keys by each sub-step's own key offset; 300 keys, so the last
# block is part padding.
TPU_SUB_STEPS = AttentionConfig(Body.PIPELINED, block_q=16, block_k=256, block_k_compute=128,
                                head_multiple=attention_blocks.LANES)


# Without a mask every row sees key 0 in its first sub-step, and the
# forward's running maxima go unguarded (never -inf); with one, a row may
# see nothing until a later sub-step, or at all.
SUB_STEP_CASES = {
    "mask_dropout": dict(mask="heads", mask_dtype=torch.float32, dropout_p=0.4),
    "unmasked": dict(),
}


@pytest.mark.parametrize("fused_dq_bytes", FUSED_DQ.values(), ids=FUSED_DQ.keys())
@pytest.mark.parametrize("extra", SUB_STEP_CASES.values(), ids=SUB_STEP_CASES.keys())
def test_tpu_interpret_key_sub_steps(fused_dq_bytes, extra):
    kw = dict(b=1, hq=2, hkv=1, l=24, s=300, e=8, causal=True, dtype=torch.bfloat16, **extra)
    config = dataclasses.replace(TPU_SUB_STEPS, fused_dq_bytes=fused_dq_bytes)
    case = make_case(**(two_pairs(kw) if fused_dq_bytes else kw))
    check("tpu_interpret", case, config=config, detect_races=True)


# 32-row query blocks, 16-key blocks: below the diagonal whole blocks that
# every query sees, on it blocks that cross it, above it blocks skipped (the
# grids walk only the listed visible steps); L != S and both ragged, so the
# last blocks are part padding.
TPU_CAUSAL = AttentionConfig(Body.PIPELINED, block_q=32, block_k=16,
                             head_multiple=attention_blocks.LANES)


@pytest.mark.parametrize("fused_dq_bytes", FUSED_DQ.values(), ids=FUSED_DQ.keys())
def test_tpu_interpret_causal_full_and_diagonal_blocks(fused_dq_bytes):
    case = make_case(b=2, hq=2, hkv=1, l=50, s=90, e=8, causal=True, dtype=torch.bfloat16)
    config = dataclasses.replace(TPU_CAUSAL, fused_dq_bytes=fused_dq_bytes)
    check("tpu_interpret", case, config=config, detect_races=True)


# 16 x 16 blocks: the span tables in SMEM pick the few blocks each query
# block (forward, dq) or key block (dk, dv) reaches.
TPU_SPANS = AttentionConfig(Body.PIPELINED, block_q=16, block_k=16,
                            head_multiple=attention_blocks.LANES)


@pytest.mark.parametrize("fused_dq_bytes", FUSED_DQ.values(), ids=FUSED_DQ.keys())
def test_tpu_interpret_spans_softcap_race_free(fused_dq_bytes):
    kw = dict(b=1, hq=2, hkv=1, l=40, s=44, e=8, softcap=2.0, mask="heads",
              sequences=[(5, 7), (0, 3), (9, 9), (6, 4), (12, 9)], causal=True,
              dtype=torch.bfloat16, mask_dtype=torch.float32)
    case = make_case(**(two_pairs(kw) if fused_dq_bytes else kw))
    config = dataclasses.replace(TPU_SPANS, fused_dq_bytes=fused_dq_bytes)
    check("tpu_interpret", case, config=config, detect_races=True)


@pytest.mark.parametrize("fused_dq_bytes", FUSED_DQ.values(), ids=FUSED_DQ.keys())
def test_tpu_interpret_skips_the_blocks_no_span_reaches(fused_dq_bytes):
    case = packed_with_gaps(**({"hq": 4, "hkv": 2} if fused_dq_bytes else {}))
    config = dataclasses.replace(TPU_SPANS, fused_dq_bytes=fused_dq_bytes)
    check("tpu_interpret", case, config=config, run_on=unreachable_blocks_poisoned(case))


# A window's spans as its `window` parameter (attention_shapes.py): the
# pipelined kernels mask from the indices and step through only the blocks a
# window reaches (forward and dq: key blocks; dk/dv: query blocks of each
# query head), fewer than all in every case bounded on both sides. Ragged L
# != S, so the last blocks are part padding; rows past S + left see nothing;
# a window open to the right steps through every block.
TPU_WINDOWS = {
    "both_sides_gqa_l_gt_s_bf16": dict(b=1, hq=2, hkv=1, l=78, s=69, e=8, window=(20, 3),
                                       dtype=torch.bfloat16),
    "causal_softcap_mask_dropout": dict(b=1, hq=2, hkv=1, l=50, s=61, e=8, window=(9, 0),
                                        causal=True, softcap=2.0, mask="heads",
                                        dropout_p=0.3, mask_dtype=torch.float32),
    "open_right": dict(b=1, hq=1, hkv=1, l=40, s=53, e=8, window=(7, -1)),
}


@pytest.mark.parametrize("fused_dq_bytes", FUSED_DQ.values(), ids=FUSED_DQ.keys())
@pytest.mark.parametrize("kw", TPU_WINDOWS.values(), ids=TPU_WINDOWS.keys())
def test_tpu_interpret_window_race_free(kw, fused_dq_bytes):
    case = make_case(**(two_pairs(kw) if fused_dq_bytes else kw))
    left, right = kw["window"]
    window = case.params["window"]
    assert window == (left, 0 if kw.get("causal") else right)  # causal folded in
    nq, nk = -(-kw["l"] // 16), -(-kw["s"] // 16)
    if right >= 0:  # the window's blocks, not all of them
        assert attention_blocks.window_reach(window, nq, 16, 16, nk) < nk
        assert attention_blocks.window_reach(window[::-1], nk, 16, 16, nq) < nq
    config = dataclasses.replace(TPU_SPANS, fused_dq_bytes=fused_dq_bytes)
    check("tpu_interpret", case, config=config, detect_races=True)


# A window at least a query block wide to the left: the forward takes each
# query block's diagonal key block first, every row sees its first key, and
# the running maxima go unguarded. 16 x 16 blocks, and 16-row blocks of
# 32 keys made 16 at a time (a query block may start mid key block); ragged
# L and S; softcap and dropout on the first.
TPU_DIAGONAL_FIRST = {
    "causal_softcap_dropout_bf16": (TPU_SPANS, dict(b=1, hq=2, hkv=1, l=75, s=75, e=8,
                                                    window=(20, 0), causal=True, softcap=2.0,
                                                    dropout_p=0.3, dtype=torch.bfloat16)),
    "both_sides_mid_block": (
        AttentionConfig(Body.PIPELINED, block_q=16, block_k=32, block_k_compute=16,
                        head_multiple=attention_blocks.LANES),
        dict(b=1, hq=2, hkv=2, l=70, s=77, e=8, window=(33, 2))),
}


@pytest.mark.parametrize("config, kw", TPU_DIAGONAL_FIRST.values(),
                         ids=TPU_DIAGONAL_FIRST.keys())
def test_tpu_interpret_window_diagonal_block_first(config, kw):
    case = make_case(**kw)
    window = case.params["window"]
    l, s = kw["l"], kw["s"]
    assert attention_blocks.rows_see_diagonal_key(window, -(-l // 16), 16, config.block_k, s)
    check("tpu_interpret", case, config=config, detect_races=True, backward=False)


@pytest.mark.parametrize("window, q_blocks, bq, bk, kv_len", [
    ((1023, 0), 8, 1024, 1024, 8192),  # v5e's L8192 window
    ((1022, 0), 8, 1024, 1024, 8192),  # a row short
    ((20, 3), 7, 16, 16, 90),          # rows past the keys (L > S)
    ((33, 2), 5, 16, 32, 77),          # query blocks starting mid key block
    ((30, 2), 5, 16, 32, 77),
    ((-1, 0), 4, 16, 16, 64),          # unbounded to the left
    ((7, -1), 3, 16, 16, 53),
])
def test_rows_see_diagonal_key(window, q_blocks, bq, bk, kv_len):
    """Against a count over every row: each row of each query block sees the
    first key of the key block holding the block's first row."""
    left, right = window

    def sees(row, key):
        return (key < kv_len and (left < 0 or key >= row - left)
                and (right < 0 or key <= row + right))

    counted = all(sees(row, i * bq // bk * bk)
                  for i in range(q_blocks) for row in range(i * bq, i * bq + bq))
    assert attention_blocks.rows_see_diagonal_key(window, q_blocks, bq, bk, kv_len) == counted


def test_reached_takes_the_leading_block_first():
    """With a leading block, a query block's reached blocks come that one
    first, then the rest in order, then the last of them again."""
    import jax.numpy as jnp

    table = jnp.asarray([[0, 2, 3, 5], [1, 4, 6, 6]], jnp.int32)  # [first, past) per block
    leading = [0, 3, 3, 5]
    want = [[0, 0, 0, 0], [3, 2, 2, 2], [3, 4, 5, 5], [5, 5, 5, 5]]
    for i in range(4):
        got = [int(attention_blocks.reached(table, i, j, leading[i])) for j in range(4)]
        assert got == want[i], (i, got)
        first, past = int(table[0, i]), int(table[1, i])
        assert [int(attention_blocks.reached(table, i, j)) for j in range(2)] == [
            first, min(first + 1, past - 1)]


def test_chip_config_sub_steps():
    """On a chip the forward takes a block's keys in its longer sub-steps only
    where its running maxima need no guard (no mask, no spans but a window
    a query block wide, its diagonal block first); the backward in its own."""
    compute = attention_blocks.CHIP_K_COMPUTE

    def chosen(params, masked=False, backward=False):
        return attention_blocks.chip_config("bfloat16", {"scale": 0.1, "causal": True, **params},
                                            masked=masked, backward=backward).block_k_compute

    assert chosen({}) == chosen({"softcap": 3.0}) == compute["forward_unguarded"]
    assert chosen({"spans": True, "window": (4095, 0)}) == compute["forward_unguarded"]
    for params, masked in (({}, True), ({"spans": True}, False),
                           ({"spans": True, "window": (7, 0)}, False),
                           ({"spans": True, "window": (4095, 0)}, True)):
        assert chosen(params, masked) == compute["forward"], (params, masked)
    assert chosen({}, backward=True) == compute["backward"]


def test_chip_config_narrow_window_blocks():
    """A window at most NARROW_WINDOW_KEYS wide takes blocks no larger than
    NARROW_WINDOW_BLOCKS, forward and backward; a wider or one-sided one,
    and a heavier load's smaller blocks, keep the load's."""
    narrow = attention_blocks.NARROW_WINDOW_BLOCKS

    def blocks(window, dtype="bfloat16", backward=False):
        params = attention_op.kernel_params(
            0.1, False, spans=True, window=window,
            span_width=attention_op.span_width(False, *window))
        c = attention_blocks.chip_config(dtype, params, masked=False, backward=backward)
        return c.block_q, c.block_k, c.block_k_compute

    widest = attention_blocks.NARROW_WINDOW_KEYS
    for backward in (False, True):
        assert blocks((widest - 1, 0), backward=backward)[:2] == narrow
        assert blocks((widest // 2 - 1, widest // 2), backward=backward)[:2] == narrow
        assert blocks((widest, 0), backward=backward)[:2] == (1024, 1024)
        assert blocks((5, -1), backward=backward)[:2] == (1024, 1024)
    # v5e's L8192 window of 1024 keys: every row sees its diagonal block's
    # first key, so the forward takes the whole 512 keys at once, unguarded
    assert blocks((1023, 0)) == (512, 512, 512)
    assert blocks((1023, 0), "float32", backward=True)[:2] == (512, 512)


def test_window_reach():
    """The blocks a window reaches, from query blocks (keys) and, mirrored,
    from key blocks (query rows), against a count over every row's keys."""
    reach = attention_blocks.window_reach
    assert reach((1023, 0), 8, 1024, 1024, 8) == 2  # v5e's L8192 window, 1024 blocks
    assert reach((1023, 0)[::-1], 8, 1024, 512, 16) == 4  # its dk/dv, 512-row blocks
    assert reach((7, -1), 4, 16, 16, 4) == 4 and reach((-1, 3), 4, 16, 16, 4) == 4
    for left, right, block, other in [(5, 0, 16, 16), (20, 3, 16, 32), (0, 0, 8, 8),
                                      (40, 17, 32, 16)]:
        n = 8
        counted = max(len({key // other for row in range(b * block, b * block + block)
                           for key in range(max(row - left, 0), row + right + 1)})
                      for b in range(n))
        assert reach((left, right), n, block, other, 64) >= counted, (left, right)
        assert reach((left, right), n, block, other, 64) <= counted + 1, (left, right)


@pytest.mark.parametrize("q_blocks, bq, bk, k_blocks", [
    (8, 1024, 1024, 8),  # v5e's L8192: 36 of 64 pairs
    (6, 512, 1024, 3),   # two query blocks a key block
    (3, 1024, 512, 8),   # keys past every row (S > L)
    (5, 384, 256, 9),
])
def test_causal_steps_list_exactly_the_visible_blocks(q_blocks, bq, bk, k_blocks):
    """The causal grids' steps against a count over every row and key: the
    forward's (query block, key block) pairs with a key some row sees; the
    backward's (key block, head, query block) steps likewise, heads in
    order, and one step per head for a key block no row sees."""
    sees = {(i, j) for i in range(q_blocks) for j in range(k_blocks)
            if any(key <= row for row in range(i * bq, i * bq + bq)
                   for key in range(j * bk, j * bk + bk))}
    forward = attention_blocks.causal_steps(q_blocks, bq, bk, k_blocks).tolist()
    assert list(zip(forward[0::2], forward[1::2])) == sorted(sees)
    group = 2
    backward = attention_blocks.causal_key_steps(k_blocks, bk, bq, q_blocks, group).tolist()
    steps = list(zip(backward[0::3], backward[1::3], backward[2::3]))
    expected = [(j, g, i) for j in range(k_blocks) for g in range(group)
                for i in (sorted(i for i, jj in sees if jj == j) or [q_blocks - 1])]
    assert steps == expected


# ---------------------------------------------------------------------------
# Lowered for a TPU (2 TensorCores): every primitive has a Mosaic lowering

LOWERED = {  # (dtype, Hkv, mask shape and dtype or None, causal, dropout_p[, spans and
    # softcap]), B=2, Hq=4, L=300, S=200
    "float32_gqa_causal": ("float32", 2, None, True, 0.0),
    "bfloat16_mqa_heads_mask_f32": ("bfloat16", 1, ((1, 4), "float32"), False, 0.0),
    "float16_batch_mask_causal_dropout": ("float16", 4, ((2, 1), "float16"), True, 0.1),
    "bfloat16_spans_softcap_dropout": ("bfloat16", 2, None, False, 0.1, True),
}


@pytest.mark.parametrize("dtype,hkv,mask,causal,dropout_p,spans",
                         [(*c, False)[:6] for c in LOWERED.values()], ids=LOWERED.keys())
def test_tpu_lowering(dtype, hkv, mask, causal, dropout_p, spans):
    import jax
    import jax.numpy as jnp

    from torch_pallas.kernels.tpu import attention, attention_backward

    jax_env.simulate_tpu_on_cpu()  # the chip's description, for the pipelines

    def aval(shape, dt):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dt))

    b, hq, l, s, e, ev = 2, 4, 300, 200, 64, 40
    fwd = [aval((b, hq, l, e), dtype), aval((b, hkv, s, e), dtype), aval((b, hkv, s, ev), dtype)]
    extra = [aval((*mask[0], l, s), mask[1])] if mask else []
    params = {"scale": 0.125, "causal": causal}
    backward_extra = list(extra)
    if spans:
        extra.append(aval((l, 2), "int32"))
        backward_extra += [aval((l, 2), "int32"), aval((s, 2), "int32")]
        params.update(spans=True, softcap=20.0)
    if dropout_p:
        for operands in (extra, backward_extra):
            operands.append(aval((b, hq, l), "int32"))
        params["dropout_p"] = dropout_p
    bwd = fwd + [aval((b, hq, l, ev), dtype)] * 2 + [aval((b, hq, l), "float32")] + backward_extra
    fwd = fwd + extra
    for spec, avals in ((attention.KERNEL, fwd), (attention_backward.KERNEL, bwd)):
        config = spec.config("tpu", tuple((a.shape, str(a.dtype)) for a in avals), params)
        assert config.body is Body.PIPELINED

        def f(*args, spec=spec, config=config):
            return spec.run(*args, **params, config=config, num_cores=2, interpret=None)

        text = jax.jit(f).trace(*avals).lower(lowering_platforms=("tpu",)).as_text()
        assert "tpu_custom_call" in text, "no Mosaic TPU kernel in the lowered module"


def test_unsupported_dtypes_are_refused_by_name():
    from torch_pallas.kernels.tpu import attention, attention_backward

    shape = (1, 2, 8, 16)
    for spec in (attention.KERNEL, attention_backward.KERNEL):
        assert spec.refusal("interpret", ((shape, "bfloat16"),) * 3, {}) is None
        reason = spec.refusal("tpu_interpret", ((shape, "float64"),) * 3, {})
        assert "backend 'tpu_interpret'" in reason and "float64" in reason
