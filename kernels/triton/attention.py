"""Attention forward in Triton (FlashAttention-2): softmax(scale * q kᵀ + mask) v
without the (L, S) score matrix in memory, and the row log-sum-exp the
backward needs. The contract is kernels/attention_shapes.py.

Program (query block, batch * query head) loads its BLOCK_M query rows once
and walks the keys BLOCK_N at a time, keeping the online-softmax statistics
in float32 (Dao, "FlashAttention-2: Faster Attention with Better Parallelism
and Work Partitioning", 2023, Algorithm 1; Milakov & Gimelshein, "Online
normalizer calculation for softmax", 2018):

    s     = scale * q kⱼᵀ + mask             (log2 units: times log2 e, for exp2)
    m'    = max(m, rowmax(s))
    p     = exp2(s - m'),  α = exp2(m - m')
    l     = α l + rowsum(p),  acc = α acc + p vⱼ,  m = m'

and at the end o = acc / l, lse = (m + log2 l) ln 2. A row that sees no key
keeps m = -inf and l = 0: it writes o = 0 and lse = +inf (the subtraction
uses 0 in place of an infinite maximum, so no NaN appears).

- causal (key j visible to query i iff j <= i): the walk stops after the
  block holding the block's last diagonal entry; blocks above it are never
  loaded.
- mask (Bm, Hm, L, S): read through its strides, stride 0 along a broadcast
  batch or head dimension, so a shared mask is never copied.
- GQA: query head h reads key/value head h // G by pointer arithmetic.
- Ragged L, S and head dimensions E, Ev (1..256): tiles are powers of two
  (BLOCK_E = next power of two >= E, at least 16 for tl.dot) and every load
  is masked.
- Any layout: every operand's four strides are passed.
- Dropout (DROPOUT, kernels/attention_shapes.py): the block's rows' keys
  are loaded with q, and each key block's p is multiplied by its mask Z
  (`dropout_factors`, the hash every family computes, in uint32) before
  the product with v; l sums p undropped.
- Spans (HAS_SPANS: windows, packed sequences): row i sees keys
  spans[i, 0] <= j < spans[i, 1], both columns non-decreasing, so the
  block's rows see only keys in [spans[m0, 0], spans[last row, 1]): the walk
  goes from the key block holding the first to the one holding the last,
  none when that range is empty, so the work is the keys attended, not
  L x S. k and v are loaded only inside that range (the block edges it
  straddles read nothing past it), and each row's own span masks its
  scores. (Keys inside the range that none of the block's rows sees, a
  gap between packed sequences, are read and weighted by p = 0.)
- Softcap (SOFTCAP): s = c tanh(scale q kᵀ / c) + mask, tanh from exp2
  (`softcap_tanh`); in log2 units c log2 e times it.

Triton's CPU interpreter computes bfloat16 `tl.dot` wrongly and rounds
float32 -> bfloat16 toward zero (kernels/triton/__init__.py). Under it,
bfloat16 operands are upcast to float32 (exact), the probabilities are
rounded to bfloat16 to nearest even by bit arithmetic (what the compiled
kernel's conversion does before its bfloat16 product), and o is written in
float32 and rounded by torch.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch_pallas.kernels.attention_shapes import (DROPOUT_BITS, DROPOUT_GOLDEN, DROPOUT_MIX,
                                                   MAX_HEAD_DIM, attention_dims,
                                                   attention_operands, dropout_scale,
                                                   dropout_threshold)
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.triton import direct, interpreter_safe_dtype, interpreting

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): scores are kept in log2 units, for exp2
LN2 = tl.constexpr(0.6931471805599453)

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Tuning knobs of the forward kernel."""

    autotune: bool  # True: pick among forward_configs(...) per AUTOTUNE_KEY
    block_m: int = 32  # query rows per program, when not autotuning
    block_n: int = 32  # keys per step, when not autotuning
    num_warps: int = 4
    num_stages: int = 2
    # tl.dot's precision for float32 operands: "ieee" (full float32, as
    # torch's reference) or "tf32" (faster on the hardware, ~1e-3 relative).
    precision: str = "ieee"

    @classmethod
    def default(cls, backend: str) -> "AttentionConfig":
        # The CPU interpreter would spend minutes timing configs; 32-row
        # blocks keep its per-program work small and still walk several
        # key blocks on the tests' ragged shapes.
        return cls(autotune=not interpreting())


