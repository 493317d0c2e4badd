"""JAX's own shipped Pallas kernels as torch ops (examples/jax_kernels.py):
outputs and gradients (from JAX's autodiff, the kernels' custom_vjp rules)
against torch autograd of float64 torch references, eagerly and under
torch.compile(fullgraph=True), opcheck, and the optional arguments and
quantized caches JAX's own tests pass (tests/pallas/gpu_ops_test.py,
gpu_paged_attention_test.py, tpu_gmm_test.py, tpu_paged_attention_kernel_test.py
in jax-ml/jax).

Tolerances are relative to each value and to the values' scale (their
largest magnitude). In float32 the kernels accumulate in float32 over at most
a few hundred terms; their errors against float64 measured 1e-7..3e-6 of the
scale, so 1e-4 leaves margin and still catches any wrong mask, scale or block
(those are O(1)). 16-bit cases round every output and the kernels' internal
products (the attention backward multiplies probabilities and their
gradients in the inputs' dtype) to 8 or 11 mantissa bits: 3e-2; bfloat16
flash attention's gradients measured 1% of the scale, 1-2.5x torch's own
scaled_dot_product_attention in bfloat16. TPU paged attention reads
unquantized pages as bfloat16 whatever their dtype, so its reference gets
bfloat16-rounded pages.

Sizes are the kernels' smallest valid ones with ragged dimensions where the
kernel allows them; where it does not, the test says so."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_within

import torch_pallas


def _load_example(name):
    if name not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


jk = _load_example("jax_kernels")

F32 = 1e-4
LOW = 3e-2


def close(out, ref, tol, what):
    """|out - ref| <= tol * (|ref| + the values' scale, max |ref| or 1)."""
    assert out.shape == ref.shape, what
    ref = ref.double()
    assert_within(out, ref, tol * (ref.abs() + max(1.0, ref.abs().max().item())), what)


def float64_leaves(tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


def check_op_and_gradients(op, reference, params, tol=F32, what="", opcheck=None, compiled=False):
    """op(*params) and its gradients against reference(*float64 params) and
    torch autograd of it, for a random cotangent, eagerly and (`compiled`)
    under torch.compile(fullgraph=True) too; then, if given,
    `opcheck` = (op overload, args, kwargs) through torch.library.opcheck, on
    the same inputs (so the same compiled kernels) with and without
    requires_grad."""
    leaves = float64_leaves(params)
    ref = reference(*leaves)
    grad = torch.randn(ref.shape).to(params[0].dtype)
    ref_grads = torch.autograd.grad(ref, leaves, grad.double())
    for how, run in [("eager", op)] + compiled * [("compiled", torch.compile(op, fullgraph=True))]:
        out = run(*params)
        grads = torch.autograd.grad(out, params, grad.to(out.dtype))
        assert out.dtype == params[0].dtype
        close(out, ref, tol, f"{what} {how} forward")
        for i, (g, e) in enumerate(zip(grads, ref_grads)):
            assert g.dtype == params[i].dtype
            close(g, e, tol, f"{what} {how} gradient of argument {i}")
    if opcheck is not None:
        run_opcheck(*opcheck)


def run_opcheck(overload, args, kwargs=None):
    torch.library.opcheck(overload, args, kwargs)
    detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    torch.library.opcheck(overload, detached, kwargs)


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape) * scale).to(dtype).requires_grad_()


def sorted_segments(batch, length, count=3):
    """Random segment ids, contiguous runs (packed sequences)."""
    return torch.randint(0, count, (batch, length), dtype=torch.int32).sort(-1).values


def flash_blocks(block_q, block_k=128):
    return jk.FlashBlockSizes(
        block_q=block_q, block_k_major=block_k, block_k=block_k, block_b=1,
        block_q_major_dkv=block_q, block_k_major_dkv=block_k, block_k_dkv=block_k,
        block_q_dkv=block_q, block_k_major_dq=block_k, block_k_dq=block_k, block_q_dq=block_q)


