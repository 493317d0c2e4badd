"""The Triton attention kernels (kernels/triton/attention.py and
attention_backward.py) against the float64 reference of
tests/attention_reference.py, in Triton's CPU interpreter where there is no
GPU (conftest.py): ragged lengths, decode, L > S causal, S = 1, GQA and
MQA, every mask kind, odd head dimensions, every dtype, dropout, key spans
(windows, packed sequences) and softcap; and their launches as
torch.compile records them (torch.library.wrap_triton)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from attention_reference import Case, bound, make_case, reference, run_kernel, torch_error
from helpers import assert_within
from torch_pallas.base import torch_compat
from torch_pallas.ops import attention_spans
from torch_pallas.kernels.triton import attention as forward_kernel
from torch_pallas.kernels.triton import attention_backward as backward_kernel
from torch_pallas.kernels.triton import interpreting

FORWARD = "torch_pallas.kernels.triton.attention"
BACKWARD = "torch_pallas.kernels.triton.attention_backward"

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# Where the kernels run: Triton's CPU interpreter (conftest.py sets it where
# there is no GPU), else the GPU.
DEVICE = torch.device("cpu" if interpreting() else "cuda")


def to_device(t: torch.Tensor) -> torch.Tensor:
    """t on DEVICE in the same layout (strides, offset, stride-0 dimensions)."""
    if t.device == DEVICE:
        return t
    storage = torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)
    return storage.to(DEVICE).as_strided(t.shape, t.stride(), t.storage_offset())


def launch(module: str, inputs, config=None, **params):
    """A kernel file's outputs, on the CPU, for `inputs` on DEVICE: as the
    triton backend runs it (tests/attention_reference.py, run_kernel), or
    with an explicit config."""
    inputs = tuple(to_device(t) for t in inputs)
    if config is None:
        out = run_kernel(module, "triton", inputs, **params)
    else:
        run = forward_kernel.attention if module == FORWARD else backward_kernel.attention_backward
        out = run(*inputs, **params, config=config)
    return tuple(t.cpu() for t in out)

# (id, make_case keywords): each a ragged canonical call.
CASES = [
    ("ragged", dict(l=37, s=45, e=32)),
    ("causal", dict(l=37, s=45, e=32, causal=True, dtype=F16)),
    ("decode", dict(l=1, s=45, e=64, dtype=BF16)),
    ("causal-L>S", dict(l=50, s=20, e=32, causal=True, dtype=BF16)),
    ("S=1", dict(l=37, s=1, e=32, dtype=F16)),
    ("S=1-mask", dict(l=9, s=1, e=32, mask="full")),  # rows with no key at all
    ("mqa-heads-mask", dict(hkv=1, mask="heads", dtype=F16)),
    ("full-mask-f32-mask", dict(mask="full", mask_dtype=F32, dtype=BF16)),
    ("batch-mask", dict(hq=2, hkv=2, mask="batch", causal=True)),
    ("shared-mask-causal", dict(mask="shared", causal=True, dtype=F16, mask_dtype=F32)),
    ("empty-rows", dict(mask="empty_rows", dtype=BF16)),
    ("empty-rows-f32", dict(mask="empty_rows", l=20, s=30, causal=True)),
    ("E40-Ev24", dict(e=40, ev=24, causal=True)),
    ("E24-Ev40-bf16", dict(e=24, ev=40, dtype=BF16, mask="batch")),
    ("E128", dict(b=1, hq=2, hkv=1, l=20, s=33, e=128, dtype=BF16)),
    ("E128-f32", dict(b=1, hq=2, hkv=2, l=20, s=33, e=128, causal=True)),
]


def lse_bound(ref_lse: torch.Tensor) -> torch.Tensor:
    """Scores and their log-sum-exp are float32 sums in every dtype."""
    return 1e-4 + 1e-5 * ref_lse.abs()


def check_forward(case, o, lse):
    ref, errors = torch_error(case)
    what = f"attention (triton) {case.q.dtype}"
    assert o.dtype == case.q.dtype and lse.dtype == torch.float32
    assert_within(o, ref[0], bound(errors[0], case.q.dtype), f"{what}: o")
    ref_lse = ref[1]
    hidden = torch.isinf(ref_lse)
    assert torch.equal(lse == float("inf"), hidden), f"{what}: lse is +inf exactly where no key is visible"
    assert_within(lse[~hidden], ref_lse[~hidden], lse_bound(ref_lse[~hidden]), f"{what}: lse")


@pytest.mark.parametrize("kwargs", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_forward_matches_float64(kwargs):
    case = make_case(**kwargs)
    o, lse = launch(FORWARD, case.inputs, **case.params)
    check_forward(case, o, lse)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, F16])
def test_forward_head_dim_256(dtype):
    case = make_case(b=1, hq=2, hkv=1, l=17, s=40, e=256, ev=200, dtype=dtype, mask="shared")
    o, lse = launch(FORWARD, case.inputs, scale=case.scale, causal=case.causal)
    check_forward(case, o, lse)


SMALL_BLOCKS = forward_kernel.AttentionConfig(autotune=False, block_m=16, block_n=16)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_walks_many_key_blocks(causal):
    """Seven key blocks per row block: the online softmax rescales its
    running sums many times; causal rows stop at the diagonal."""
    case = make_case(b=1, hq=2, hkv=1, l=100, s=100, e=32, causal=causal, mask="full",
                     dtype=F16, mask_dtype=F32)
    o, lse = launch(FORWARD, case.inputs, SMALL_BLOCKS, scale=case.scale, causal=causal)
    check_forward(case, o, lse)


def test_forward_reads_any_layout_in_place():
    """q, k, v in the (B, L, H, E) layout transformers uses, a mask expanded
    from one (L, S) matrix (stride 0) and a scale that is not 1/sqrt(E)."""
    b, hq, hkv, l, s, e = 2, 4, 2, 21, 30, 40
    q = torch.randn(b, l, hq, e).transpose(1, 2)
    k = torch.randn(b, s, hkv, e).transpose(1, 2)
    v = torch.randn(b, s, hkv, e + 8)[..., :e].transpose(1, 2)  # a slice: padded rows
    mask = torch.randn(l, s).masked_fill(torch.rand(l, s) < 0.3, float("-inf"))
    mask = mask.expand(b, hq, l, s)
    case = Case(q, k, v, mask, causal=True, scale=0.37)
    o, lse = launch(FORWARD, case.inputs, scale=case.scale, causal=True)
    check_forward(case, o, lse)


def test_forward_float32_mask_on_16_bit_q_is_read_as_float32():
    """A float32 mask keeps values a 16-bit one would round away."""
    case = make_case(l=8, s=24, dtype=BF16, mask="shared", mask_dtype=F32)
    case.mask = case.mask + 1e-3 * torch.randn(case.mask.shape)  # not representable in bfloat16
    o, lse = launch(FORWARD, case.inputs, scale=case.scale, causal=False)
    check_forward(case, o, lse)


def random_do(case) -> torch.Tensor:
    return torch.randn(case.q.shape[:-1] + case.v.shape[-1:]).to(case.q.dtype)


def check_backward(case, do, grads):
    ref, errors = torch_error(case, do)
    for name, grad, expected, torch_err, like in zip(
            ("dq", "dk", "dv"), grads, ref[2], errors[1:], (case.q, case.k, case.v)):
        assert grad.dtype == like.dtype and grad.shape == like.shape, name
        assert_within(grad, expected, bound(torch_err, case.q.dtype),
                      f"attention backward (triton) {case.q.dtype}: {name}")


def run_backward(case, do, config=None, forward_config=None):
    """The forward's o and lse, then the backward kernel on them."""
    o, lse = launch(FORWARD, case.inputs, forward_config, **case.params)
    inputs = (case.q, case.k, case.v, o, do, lse) + case.backward_extra
    return launch(BACKWARD, inputs, config, **case.params)