# Autotuning on CUDA. A config's tiles must fit the GPU: an estimate prunes
# the candidates per (head-dimension tiles, operand size) before the
# autotuner compiles them (a float32 256-wide tile of 128 rows would not fit
# any GPU's shared memory, and compiles for minutes before failing). Configs
# the estimate keeps but a smaller GPU cannot hold (over 99 KiB on sm86/89)
# are skipped by the autotuner; the smallest fit every GPU since Ampere (a
# 256-wide float32 head at 16 x 16: 48-66 KiB in Triton's sm90 builds).
SHARED_MEMORY_BUDGET = 144 * 1024  # bytes: the estimate plus ~10% fits an A100 (163 KiB)
REGISTER_BUDGET = 224  # estimated 32-bit tile values per thread (255 at most; spills beyond)


def shared_memory_estimate(resident: int, streamed: int, stages: int) -> int:
    """Bytes of shared memory: tiles loaded once, plus those loaded per step
    in max(1, stages - 1) buffers (as Triton's sm90 builds measure; its sm80
    builds of float32 tiles may take `stages` buffers, and a config that
    then exceeds the device's limit is skipped by the autotuner)."""
    return resident + streamed * max(1, stages - 1)


def fitting_configs(candidates, estimate):
    """The candidates (BLOCK_M, BLOCK_N, num_warps, num_stages) that fit, as
    triton.Configs; the last candidate (the smallest) when none does.
    estimate(block_m, block_n) -> (bytes of the tiles loaded once, bytes of
    those loaded per step, 32-bit values the program's tiles hold in
    registers in all)."""
    kept = []
    for block_m, block_n, warps, stages in candidates:
        resident, streamed, values = estimate(block_m, block_n)
        if (shared_memory_estimate(resident, streamed, stages) <= SHARED_MEMORY_BUDGET
                and values / (32 * warps) <= REGISTER_BUDGET):
            kept.append((block_m, block_n, warps, stages))
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
            for m, n, w, st in (kept or candidates[-1:])]