def group_sizes(m, groups):
    """Random group sizes summing to m, zero-sized groups possible."""
    ends = torch.randint(0, m + 1, (groups - 1,)).sort().values
    ends = torch.cat([torch.zeros(1, dtype=torch.long), ends, torch.tensor([m])])
    return ends.diff().to(torch.int32)


# -- layer norm (ops/gpu/layer_norm.py) -------------------------------------

@pytest.mark.parametrize("shape", [(37, 100), pytest.param((2, 3, 5, 384),
                                                          marks=pytest.mark.exhaustive)], ids=str)
def test_layer_norm(shape):
    x, w, b = randn(*shape), randn(shape[-1]), randn(shape[-1])
    check_op_and_gradients(lambda x, w, b: jk.layer_norm(x, w, b, 1e-5),
                           lambda x, w, b: jk.layer_norm_reference(x, w, b, 1e-5), [x, w, b],
                           opcheck=(torch.ops.jax_kernels.layer_norm.default, (x, w, b, 1e-5)),
                           compiled=shape == (37, 100))


@pytest.mark.exhaustive
def test_layer_norm_bfloat16():
    x, w, b = (randn(*s, dtype=torch.bfloat16) for s in ((2, 7, 64), (64,), (64,)))
    check_op_and_gradients(jk.layer_norm, jk.layer_norm_reference, [x, w, b], tol=LOW)


# -- flash attention, GPU (ops/gpu/attention.py mha) ------------------------

MHA_CASES = {
    # JAX's test: segment ids (packed sequences) and causal; JAX's default
    # blocks (one 64-row forward block here, 32-row backward blocks).
    "segments-causal": dict(shape=(2, 64, 2, 32), blocks=None, causal=True, segments=True),
    # Ragged sequence and head_dim (not a power of 2): one block covers the
    # sequence; blocks must divide it (backward blocks too: see the example).
    "ragged": dict(shape=(1, 37, 2, 20), blocks=(64,) * 6, causal=False, segments=False),
    "float16": dict(shape=(1, 64, 1, 32), blocks=(32,) * 6, causal=True, segments=False,
                    dtype=torch.float16, marks=pytest.mark.exhaustive),
}


@pytest.mark.parametrize("case", [pytest.param(k, marks=v.pop("marks", ()))
                                  for k, v in MHA_CASES.items()])
def test_mha(case):
    c = MHA_CASES[case]
    dtype = c.get("dtype", torch.float32)
    q, k, v = (randn(*c["shape"], dtype=dtype) for _ in range(3))
    seg = sorted_segments(c["shape"][0], c["shape"][1]) if c["segments"] else None
    blocks = c["blocks"] and jk.MhaBlockSizes(*c["blocks"])
    check_op_and_gradients(
        lambda q, k, v: jk.mha(q, k, v, seg, 0.3, c["causal"], blocks),
        lambda q, k, v: jk.mha_reference(q, k, v, seg, 0.3, c["causal"]),
        [q, k, v], tol=F32 if dtype == torch.float32 else LOW,
        # The op's schema takes no BlockSizes object (custom_op's callable does).
        opcheck=None if blocks else (torch.ops.jax_kernels.mha.default,
                                     (q, k, v, seg, 0.3, c["causal"])),
        compiled=case == "segments-causal")


def test_mha_keeps_the_kernels_log_sum_exp_for_the_backward():
    q, k, v = (torch.randn(1, 32, 2, 16) for _ in range(3))
    out, *residuals = torch.ops.jax_kernels.mha__forward(q, k, v, jax_residuals=True)
    # The forward kernel's lse, (batch, heads, seq) float32, saved for the backward.
    assert any(r.shape == (1, 2, 32) and r.dtype == torch.float32 for r in residuals)
    assert out.shape == q.shape