@pytest.mark.parametrize("kwargs", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_backward_matches_float64(kwargs):
    case = make_case(**kwargs)
    do = random_do(case)
    check_backward(case, do, run_backward(case, do))


@pytest.mark.parametrize("causal", [False, True])
def test_backward_walks_many_blocks(causal):
    """Seven query blocks per key block (times G = 2 heads) and seven key
    blocks per query block; causal blocks start or stop at the diagonal."""
    case = make_case(b=1, hq=2, hkv=1, l=100, s=90, e=32, causal=causal, mask="heads",
                     dtype=F16, mask_dtype=F32)
    do = random_do(case)
    config = backward_kernel.AttentionBackwardConfig(autotune=False, block_m=16, block_n=16)
    check_backward(case, do, run_backward(case, do, config))


def test_dropout_mask_is_independent_of_the_blocks():
    """Dropout with 16 x 16 blocks (not the default 32): the mask is a hash
    of global indices, so the kernels still drop what the reference drops
    (ragged, causal, GQA, a per-head mask; forward and backward)."""
    case = make_case(b=1, hq=2, hkv=1, l=50, s=41, e=24, causal=True, mask="heads",
                     dtype=F16, dropout_p=0.4)
    o, lse = launch(FORWARD, case.inputs, SMALL_BLOCKS, **case.params)
    check_forward(case, o, lse)
    do = random_do(case)
    config = backward_kernel.AttentionBackwardConfig(autotune=False, block_m=16, block_n=16)
    check_backward(case, do, run_backward(case, do, config, SMALL_BLOCKS))


def test_backward_reads_any_layout_in_place():
    """Transposed q, k, v, o, do, a stride-0 mask and a strided lse."""
    b, hq, hkv, l, s, e = 2, 4, 2, 21, 30, 40
    q = torch.randn(b, l, hq, e).transpose(1, 2)
    k = torch.randn(b, s, hkv, e).transpose(1, 2)
    v = torch.randn(b, s, hkv, e + 8)[..., :e].transpose(1, 2)
    mask = torch.randn(l, s).masked_fill(torch.rand(l, s) < 0.3, float("-inf")).expand(b, hq, l, s)
    case = Case(q, k, v, mask, causal=False, scale=0.37)
    o, lse = launch(FORWARD, case.inputs, scale=case.scale, causal=False)
    o = o.transpose(1, 2).contiguous().transpose(1, 2)
    lse = torch.stack([lse, lse], dim=-1)[..., 0]  # stride 2 along L
    do = torch.randn(b, l, hq, e).transpose(1, 2)
    grads = launch(BACKWARD, (q, k, v, o, do, lse, mask), scale=case.scale, causal=False)
    check_backward(case, do, grads)


# (id, make_case keywords): key spans (windows with causal folded in as the
# op layer folds it, packed sequences aligned bottom-right) and softcap,
# alone and with a mask, dropout and GQA.
SPAN_CASES = [
    # top-left window, causal folded, L > S: rows past S + 5 see nothing
    ("window-5-0-causal-L>S", dict(l=50, s=40, e=32, window=(5, 0), causal=True, dtype=F16)),
    ("window-3-2-L<S", dict(l=40, s=70, e=24, window=(3, 2), dtype=BF16)),
    # an empty sequence, Lq > Lk (rows that see nothing, bottom-right
    # causal), Lq < Lk, and rows and keys past the last sequence
    ("packed-causal", dict(b=1, l=80, s=70, e=32, causal=True,
                           sequences=[(12, 15), (0, 6), (20, 9), (7, 18)])),
    ("packed-window-bf16", dict(b=1, hq=2, hkv=1, l=60, s=64, e=16, window=(6, 3),
                                sequences=[(25, 30), (0, 0), (20, 20)], dtype=BF16)),
    ("softcap", dict(l=37, s=45, e=32, scale=0.5, softcap=2.0, dtype=F16)),
    # -inf scores of a mask and causal rows: 1 - t² is taken unmasked
    ("softcap-causal-empty-rows", dict(l=30, s=40, e=32, mask="empty_rows", causal=True,
                                       softcap=1.5)),
    ("softcap-spans-gqa", dict(hq=4, hkv=2, l=45, s=40, e=64, window=(8, 8), softcap=3.0,
                               dtype=BF16)),
    ("spans-mask", dict(l=40, s=45, e=32, window=(6, 1), mask="heads", dtype=F16,
                        mask_dtype=F32)),
    ("spans-dropout", dict(l=40, s=50, e=32, window=(10, 0), causal=True, dropout_p=0.3)),
]


@pytest.mark.parametrize("kwargs", [c[1] for c in SPAN_CASES], ids=[c[0] for c in SPAN_CASES])
def test_spans_and_softcap_forward_match_float64(kwargs):
    case = make_case(**kwargs)
    o, lse = launch(FORWARD, case.inputs, **case.params)
    check_forward(case, o, lse)


@pytest.mark.parametrize("kwargs", [c[1] for c in SPAN_CASES], ids=[c[0] for c in SPAN_CASES])
def test_spans_and_softcap_backward_match_float64(kwargs):
    case = make_case(**kwargs)
    do = random_do(case)
    check_backward(case, do, run_backward(case, do))


SMALL_BACKWARD_BLOCKS = backward_kernel.AttentionBackwardConfig(autotune=False, block_m=16,
                                                                block_n=16)


def test_spans_walk_and_straddle_many_small_blocks():
    """A (7, 3) window over 100 rows with 16 x 16 blocks: each block visits
    two or three of the seven blocks across, most of them straddling a
    row's span edge (forward, dq and dk/dv), softcapped and dropped, GQA."""
    case = make_case(b=1, hq=2, hkv=1, l=100, s=96, e=32, window=(7, 3), softcap=4.0,
                     dropout_p=0.3, dtype=F16)
    o, lse = launch(FORWARD, case.inputs, SMALL_BLOCKS, **case.params)
    check_forward(case, o, lse)
    do = random_do(case)
    check_backward(case, do, run_backward(case, do, SMALL_BACKWARD_BLOCKS, SMALL_BLOCKS))


def test_spans_skip_the_blocks_they_never_reach():
    """Packed sequences whose keys 0..25 and 70..109 no row sees (the first
    sequence's window starts past its first keys, the last keys are
    padding): k and v are NaN there, whole 16-key blocks of them, and the
    kernels give the reference's results (dk, dv 0 there) all the same,
    so they never read them: they skip the blocks and mask the loads of
    those they straddle."""
    case = make_case(b=1, hq=2, hkv=1, l=60, s=110, e=32, window=(4, 0), softcap=5.0,
                     sequences=[(20, 50), (25, 20)], dtype=BF16)
    seen = attention_spans.visible(case.spans, 110).any(0)
    assert not seen[:26].any() and seen[26:70].all() and not seen[70:].any()
    nan_k, nan_v = (t.clone().index_fill_(2, (~seen).nonzero()[:, 0], float("nan"))
                    for t in (case.k, case.v))
    inputs = (case.q, nan_k, nan_v, case.spans)
    o, lse = launch(FORWARD, inputs, SMALL_BLOCKS, **case.params)
    check_forward(case, o, lse)
    do = random_do(case)
    grads = launch(BACKWARD, (case.q, nan_k, nan_v, o, do, lse, case.spans, case.key_spans),
                   SMALL_BACKWARD_BLOCKS, **case.params)
    check_backward(case, do, grads)


def blocks_visited(spans: torch.Tensor, rows: int, cols: int) -> int:
    """The column blocks (of `cols`) each row block (of `rows`) visits under
    `spans`, summed: from the one holding the first row's start to the one
    holding the last row's end, none where that range is empty."""
    total = 0
    for first_row in range(0, spans.shape[0], rows):
        start = int(spans[first_row, 0])
        end = int(spans[min(first_row + rows, spans.shape[0]) - 1, 1])
        total += -(-end // cols) - start // cols if end > start else 0
    return total


@pytest.mark.skipif(not interpreting(), reason="counts the interpreter's products")
def test_spans_work_scales_with_the_keys_attended(monkeypatch):
    """The products the kernels compute (counted in the interpreter) are
    those of the blocks the spans reach, under half the dense count for a
    (7, 3) window over 96 x 96: forward two per (query block, key block),
    dq three, dk/dv four per (key block, query block, query head)."""
    from triton.runtime import interpreter

    dots = []
    create_dot = interpreter.InterpreterBuilder.create_dot
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot",
                        lambda self, *args: dots.append(1) or create_dot(self, *args))
    case = make_case(b=1, hq=2, hkv=1, l=96, s=96, e=16, window=(7, 3))
    query_blocks = blocks_visited(case.spans, 16, 16)
    key_blocks = blocks_visited(case.key_spans, 16, 16)
    assert query_blocks == key_blocks == 16 < 36 // 2  # 36 dense
    o, lse = launch(FORWARD, case.inputs, SMALL_BLOCKS, **case.params)
    assert len(dots) == 2 * 2 * query_blocks
    dots.clear()
    launch(BACKWARD, (case.q, case.k, case.v, o, random_do(case), lse) + case.backward_extra,
           SMALL_BACKWARD_BLOCKS, **case.params)
    assert len(dots) == 3 * 2 * query_blocks + 4 * 2 * key_blocks


WRAP_CASES = {
    "mask-causal": dict(l=20, s=27, e=40, ev=24, mask="heads", causal=True, dtype=F16),
    "spans-softcap-mask": dict(l=20, s=27, e=40, ev=24, mask="heads", window=(4, 2),
                               softcap=2.5, dtype=F16),
}


@pytest.mark.parametrize("kwargs", WRAP_CASES.values(), ids=WRAP_CASES.keys())
def test_wrap_triton_runs_the_same_kernels(kwargs):
    """Each kernel object is one torch.library.wrap_triton accepts, through
    the launch the ops use under a trace (torch_compat.wrap_triton: the
    interpreter's kernels, which torch 2.11 refuses, as they are): launched
    through it (eagerly, as outside a trace) they give the launchers'
    results bit for bit."""
    case = make_case(**kwargs)
    do = random_do(case)
    forward_config = forward_kernel.AttentionConfig.default("triton")
    backward_config = backward_kernel.AttentionBackwardConfig.default("triton")
    q, k, v, do = map(to_device, (case.q, case.k, case.v, do))
    extra = tuple(map(to_device, case.extra))
    backward_extra = tuple(map(to_device, case.backward_extra))
    results = []
    for wrap in (backward_kernel.direct, torch_compat.wrap_triton):
        o, lse = forward_kernel.attention(q, k, v, *extra, **case.params,
                                          config=forward_config, wrap=wrap)
        grads = backward_kernel.attention_backward(
            q, k, v, o, do, lse, *backward_extra, **case.params,
            config=backward_config, wrap=wrap)
        results.append(tuple(t.cpu() for t in (o, lse, *grads)))
    for direct, wrapped in zip(*results):
        assert torch.equal(direct, wrapped)
    check_forward(case, *results[0][:2])


# Traces the launchers on fake CUDA tensors (no GPU needed; Triton compiled,
# not interpreted): every launch must be recorded as a Triton kernel, for the
# fixed config and the autotuned one.
TRACE = textwrap.dedent(
    """
    import torch
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_pallas.kernels.triton import attention as fwd, attention_backward as bwd

    def name(kernel):
        while not hasattr(kernel, "__name__"):
            kernel = kernel.fn
        return kernel.__name__

    # Without and with spans and softcap (the backward takes key_spans too).
    for autotune, spans in ((False, False), (True, False), (False, True), (True, True)):
        def f(q, k, v, mask, do, spans_t, key_spans_t):
            wrap = torch.library.wrap_triton
            params = dict(spans=True, softcap=30.0) if spans else {}
            fwd_extra = (mask, spans_t) if spans else (mask,)
            bwd_extra = (mask, spans_t, key_spans_t) if spans else (mask,)
            o, lse = fwd.attention(q, k, v, *fwd_extra, scale=0.3, causal=not spans, **params,
                                   config=fwd.AttentionConfig(autotune=autotune), wrap=wrap)
            return bwd.attention_backward(
                q, k, v, o, do, lse, *bwd_extra, scale=0.3, causal=not spans, **params,
                config=bwd.AttentionBackwardConfig(autotune=autotune), wrap=wrap)
        with FakeTensorMode():
            q = torch.randn(2, 4, 37, 40, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(2, 2, 45, 40, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(2, 2, 45, 24, device="cuda", dtype=torch.bfloat16)
            mask = torch.randn(1, 4, 37, 45, device="cuda")
            do = torch.randn(2, 4, 37, 24, device="cuda", dtype=torch.bfloat16)
            spans_t = torch.zeros(37, 2, device="cuda", dtype=torch.int32)
            key_spans_t = torch.zeros(45, 2, device="cuda", dtype=torch.int32)
            gm = make_fx(torch.func.functionalize(f))(q, k, v, mask, do, spans_t, key_spans_t)
        print("GRAPH", autotune, spans, gm.code.count("triton_kernel_wrapper_functional("),
              "aten.empty" in gm.code,
              sum(n.op == "call_function" and "empty" not in str(n.target)
                  and "getitem" not in str(n.target) and "copy_" not in str(n.target)
                  and "triton_kernel" not in str(n.target) for n in gm.graph.nodes))
    # (A trace may record one kernel more than once.)
    print("KERNELS", *sorted({f"{name(k)}:{type(k).__name__}" for k in
                              map(kernel_side_table.get_kernel,
                                  range(len(kernel_side_table.id_to_kernel)))}))
    """
)


def test_launches_trace_into_triton_kernels_on_cuda_tensors():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", TRACE], env=env, check=True,
                         capture_output=True, text=True).stdout
    graphs = [line.split()[1:] for line in out.splitlines() if line.startswith("GRAPH")]
    # One kernel per launch (forward; delta, dk/dv, dq), nothing but
    # allocations beside them.
    assert graphs == [[autotune, spans, "4", "True", "0"] for autotune, spans in (
        ("False", "False"), ("True", "False"), ("False", "True"), ("True", "True"))], out
    kernels = next(line.split()[1:] for line in out.splitlines() if line.startswith("KERNELS"))
    assert kernels == [
        "attention_delta_kernel:JITFunction",
        "attention_dkdv_kernel:Autotuner", "attention_dkdv_kernel:JITFunction",
        "attention_dq_kernel:Autotuner", "attention_dq_kernel:JITFunction",
        "attention_kernel:Autotuner", "attention_kernel:JITFunction",
    ], out