# (BLOCK_M query rows per program, BLOCK_N keys per step, warps, stages),
# largest first; the last fits a 256-wide float32 head on any GPU.
FORWARD_CANDIDATES = (
    (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3),
    (64, 128, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (64, 32, 4, 4), (64, 32, 4, 2),
    (32, 64, 4, 2), (32, 32, 4, 2), (16, 32, 2, 2), (16, 16, 4, 1),
)


# Registers per element of the (BLOCK_M, BLOCK_N) score tile, as fitted to
# Triton's sm90 builds (tests/triton_builds.py; cuobjdump's registers and
# spills): the scores in float32, their exponentials and the 16-bit copy a
# second tl.dot reads take 3; a mask tile adds MASK_VALUES more (its 64-bit
# pointers, its values and the select). Fitted so that no config the
# estimate keeps spills: with 2, the forward's (64, 128, 4 warps) at a
# 128-wide head kept (255 registers, 24-32 B spilled); without the mask's,
# every masked config of more than 16 score values a thread spilled at a
# 16-wide head (92 B-2.9 KB), those of 16 and less none.
SCORE_VALUES = 3
MASK_VALUES = 6


def score_values(block_m: int, block_n: int, masked: bool) -> int:
    """32-bit values the score tile and, with a mask, the mask's tile hold."""
    return (SCORE_VALUES + (MASK_VALUES if masked else 0)) * block_m * block_n


def forward_configs(block_e: int, block_ev: int, itemsize: int, masked: bool = False) -> list:
    """The forward's autotuning candidates that fit these head tiles (and a
    mask's tile, `masked`)."""

    def estimate(block_m, block_n):
        q = block_m * block_e * itemsize  # resident
        kv = block_n * (block_e + block_ev) * itemsize  # per step
        # acc in float32, the score tile (score_values), q in registers
        values = block_m * block_ev + score_values(block_m, block_n, masked) + q // 4
        return q, kv, values

    return fitting_configs(FORWARD_CANDIDATES, estimate)


# Tuned per head-dimension tile, sequence-length bucket (a power of two, so
# that each new length does not retune), causal, masked, dropping, spans
# and softcap.
AUTOTUNE_KEY = ["BLOCK_E", "BLOCK_EV", "L_BUCKET", "S_BUCKET", "CAUSAL", "HAS_MASK", "DROPOUT",
                "HAS_SPANS", "SOFTCAP"]

HASH_GOLDEN = tl.constexpr(DROPOUT_GOLDEN)
HASH_MIX_1 = tl.constexpr(DROPOUT_MIX[0])
HASH_MIX_2 = tl.constexpr(DROPOUT_MIX[1])
HASH_SHIFT = tl.constexpr(32 - DROPOUT_BITS)


@triton.jit
def dropout_factors(row_keys, cols, threshold, keep_scale):
    """Z, what dropout multiplies the probabilities by (1 / (1 - p) where
    kept, 0 where dropped), for rows' keys (uint32) and key indices (int32)
    broadcast against each other: kernels/attention_shapes.py's hash."""
    x = row_keys + cols.to(tl.uint32) * HASH_GOLDEN
    x ^= x >> 16
    x *= HASH_MIX_1
    x ^= x >> 15
    x *= HASH_MIX_2
    x ^= x >> 16
    return tl.where((x >> HASH_SHIFT).to(tl.int32) >= threshold, keep_scale, 0.0)


def dropout_arguments(keys, q, dropout_p: float) -> tuple:
    """The kernels' dropout arguments: the keys (B, Hq, L) and their three
    strides, the threshold and the scale (q and zeros, unused, without)."""
    if keys is None:
        return q, 0, 0, 0, 0, 1.0
    return (keys, *keys.stride(), dropout_threshold(dropout_p),
            dropout_scale(dropout_p))


def span_arguments(spans, q, softcap: float) -> tuple:
    """The kernels' spans arguments: spans (rows, 2) int32 and its two
    strides (q and zeros, never read, without), then the softcap (0.0 when
    off). The backward's dk/dv kernel takes key_spans (S, 2) here."""
    spans_arguments = (q, 0, 0) if spans is None else (spans, *spans.stride())
    return (*spans_arguments, float(softcap))


@triton.jit
def row_spans_walk(spans_ptr, offs_m, row_ok, m0, L, stride_sl, stride_sc,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A query block's walk over the keys its rows' spans reach
    (non-decreasing spans): (each row's [row_lo, row_hi), the block's
    [first, last), the walk's first key `lo` (the start of the key block
    holding `first`) and end `hi` (`lo` itself when the range is empty))."""
    row_lo = tl.load(spans_ptr + offs_m * stride_sl, mask=row_ok, other=0)
    row_hi = tl.load(spans_ptr + offs_m * stride_sl + stride_sc, mask=row_ok, other=0)
    first = tl.load(spans_ptr + m0 * stride_sl)
    last = tl.load(spans_ptr + (tl.minimum(m0 + BLOCK_M, L) - 1) * stride_sl + stride_sc)
    lo = (first // BLOCK_N) * BLOCK_N
    hi = tl.where(last > first, last, lo)
    return row_lo, row_hi, first, last, lo, hi


@triton.jit
def softcap_tanh(x):
    """tanh(x) in float32 from exp2: (1 - e) / (1 + e) with e = exp(-2|x|)
    (never overflows; ±1 where e underflows), signed as x."""
    e = tl.exp2(tl.abs(x) * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def round_to_bfloat16(x):
    """float32 x rounded to the nearest bfloat16 (ties to even), kept in
    float32: the interpreter's own conversion truncates. Finite x only."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def attention_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, lse_ptr,
    stride_qb, stride_qh, stride_ql, stride_qe,
    stride_kb, stride_kh, stride_ks, stride_ke,
    stride_vb, stride_vh, stride_vs, stride_ve,
    stride_mb, stride_mh, stride_ml, stride_ms,
    stride_ob, stride_oh, stride_ol, stride_oe,
    stride_lb, stride_lh, stride_ll,
    keys_ptr, stride_yb, stride_yh, stride_yl, drop_threshold, drop_scale,
    spans_ptr, stride_sl, stride_sc, softcap,
    Hq, L, S, E, Ev, GROUP, scale, L_BUCKET, S_BUCKET,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr,
    HAS_SPANS: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    # 64-bit base offsets: batch * stride may pass 2**31 elements.
    b = (bh // Hq).to(tl.int64)
    h = (bh % Hq).to(tl.int64)
    hkv = h // GROUP
    m0 = pid_m * BLOCK_M

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    row_ok = offs_m < L

    q_ptrs = (q_ptr + b * stride_qb + h * stride_qh
              + offs_m[:, None] * stride_ql + offs_e[None, :] * stride_qe)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_e[None, :] < E), other=0.0)
    # kᵀ tile (BLOCK_E, BLOCK_N) and v tile (BLOCK_N, BLOCK_EV), advanced by
    # BLOCK_N keys per step.
    kt_ptrs = (k_ptr + b * stride_kb + hkv * stride_kh
               + offs_n[None, :] * stride_ks + offs_e[:, None] * stride_ke)
    v_ptrs = (v_ptr + b * stride_vb + hkv * stride_vh
              + offs_n[:, None] * stride_vs + offs_ev[None, :] * stride_ve)
    if HAS_MASK:
        mask_ptrs = (mask_ptr + b * stride_mb + h * stride_mh
                     + offs_m[:, None] * stride_ml + offs_n[None, :] * stride_ms)
    if UPCAST:
        q = q.to(tl.float32)
    if DROPOUT:
        row_keys = tl.load(keys_ptr + b * stride_yb + h * stride_yh + offs_m * stride_yl,
                           mask=row_ok, other=0).to(tl.uint32, bitcast=True)
    qk_scale = scale * LOG2E
    if SOFTCAP:  # s = c tanh(scale q k / c), in log2 units
        cap_in = scale / softcap
        cap_out = softcap * LOG2E

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_EV), dtype=tl.float32)

    lo = 0
    hi = S
    if HAS_SPANS:
        # The block's rows see keys in [first, last) only (non-decreasing
        # spans): walk the key blocks from the one holding `first`, none if
        # the range is empty; each row's own span masks inside them.
        row_lo, row_hi, first, last, lo, hi = row_spans_walk(
            spans_ptr, offs_m, row_ok, m0, L, stride_sl, stride_sc, BLOCK_M, BLOCK_N)
        kt_ptrs += lo.to(tl.int64) * stride_ks
        v_ptrs += lo.to(tl.int64) * stride_vs
        if HAS_MASK:
            mask_ptrs += lo.to(tl.int64) * stride_ms
    if CAUSAL:  # keys past the block's last row are hidden from all its rows
        hi = tl.minimum(hi, m0 + BLOCK_M)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if HAS_SPANS:  # nothing outside [first, last) is read
            key_ok = (cols >= first) & (cols < last)
        else:
            key_ok = cols < S
        kt = tl.load(kt_ptrs, mask=(offs_e[:, None] < E) & key_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=key_ok[:, None] & (offs_ev[None, :] < Ev), other=0.0)
        if UPCAST:
            kt, v = kt.to(tl.float32), v.to(tl.float32)
        if SOFTCAP:
            s = softcap_tanh(tl.dot(q, kt, input_precision=INPUT_PRECISION) * cap_in) * cap_out
        else:
            s = tl.dot(q, kt, input_precision=INPUT_PRECISION) * qk_scale
        if HAS_MASK:
            add = tl.load(mask_ptrs, mask=row_ok[:, None] & key_ok[None, :], other=0.0)
            s += add.to(tl.float32) * LOG2E
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None])
        if HAS_SPANS:
            visible = visible & ((row_lo[:, None] <= cols[None, :])
                                 & (cols[None, :] < row_hi[:, None]))
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet has m_new = -inf: subtract 0 instead,
        # so its p and alpha are exp2(-inf) = 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:  # l sums p as it is; v is weighted by the dropped p
            p = p * dropout_factors(row_keys[:, None], cols[None, :], drop_threshold,
                                    drop_scale)
        if UPCAST:
            acc = tl.dot(round_to_bfloat16(p), v, acc, input_precision=INPUT_PRECISION)
        else:
            acc = tl.dot(p.to(v_ptr.dtype.element_ty), v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new

        kt_ptrs += BLOCK_N * stride_ks
        v_ptrs += BLOCK_N * stride_vs
        if HAS_MASK:
            mask_ptrs += BLOCK_N * stride_ms

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]  # acc is 0 on unseen rows
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2,
                   float("inf"))
    o_ptrs = (o_ptr + b * stride_ob + h * stride_oh
              + offs_m[:, None] * stride_ol + offs_ev[None, :] * stride_oe)
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_ev[None, :] < Ev))
    tl.store(lse_ptr + b * stride_lb + h * stride_lh + offs_m * stride_ll, lse, mask=row_ok)