# -- flash attention, TPU (ops/tpu/flash_attention.py) ----------------------

def test_flash_attention_with_bias_segments_and_causal():
    """q length ragged (40, one q block); kv length a multiple of 128, which
    the kernel requires (lane-sized kv blocks); head_dim 24."""
    batch, heads, q_len, kv_len, d = 2, 2, 40, 128, 24
    q = randn(batch, heads, q_len, d)
    k, v = randn(batch, heads, kv_len, d), randn(batch, heads, kv_len, d)
    ab = randn(batch, heads, q_len, kv_len)
    kv_seg = sorted_segments(batch, kv_len)
    q_seg = kv_seg[:, :q_len].contiguous()  # query i sees key i: no row is fully masked
    blocks = flash_blocks(q_len)
    check_op_and_gradients(
        lambda q, k, v, ab: jk.flash_attention(q, k, v, ab, q_seg, kv_seg, True, 0.4, blocks),
        lambda q, k, v, ab: jk.flash_attention_reference(q, k, v, ab, q_seg, kv_seg, True, 0.4),
        [q, k, v, ab], compiled=True)  # compiled with the BlockSizes object


def test_flash_attention_with_jaxs_default_blocks():
    q, k, v, ab = (randn(1, 2, 128, s) for s in (32, 32, 32, 128))
    check_op_and_gradients(lambda q, k, v, ab: jk.flash_attention(q, k, v, ab, sm_scale=0.2),
                           lambda q, k, v, ab: jk.flash_attention_reference(q, k, v, ab,
                                                                            sm_scale=0.2),
                           [q, k, v, ab],
                           opcheck=(torch.ops.jax_kernels.flash_attention.default,
                                    (q, k, v, ab, None, None, False, 0.2)))


@pytest.mark.exhaustive
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_flash_attention_16_bit(dtype):
    q, k, v = (randn(1, 1, 128, 32, dtype=dtype) for _ in range(3))
    check_op_and_gradients(
        lambda q, k, v: jk.flash_attention(q, k, v, causal=True, block_sizes=flash_blocks(64)),
        lambda q, k, v: jk.flash_attention_reference(q, k, v, causal=True), [q, k, v], tol=LOW)


# -- megablox grouped matmul (ops/tpu/megablox) -----------------------------

def test_gmm_ragged_groups_and_dimensions():
    """k and n ragged against the tiles (90 = 2 x 32 + 26, 70 = 2 x 32 + 6),
    a zero-sized group possible; m must be a multiple of tiling[0]."""
    m, k, n, groups = 48, 90, 70, 4
    sizes = group_sizes(m, groups)
    check_op_and_gradients(lambda lhs, rhs: jk.gmm(lhs, rhs, sizes, torch.float32, (16, 32, 32)),
                           lambda lhs, rhs: jk.gmm_reference(lhs, rhs, sizes),
                           [randn(m, k), randn(groups, k, n)], what=f"sizes {sizes.tolist()}",
                           compiled=True)


def test_gmm_opcheck():
    # test_gmm_ragged_groups_and_dimensions's kernel
    run_opcheck(torch.ops.jax_kernels.gmm.default,
                (randn(48, 90), randn(4, 90, 70), group_sizes(48, 4), torch.float32, [16, 32, 32]))


@pytest.mark.exhaustive
def test_gmm_bfloat16_inputs_transposed_rhs_float32_output():
    m, k, n, groups = 32, 48, 40, 3
    sizes = group_sizes(m, groups)
    lhs, rhs = randn(m, k, dtype=torch.bfloat16), randn(groups, n, k, dtype=torch.bfloat16)
    out = jk.gmm(lhs, rhs, sizes, torch.float32, (16, 16, 16), transpose_rhs=True)
    assert out.dtype == torch.float32  # preferred_element_type
    grad = torch.randn(m, n)
    g_lhs, g_rhs = torch.autograd.grad(out, (lhs, rhs), grad)
    assert g_lhs.dtype == g_rhs.dtype == torch.bfloat16
    leaves = float64_leaves([lhs, rhs])
    ref = jk.gmm_reference(*leaves, sizes, transpose_rhs=True)
    close(out, ref, F32, "forward")  # bfloat16 values, products accumulated in float32
    for g, e in zip((g_lhs, g_rhs), torch.autograd.grad(ref, leaves, grad.double())):
        close(g, e, LOW, "gradient")  # rounded to bfloat16