HEAD_TILES = (16, 32, 64, 128, 256)


@pytest.mark.parametrize("itemsize", [2, 4], ids=["16-bit", "float32"])
def test_autotune_candidates_fit_every_head_tile(itemsize):
    """Per head tile, the autotuner is offered only configs whose estimated
    shared memory and registers fit, always including the smallest (which
    fits every GPU since Ampere), and never the 128-row tiles a 256-wide
    float32 head cannot hold."""
    smallest = {"BLOCK_M": 16, "BLOCK_N": 16}
    for choose in (forward_kernel.forward_configs, backward_kernel.dkdv_configs,
                   backward_kernel.dq_configs):
        for block_e in HEAD_TILES:
            for block_ev in HEAD_TILES:
                configs = choose(block_e, block_ev, itemsize)
                assert configs[-1].kwargs == smallest, (choose.__name__, block_e, block_ev)
                if max(block_e, block_ev) <= 64 and itemsize == 2:
                    assert len(configs) >= 6, (choose.__name__, block_e, block_ev)
    wide = forward_kernel.forward_configs(256, 256, 4)
    assert all(c.kwargs["BLOCK_M"] < 128 for c in wide)
    assert any(c.kwargs["BLOCK_M"] == 128 for c in forward_kernel.forward_configs(64, 64, 2))