@functools.cache
def attention_kernel_autotuned(block_e: int, block_ev: int, itemsize: int,
                               masked: bool = False):
    """The autotuned kernel for these head tiles and operand size, masked or
    not (its candidates differ: forward_configs) (one autotuner each, so that
    only fitting configs are ever compiled)."""
    return triton.autotune(configs=forward_configs(block_e, block_ev, itemsize, masked),
                           key=AUTOTUNE_KEY)(attention_kernel)


def head_block(dim: int) -> int:
    """The tile of a head dimension: a power of two, at least 16 (tl.dot)."""
    return max(16, triton.next_power_of_2(dim))


def length_bucket(n: int) -> int:
    """The autotuning bucket of a sequence length: the next power of two
    (plain comparisons, so that a symbolic length under torch.compile's
    dynamic shapes is only guarded to its bucket)."""
    bucket = 1
    while bucket < n:
        bucket *= 2
    return bucket


def broadcast_stride(t, dim: int) -> int:
    """t's stride along `dim`, 0 where that dimension is broadcast (size 1)."""
    return t.stride(dim) if t.shape[dim] > 1 else 0


# The launch prologue the forward and backward share: `name` is the entry
# point's, for errors.

def check_dtypes(name: str, **tensors) -> None:
    """Refuse `tensors` (q first) unless they share one of SUPPORTED_DTYPES."""
    q = next(iter(tensors.values()))
    dtypes = [t.dtype for t in tensors.values()]
    if len(set(dtypes)) > 1 or str(q.dtype).removeprefix("torch.") not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}: {', '.join(tensors)} must share one dtype of "
                         f"{SUPPORTED_DTYPES}, got {', '.join(map(str, dtypes))}")