def _sharded_gmm_case():
    """The second shard of JAX's test_gmm_sharded_groups: groups 2.. of 4, on
    the output of the first shard."""
    m, k, n = 64, 40, 24
    sizes = group_sizes(m, 4)
    offset = torch.tensor(2, dtype=torch.int32)
    lhs, rhs, existing = randn(m, k), randn(2, k, n), randn(m, n)
    out = jk.gmm(lhs, rhs, sizes, torch.float32, (16, 40, 24), offset, existing)
    leaves = float64_leaves([lhs, rhs, existing])
    ref = jk.gmm_reference(leaves[0], leaves[1], sizes, offset, leaves[2])
    grad = torch.randn(m, n)
    return (out, ref, torch.autograd.grad(out, (lhs, rhs, existing), grad),
            torch.autograd.grad(ref, leaves, grad.double()), sizes, grad)


def test_gmm_group_offset_and_existing_out():
    out, ref, grads, ref_grads, sizes, grad = _sharded_gmm_case()
    close(out, ref, F32, f"forward, sizes {sizes.tolist()}")
    close(grads[0], ref_grads[0], F32, "gradient of lhs")
    close(grads[1], ref_grads[1], F32, "gradient of rhs")
    # JAX's rule (megablox/ops.py _gmm_bwd) passes the whole cotangent to
    # existing_out, rows the kernel overwrote included (their true gradient
    # is 0): the op gives what JAX's vjp gives, not the reference's.
    torch.testing.assert_close(grads[2], grad)


# -- paged attention, GPU (ops/gpu/paged_attention.py), inference -----------

def _pages(batch, kv_heads, per_sequence, page_size, d, dtype=torch.float32):
    """K and V pages [2, kv_heads, pages, page_size, d], normalised per
    token as in JAX's test, and a random page table."""
    pages = torch.randn(2, kv_heads, batch * per_sequence, page_size, d)
    pages = (pages / pages.norm(dim=-1, keepdim=True)).to(dtype)
    table = torch.randperm(batch * per_sequence, dtype=torch.int32).reshape(batch, per_sequence)
    return pages, table


@pytest.mark.parametrize("soft_cap, with_lengths", [
    pytest.param(0.5, True, id="lengths-soft-cap"),
    pytest.param(None, False, id="no-lengths", marks=pytest.mark.exhaustive)])
def test_paged_attention_gpu(soft_cap, with_lengths):
    batch, kv_heads, ratio, d, page_size, per_sequence = 3, 2, 4, 32, 4, 8
    pages, table = _pages(batch, kv_heads, per_sequence, page_size, d)
    q = torch.randn(batch, kv_heads * ratio, d)
    lengths = torch.tensor([3, 17, 32], dtype=torch.int32) if with_lengths else None
    options = dict(block_h=16, pages_per_compute_block=2, k_splits=2,
                   attn_logits_soft_cap=soft_cap)
    out = jk.paged_attention_gpu(q, pages[0], pages[1], table, lengths, **options)
    k, v = (jk.pages_to_sequences(p, table) for p in pages)
    close(out, jk.paged_attention_reference(q, k, v, lengths, soft_cap), F32, "output")
    if with_lengths:
        run_opcheck(torch.ops.jax_kernels.paged_attention_gpu.default,
                    (q, pages[0], pages[1], table, lengths), options)