def test_autotuned_launches_share_one_autotuner_per_head_tile():
    """Autotuning state (the timings) is kept per head tile and operand size."""
    get = forward_kernel.attention_kernel_autotuned
    assert get(64, 64, 2) is get(64, 64, 2)
    assert get(64, 64, 2) is not get(64, 64, 4)
    assert get(64, 64, 2).fn is forward_kernel.attention_kernel
    assert backward_kernel.attention_dq_kernel_autotuned(128, 64, 2).fn is \
        backward_kernel.attention_dq_kernel


@pytest.mark.slow
def test_kernels_compile_for_the_gpu():
    """Each kernel compiles for a Hopper GPU as the launchers call it
    (tests/triton_builds.py; the interpreter never type-checks the kernels
    as the compiler does), forward and backward, in every dtype, with a
    mask and dropout, causal with softcap, a window's spans, and none; the
    smallest autotune config fits any GPU's shared memory."""
    import triton_builds

    result = triton_builds.run_subprocess(None, check="attention_options", timeout=600)
    assert triton_builds.launched(result) == {
        (name, dtype) for dtype in ("bfloat16", "float32", "float16")
        for name in ("attention_kernel", "attention_dkdv_kernel", "attention_dq_kernel",
                     "attention_delta_kernel")}, result["kernels"]
    shared = [(k["kernel"], k["dtype"], k["shared"]) for k in result["kernels"]]
    assert all(size <= 99 * 1024 for *_, size in shared), shared  # shared memory of any GPU