def check_head_dims_and_mask(name: str, dims, q, mask) -> None:
    """Refuse head dims past MAX_HEAD_DIM, and a mask neither float32 nor in q's dtype."""
    if max(dims.head_dim, dims.value_dim) > MAX_HEAD_DIM:
        raise ValueError(f"{name}: head dims E={dims.head_dim}, Ev={dims.value_dim} "
                         f"exceed {MAX_HEAD_DIM}")
    if mask is not None and mask.dtype not in (torch.float32, q.dtype):
        raise ValueError(f"{name}: mask dtype {mask.dtype} is neither float32 nor q's {q.dtype}")


def mask_arguments(mask, q) -> tuple:
    """The kernels' mask argument and its four strides, 0 along a broadcast
    batch or head dimension (q and zeros, never read, without a mask)."""
    if mask is None:
        return q, (0, 0, 0, 0)
    return mask, (broadcast_stride(mask, 0), broadcast_stride(mask, 1), mask.stride(2),
                  mask.stride(3))


def size_arguments(dims, scale: float) -> tuple:
    """The kernels' L, S, E, Ev, GROUP, scale, L_BUCKET, S_BUCKET."""
    l, s = dims.q_len, dims.kv_len
    return (l, s, dims.head_dim, dims.value_dim, dims.group, float(scale), length_bucket(l),
            length_bucket(s))


def kernel_constexprs(dims, q, mask, keys, *, causal: bool, precision: str, spans=None,
                      softcap: float = 0.0) -> dict:
    """The constexprs every attention kernel takes."""
    return dict(
        HAS_MASK=mask is not None, CAUSAL=bool(causal), DROPOUT=keys is not None,
        HAS_SPANS=spans is not None, SOFTCAP=softcap > 0,
        BLOCK_E=head_block(dims.head_dim), BLOCK_EV=head_block(dims.value_dim),
        # Upcasting bfloat16 operands to float32 is exact (interpreter_safe_dtype).
        UPCAST=interpreter_safe_dtype(q.dtype) != q.dtype,
        INPUT_PRECISION=precision,
    )