# (K cache dtype, V cache dtype), None: float16 pages. JAX's test passes
# each quantized dtype for K, V or both; the default run takes both float8
# formats in one call and int8.
F8, F8_E5M2, I8 = torch.float8_e4m3fn, torch.float8_e5m2, torch.int8
DEFAULT_CACHES = [(F8, F8_E5M2), (I8, I8)]
OTHER_CACHES = [(d, None) for d in (F8, F8_E5M2, I8)] + [(None, d) for d in (F8, F8_E5M2, I8)] + [
    (F8, F8), (F8_E5M2, F8_E5M2)]


def _cache_id(dtypes):
    return "-".join("f16" if d is None else str(d)[6:] for d in dtypes)


@pytest.mark.parametrize("cache_dtypes", [
    *(pytest.param(c, id=_cache_id(c)) for c in DEFAULT_CACHES),
    *(pytest.param(c, id=_cache_id(c), marks=pytest.mark.exhaustive) for c in OTHER_CACHES)])
def test_paged_attention_gpu_quantized_cache(cache_dtypes):
    """JAX's test_quantized_paged_attention: float16 queries, K and/or V pages
    in float8 or int8 with per-token scales; the reference attends over the
    dequantized pages (so the only error is the kernel's float16 arithmetic)."""
    batch, kv_heads, ratio, d, page_size, per_sequence = 2, 1, 20, 32, 8, 4
    pages, table = _pages(batch, kv_heads, per_sequence, page_size, d)
    q = torch.randn(batch, kv_heads * ratio, d).to(torch.float16)
    lengths = torch.tensor([5, 32], dtype=torch.int32)
    cache, scales, dequantized = [], [], []
    for cache_dtype, p in zip(cache_dtypes, pages):
        if cache_dtype is not None:
            values, s = jk.scaled_quantize(p, cache_dtype)
            cache.append(values)
            scales.append(s.to(torch.float16))
            dequantized.append(values.double() * scales[-1].double()[..., None])
        else:
            cache.append(p.to(torch.float16))
            scales.append(None)
            dequantized.append(cache[-1].double())
    out = jk.paged_attention_gpu(q, cache[0], cache[1], table, lengths, scales[0], scales[1],
                                 block_h=16, pages_per_compute_block=2, k_splits=2)
    assert out.dtype == torch.float16
    k, v = (jk.pages_to_sequences(p, table) for p in dequantized)
    close(out, jk.paged_attention_reference(q, k, v, lengths), LOW, "output")


# -- paged attention, TPU (ops/tpu/paged_attention), inference --------------

def _tpu_paged_case(quantized, *, batch=3, kv_heads=2, ratio=4, d=32, page_size=4,
                    per_sequence=8):
    pages, table = _pages(batch, kv_heads, per_sequence, page_size, d)
    q = torch.randn(batch, kv_heads * ratio, d)
    # A zero length, as in JAX's test: its output is undefined, not compared.
    lengths = torch.tensor([0, 13, 32, 5, 30, 1][:batch], dtype=torch.int32)
    if quantized:
        (k, k_scales), (v, v_scales) = (jk.int8_quantize(p) for p in pages)
        seen = [x.double() * s.double() / 127.5 for x, s in ((k, k_scales), (v, v_scales))]
    else:
        k, v, k_scales, v_scales = pages[0], pages[1], None, None
        seen = [p.bfloat16() for p in pages]  # the kernel reads pages as bfloat16
    ref_kv = [jk.pages_to_sequences(p, table) for p in seen]
    return (q, k, v, lengths, table, k_scales, v_scales), ref_kv, lengths > 0


@pytest.mark.parametrize("quantized, soft_cap", [
    pytest.param(False, 1.0, id="float32-soft-cap"), pytest.param(True, None, id="int8"),
    pytest.param(False, None, id="float32", marks=pytest.mark.exhaustive),
    pytest.param(True, 1.0, id="int8-soft-cap", marks=pytest.mark.exhaustive)])