def launch(kernel, autotuned, grid, args, meta: dict, *, config, itemsize: int, wrap) -> None:
    """kernel[grid](*args, **meta) under `wrap`: with `config.autotune` its
    autotuner for these head tiles (`autotuned(BLOCK_E, BLOCK_EV, itemsize,
    HAS_MASK)`), else with the config's blocks, warps and stages."""
    if config.autotune:
        tuner = autotuned(meta["BLOCK_E"], meta["BLOCK_EV"], itemsize, bool(meta["HAS_MASK"]))
        wrap(tuner)[grid](*args, **meta)
    else:
        wrap(kernel)[grid](*args, **meta, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                           num_warps=config.num_warps, num_stages=config.num_stages)


def check_spans(name: str, spans, rows: int, what: str = "spans") -> None:
    """Refuse spans that are not (rows, 2) int32."""
    if spans is not None and (tuple(spans.shape) != (rows, 2) or spans.dtype != torch.int32):
        raise ValueError(f"{name}: {what} {tuple(spans.shape)} {spans.dtype} must be "
                         f"{(rows, 2)} int32")


def attention(q, k, v, *optional, scale: float, causal: bool, config: AttentionConfig,
              wrap=direct, dropout_p: float = 0.0, spans: bool = False, softcap: float = 0.0,
              span_width: int = 0, window=None):
    """(o, lse) of the canonical attention call (kernels/attention_shapes.py)
    for torch tensors in any layout: o (B, Hq, L, Ev) in q's dtype, lse
    (B, Hq, L) float32; `optional`: [mask][, spans][, dropout keys]."""
    operands = attention_operands(optional, dict(dropout_p=dropout_p, spans=spans))
    mask, keys = operands.mask, operands.keys
    dims = attention_dims(q.shape, k.shape, v.shape, None if mask is None else mask.shape)
    name = "attention (triton)"
    check_dtypes(name, q=q, k=k, v=v)
    check_head_dims_and_mask(name, dims, q, mask)
    check_spans(name, operands.spans, dims.q_len)
    b, hq, l = dims.batch, dims.q_heads, dims.q_len
    o = torch.empty((b, hq, l, dims.value_dim), dtype=interpreter_safe_dtype(q.dtype),
                    device=q.device)
    lse = torch.empty((b, hq, l), dtype=torch.float32, device=q.device)
    mask_arg, mask_strides = mask_arguments(mask, q)
    args = (
        q, k, v, mask_arg, o, lse,
        *q.stride(), *k.stride(), *v.stride(), *mask_strides, *o.stride(), *lse.stride(),
        *dropout_arguments(keys, q, dropout_p), *span_arguments(operands.spans, q, softcap),
        hq, *size_arguments(dims, scale),
    )
    meta = kernel_constexprs(dims, q, mask, keys, causal=causal, precision=config.precision,
                             spans=operands.spans, softcap=softcap)

    def grid(meta):
        return (triton.cdiv(l, meta["BLOCK_M"]), b * hq)

    launch(attention_kernel, attention_kernel_autotuned, grid, args, meta, config=config,
           itemsize=q.element_size(), wrap=wrap)
    return (o if o.dtype == q.dtype else o.to(q.dtype)), lse


def unsupported(backend: str, avals, params) -> str | None:
    dtypes = {dtype for _, dtype in avals[:3]}
    if not dtypes <= set(SUPPORTED_DTYPES):
        return (f"backend '{backend}' has no attention kernel for {sorted(dtypes)} "
                f"(it computes {', '.join(SUPPORTED_DTYPES)})")
    head_dims = (avals[0][0][-1], avals[2][0][-1])
    if max(head_dims) > MAX_HEAD_DIM:
        return (f"backend '{backend}' computes attention for head dims up to {MAX_HEAD_DIM}, "
                f"not E={head_dims[0]}, Ev={head_dims[1]}")
    return None


KERNEL = KernelSpec(run=attention, default_config=AttentionConfig.default, unsupported=unsupported)