def test_paged_attention_tpu(quantized, soft_cap):
    args, (k, v), valid = _tpu_paged_case(quantized)
    options = dict(pages_per_compute_block=2, attn_logits_soft_cap=soft_cap)
    out = jk.paged_attention(*args, **options)
    ref = jk.paged_attention_reference(args[0], k, v, args[3], soft_cap)
    close(out[valid], ref[valid], F32, "output")
    if quantized:
        run_opcheck(torch.ops.jax_kernels.paged_attention.default, args, options)


@pytest.mark.exhaustive
@pytest.mark.parametrize("megacore_mode, inline_seq_dim",
                         [("batch", True), ("kv_head", True), (None, False)])
def test_paged_attention_tpu_megacore_and_sequence_steps(megacore_mode, inline_seq_dim):
    args, (k, v), valid = _tpu_paged_case(False, batch=4)
    out = jk.paged_attention(*args, pages_per_compute_block=2, megacore_mode=megacore_mode,
                             inline_seq_dim=inline_seq_dim)
    close(out[valid], jk.paged_attention_reference(args[0], k, v, args[3])[valid], F32, "output")


# -- on the TPU simulator (slower: -m exhaustive) ----------------------------

@pytest.mark.exhaustive
def test_tpu_kernels_on_the_tpu_simulator():
    """tpu_interpret: two simulated TensorCores, DMAs and semaphores. Paged
    attention's megacore mode (one core per half of the batch) runs there."""
    with torch_pallas.backend("tpu_interpret"):
        args, (k, v), valid = _tpu_paged_case(True, batch=2, per_sequence=4)
        out = jk.paged_attention(*args, pages_per_compute_block=2, megacore_mode="batch")
        close(out[valid], jk.paged_attention_reference(args[0], k, v, args[3])[valid], F32,
              "paged attention")


@pytest.mark.exhaustive
def test_trained_tpu_kernels_on_the_tpu_simulator():
    with torch_pallas.backend("tpu_interpret"):
        q, k, v = randn(1, 1, 32, 16), randn(1, 1, 128, 16), randn(1, 1, 128, 16)
        check_op_and_gradients(
            lambda q, k, v: jk.flash_attention(q, k, v, causal=True, block_sizes=flash_blocks(32)),
            lambda q, k, v: jk.flash_attention_reference(q, k, v, causal=True), [q, k, v],
            what="flash attention")
        sizes = group_sizes(32, 3)
        check_op_and_gradients(lambda lhs, rhs: jk.gmm(lhs, rhs, sizes, tiling=(16, 24, 16)),
                               lambda lhs, rhs: jk.gmm_reference(lhs, rhs, sizes),
                               [randn(32, 24), randn(3, 24, 16)], what="gmm")


# -- all four trained kernels in one compiled block -------------------------

MHA_BLOCKS = jk.MhaBlockSizes(64, 64, 64, 64, 64, 64)
FLASH_BLOCKS = flash_blocks(64)


def block(x, ln_w, ln_b, wqkv, experts, sizes, *, kernels):
    """A transformer-ish block on all four trained kernels (or, with
    kernels=references, their float64 references): layer norm, both
    attentions over 64 tokens, and an MoE layer (tokens sorted by expert)."""
    layer_norm, mha, flash_attention, gmm = kernels
    tokens, width = x.shape  # 64, 32
    h = layer_norm(x, ln_w, ln_b)
    q, k, v = (h @ wqkv).reshape(tokens, 3, 2, width // 2).unbind(1)  # 2 heads of 16
    a = mha(q[None], k[None], v[None])[0]  # [seq, heads, d] layout
    kv = torch.cat([k, v], 0).transpose(0, 1)[None]  # 128 keys: flash's multiple of 128
    f = flash_attention(q.transpose(0, 1)[None], kv, kv)[0].transpose(0, 1)
    return gmm((a + f).reshape(tokens, width), experts, sizes)


KERNELS = (
    lambda x, w, b: jk.layer_norm(x, w, b),
    lambda q, k, v: jk.mha(q, k, v, None, 0.25, True, MHA_BLOCKS),
    lambda q, k, v: jk.flash_attention(q, k, v, causal=True, sm_scale=0.25,
                                       block_sizes=FLASH_BLOCKS),
    lambda lhs, rhs, sizes: jk.gmm(lhs, rhs, sizes, torch.float32, (16, 32, 24)),
)
REFERENCES = (
    jk.layer_norm_reference,
    lambda q, k, v: jk.mha_reference(q, k, v, None, 0.25, True),
    lambda q, k, v: jk.flash_attention_reference(q, k, v, causal=True, sm_scale=0.25),
    jk.gmm_reference,
)


@pytest.mark.exhaustive
def test_trained_kernels_in_one_block_under_torch_compile_fullgraph():
    params = [randn(64, 32), randn(32), randn(32), randn(32, 96, scale=1 / 6),
              randn(3, 32, 24, scale=1 / 6)]
    sizes = group_sizes(64, 3)
    grad = torch.randn(64, 24)

    @torch.compile(fullgraph=True)
    def step(x, ln_w, ln_b, wqkv, experts):
        out = block(x, ln_w, ln_b, wqkv, experts, sizes, kernels=KERNELS)
        return out, (out * grad).sum()

    out, loss = step(*params)
    grads = torch.autograd.grad(loss, params)
    leaves = float64_leaves(params)
    ref = block(*leaves, sizes, kernels=REFERENCES)
    close(out, ref, F32, "forward")
    ref_grads = torch.autograd.grad((ref * grad.double()).sum(), leaves)
    for i, (g, e) in enumerate(zip(grads, ref_grads)):
        close(g, e, F32, f"gradient of parameter {i}")


def test_a_non_contiguous_input_under_torch_compile():
    x = torch.randn(100, 37).t().requires_grad_()  # (37, 100), as test_layer_norm's
    w, b = randn(100), randn(100)
    compiled = torch.compile(lambda x, w, b: jk.layer_norm(x, w, b).sum(), fullgraph=True)
    (gx,) = torch.autograd.grad(compiled(x, w, b), x)
    leaves = float64_leaves([x, w, b])
    (ex,) = torch.autograd.grad(jk.layer_norm_reference(*leaves).sum(), leaves[0])
    close(gx, ex, F32, "gradient")


# -- what the other CPU backends say about kernels they cannot run ----------

GPU_KERNEL_CALLS = {
    "layer_norm": lambda: jk.layer_norm(torch.randn(4, 33), torch.randn(33), torch.randn(33)),
    "mha": lambda: jk.mha(*(torch.randn(1, 16, 1, 16) for _ in range(3)),
                          block_sizes=jk.MhaBlockSizes(16, 16, 16, 16, 16, 16)),
    "paged_attention_gpu": lambda: jk.paged_attention_gpu(
        torch.randn(1, 2, 16), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16),
        torch.tensor([[1, 0]], dtype=torch.int32), None, pages_per_compute_block=1, k_splits=1),
}
# JAX's GPU kernels here are Triton-style pallas_calls (plgpu Triton
# CompilerParams, masked plgpu.load), under jax.vmap for layer norm and
# paged attention: neither simulator runs them, and each says why.


@pytest.mark.parametrize("backend", ["tpu_interpret", "mosaic_gpu_interpret"])
@pytest.mark.parametrize("kernel", list(GPU_KERNEL_CALLS))
def test_a_simulator_names_the_limit_a_gpu_kernel_hits(backend, kernel):
    with torch_pallas.backend(backend), pytest.raises(torch_pallas.BackendLimitError) as error:
        GPU_KERNEL_CALLS[kernel]()
    assert f"jax_kernels::{kernel}" in str(error.value) and backend in str(error.value)
