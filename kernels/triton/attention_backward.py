"""Attention backward in Triton (FlashAttention-2): dq, dk, dv of
o = softmax(scale * q kᵀ + mask) v from q, k, v, o, do and the forward's
lse, recomputing the probabilities block by block, so no (L, S) tensor is
ever in memory. The contract is kernels/attention_shapes.py.

Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning" (2023), Algorithm 2, in three launches:

1. `attention_delta_kernel`: delta = rowsum(do * o) in float32, per query
   row (the softmax Jacobian's correction term).
2. `attention_dkdv_kernel`, program (key block, batch * kv head): keeps its
   BLOCK_N keys and values and their dk, dv accumulators, and walks the
   query blocks of each of the G query heads that read this kv head (GQA),
   so dk and dv are summed over the group in registers, without atomics:

       pᵀ = exp(sᵀ - lse),  dv += pᵀ do,  dpᵀ = v doᵀ,
       dsᵀ = pᵀ (dpᵀ - delta),  dk += dsᵀ q           (dk scaled at the end)

   Causal: only queries i >= the block's first key are walked.
3. `attention_dq_kernel`, program (query block, batch * query head): walks
   the key blocks (up to the diagonal when causal), dq += ds k, scaled at the
   end.

Dropout (DROPOUT): each block's mask Z is recomputed from the rows' keys
as the forward computed it (`dropout_factors`): dv += (pZ)ᵀ do and
ds = p (dp Z - delta), delta from the dropped o.

Spans (HAS_SPANS): the dq kernel walks the key blocks of
[spans[first row, 0], spans[last row, 1]) as the forward does; the dk/dv
kernel takes key_spans (S, 2) instead (key j is seen by rows key_spans[j, 0]
<= i < key_spans[j, 1], non-decreasing) and walks, for each query head of
its group, the query blocks of [key_spans[first key, 0], key_spans[last key,
1]), none when that is empty, masking each key's own row range inside them.
Operands outside those ranges are never read (and keys no row sees are not
loaded, so their dk and dv are 0).

Softcap (SOFTCAP): the scores are recomputed capped, s = c t + mask with
t = tanh(scale q kᵀ / c) of the unmasked product, and ds is multiplied by
1 - t² (finite wherever the mask hides a score: t never sees the mask).

Scores are kept in log2 units (times log2 e) for exp2, as in the forward.
A row the forward found empty has lse = +inf, so its p is 0 everywhere.
The probabilities and ds are rounded to the operands' dtype before their
products, as FlashAttention does; under Triton's CPU interpreter bfloat16
operands are upcast to float32 and those roundings done to nearest even by
bit arithmetic (kernels/triton/attention.py), and the gradients are written
in float32 and rounded by torch.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch_pallas.kernels.attention_shapes import attention_dims, attention_operands
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.triton import direct, interpreter_safe_dtype, interpreting
from torch_pallas.kernels.triton.attention import (
    AUTOTUNE_KEY,
    LOG2E,
    MASK_VALUES,
    check_dtypes,
    check_head_dims_and_mask,
    check_spans,
    dropout_arguments,
    dropout_factors,
    fitting_configs,
    kernel_constexprs,
    launch,
    mask_arguments,
    round_to_bfloat16,
    row_spans_walk,
    size_arguments,
    softcap_tanh,
    span_arguments,
    unsupported,
)


@dataclasses.dataclass(frozen=True)
class AttentionBackwardConfig:
    """Tuning knobs of the backward kernels (dk/dv and dq share them when
    not autotuning)."""

    autotune: bool  # True: pick among dkdv_configs / dq_configs per AUTOTUNE_KEY
    block_m: int = 32  # query rows per step (dk/dv) or per program (dq)
    block_n: int = 32  # keys per program (dk/dv) or per step (dq)
    num_warps: int = 4
    num_stages: int = 2
    # Elements of o and do one program of the delta kernel reads.
    delta_block: int = 8192
    precision: str = "ieee"  # tl.dot's float32 precision: "ieee" or "tf32"

    @classmethod
    def default(cls, backend: str) -> "AttentionBackwardConfig":
        # No autotuning in the CPU interpreter (minutes of timing).
        return cls(autotune=not interpreting())


# Autotuning candidates (BLOCK_M, BLOCK_N, warps, stages), largest first,
# pruned per head tiles and operand size by the forward's estimate
# (kernels/triton/attention.py, fitting_configs); the last fits a 256-wide
# float32 head on any GPU.
DKDV_CANDIDATES = (  # BLOCK_M: query rows per step, BLOCK_N: keys held per program
    (32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 2),
    (32, 64, 8, 2), (16, 64, 8, 2),  # 8 warps: registers for wide heads' dk, dv
    (16, 64, 4, 2), (32, 32, 4, 2), (16, 32, 4, 2), (16, 16, 4, 1),
)  # (32, 32, 8 warps, 2): ptxas held it to 128 registers and spilled 28 B (D128)
DQ_CANDIDATES = (  # BLOCK_M: query rows per program, BLOCK_N: keys per step
    (128, 32, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3), (64, 64, 4, 2), (64, 32, 8, 2),
    (64, 16, 4, 2), (32, 32, 4, 2), (32, 16, 4, 2), (16, 16, 4, 1),
)


def dkdv_configs(block_e: int, block_ev: int, itemsize: int, masked: bool = False) -> list:
    """The dk/dv kernel's candidates that fit these head tiles (and a mask's
    tile, `masked`)."""

    def estimate(block_m, block_n):
        kv = block_n * (block_e + block_ev) * itemsize  # resident
        q_do = block_m * (block_e + block_ev) * itemsize  # per step
        # dk, dv in float32, k and v, the pᵀ and dpᵀ tiles: 3 values an
        # element (as the forward's SCORE_VALUES; with 2, (32, 128, 8, 3)
        # and (32, 64, 4, 3) kept at a 128-wide head spilled 72-140 B under
        # GQA), and the mask's (MASK_VALUES)
        values = (block_n * (block_e + block_ev) + kv // 4 + 3 * block_m * block_n
                  + (MASK_VALUES * block_m * block_n if masked else 0))
        return kv, q_do, values

    return fitting_configs(DKDV_CANDIDATES, estimate)


def dq_configs(block_e: int, block_ev: int, itemsize: int, masked: bool = False) -> list:
    """The dq kernel's candidates that fit these head tiles (and a mask's
    tile, `masked`)."""

    def estimate(block_m, block_n):
        q_do = block_m * (block_e + block_ev) * itemsize  # resident
        kv = block_n * (block_e + block_ev) * itemsize  # per step
        values = (block_m * block_e + q_do // 4 + 2 * block_m * block_n  # dq in float32
                  + (MASK_VALUES * block_m * block_n if masked else 0))
        return q_do, kv, values

    return fitting_configs(DQ_CANDIDATES, estimate)


@triton.jit
def attention_delta_kernel(
    o_ptr, do_ptr, delta_ptr,
    stride_ob, stride_oh, stride_ol, stride_oe,
    stride_db, stride_dh, stride_dl, stride_de,
    Hq, L, Ev,
    BLOCK_M: tl.constexpr, BLOCK_EV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)
    h = (bh % Hq).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_ev = tl.arange(0, BLOCK_EV)
    ok = (offs_m[:, None] < L) & (offs_ev[None, :] < Ev)
    o = tl.load(o_ptr + b * stride_ob + h * stride_oh
                + offs_m[:, None] * stride_ol + offs_ev[None, :] * stride_oe, mask=ok, other=0.0)
    do = tl.load(do_ptr + b * stride_db + h * stride_dh
                 + offs_m[:, None] * stride_dl + offs_ev[None, :] * stride_de, mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(delta_ptr + bh.to(tl.int64) * L + offs_m, delta, mask=offs_m < L)  # (B, Hq, L) contiguous


@triton.jit
def attention_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    stride_qb, stride_qh, stride_ql, stride_qe,
    stride_kb, stride_kh, stride_ks, stride_ke,
    stride_vb, stride_vh, stride_vs, stride_ve,
    stride_mb, stride_mh, stride_ml, stride_ms,
    stride_db, stride_dh, stride_dl, stride_de,
    stride_lb, stride_lh, stride_ll,
    keys_ptr, stride_yb, stride_yh, stride_yl, drop_threshold, drop_scale,
    key_spans_ptr, stride_tl, stride_tc, softcap,
    stride_dkb, stride_dkh, stride_dks, stride_dke,
    stride_dvb, stride_dvh, stride_dvs, stride_dve,
    Hkv, L, S, E, Ev, GROUP, scale, L_BUCKET, S_BUCKET,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr,
    HAS_SPANS: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hkv).to(tl.int64)
    hkv = (bh % Hkv).to(tl.int64)
    n0 = pid_n * BLOCK_N

    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    key_ok = offs_n < S

    load_ok = key_ok
    if HAS_SPANS:
        # Each key's rows [col_lo, col_hi); the block's keys are seen by rows
        # in [first, last) only (non-decreasing key spans).
        # (the forward's walk over the transposed spans: key blocks' rows)
        col_lo, col_hi, first, last, span_lo, span_hi = row_spans_walk(
            key_spans_ptr, offs_n, key_ok, n0, S, stride_tl, stride_tc, BLOCK_N, BLOCK_M)
        load_ok = col_lo < col_hi  # a key no row sees is not read: its dk, dv are 0
    k = tl.load(k_ptr + b * stride_kb + hkv * stride_kh
                + offs_n[:, None] * stride_ks + offs_e[None, :] * stride_ke,
                mask=load_ok[:, None] & (offs_e[None, :] < E), other=0.0)
    v = tl.load(v_ptr + b * stride_vb + hkv * stride_vh
                + offs_n[:, None] * stride_vs + offs_ev[None, :] * stride_ve,
                mask=load_ok[:, None] & (offs_ev[None, :] < Ev), other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    qk_scale = scale * LOG2E
    if SOFTCAP:  # s = c tanh(scale q k / c), in log2 units
        cap_in = scale / softcap
        cap_out = softcap * LOG2E
    dk = tl.zeros((BLOCK_N, BLOCK_E), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_EV), dtype=tl.float32)

    lo = 0
    hi = L
    if HAS_SPANS:  # the query blocks from the one holding `first`, none if empty
        lo = span_lo
        hi = span_hi
    if CAUSAL:  # queries before the block's first key see none of its keys
        if HAS_SPANS:
            lo = tl.maximum(lo, n0)
        else:
            lo = n0
    for g in range(0, GROUP):
        h = hkv * GROUP + g  # the query heads that read this kv head
        # qᵀ (BLOCK_E, BLOCK_M), do (BLOCK_M, BLOCK_EV), maskᵀ (BLOCK_N, BLOCK_M).
        qt_ptrs = (q_ptr + b * stride_qb + h * stride_qh
                   + (lo + offs_m)[None, :] * stride_ql + offs_e[:, None] * stride_qe)
        do_ptrs = (do_ptr + b * stride_db + h * stride_dh
                   + (lo + offs_m)[:, None] * stride_dl + offs_ev[None, :] * stride_de)
        if HAS_MASK:
            mask_ptrs = (mask_ptr + b * stride_mb + h * stride_mh
                         + offs_n[:, None] * stride_ms + (lo + offs_m)[None, :] * stride_ml)
        lse_ptrs = lse_ptr + b * stride_lb + h * stride_lh + (lo + offs_m) * stride_ll
        delta_ptrs = delta_ptr + (b * Hkv * GROUP + h) * L + lo + offs_m
        if DROPOUT:
            keys_ptrs = keys_ptr + b * stride_yb + h * stride_yh + (lo + offs_m) * stride_yl
        for start_m in range(lo, hi, BLOCK_M):
            rows = start_m + offs_m
            if HAS_SPANS:  # nothing outside [first, last) is read
                row_ok = (rows >= first) & (rows < last)
            else:
                row_ok = rows < L
            qt = tl.load(qt_ptrs, mask=(offs_e[:, None] < E) & row_ok[None, :], other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None] & (offs_ev[None, :] < Ev), other=0.0)
            lse = tl.load(lse_ptrs, mask=row_ok, other=float("inf"))
            delta = tl.load(delta_ptrs, mask=row_ok, other=0.0)
            if UPCAST:
                qt, do = qt.to(tl.float32), do.to(tl.float32)
            if SOFTCAP:
                tt = softcap_tanh(tl.dot(k, qt, input_precision=INPUT_PRECISION) * cap_in)
                st = tt * cap_out
            else:
                st = tl.dot(k, qt, input_precision=INPUT_PRECISION) * qk_scale
            if HAS_MASK:
                add = tl.load(mask_ptrs, mask=key_ok[:, None] & row_ok[None, :], other=0.0)
                st += add.to(tl.float32) * LOG2E
            visible = key_ok[:, None] & row_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= rows[None, :])
            if HAS_SPANS:
                visible = visible & ((col_lo[:, None] <= rows[None, :])
                                     & (rows[None, :] < col_hi[:, None]))
            # lse = +inf on empty and padding rows: p = exp2(-inf) = 0 there.
            pt = tl.where(visible, tl.exp2(st - lse[None, :] * LOG2E), 0.0)
            dpt = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
            if DROPOUT:  # Zᵀ of this block: dv takes (p Z)ᵀ, dp becomes dp Z
                row_keys = tl.load(keys_ptrs, mask=row_ok, other=0).to(tl.uint32, bitcast=True)
                zt = dropout_factors(row_keys[None, :], offs_n[:, None], drop_threshold,
                                     drop_scale)
                ptz = pt * zt
                dpt = dpt * zt
                keys_ptrs += BLOCK_M * stride_yl
            else:
                ptz = pt
            dst = pt * (dpt - delta[None, :])
            if SOFTCAP:  # through the cap: d(c tanh(x / c)) = (1 - t²) dx
                dst = dst * (1.0 - tt * tt)
            if UPCAST:
                dv = tl.dot(round_to_bfloat16(ptz), do, dv, input_precision=INPUT_PRECISION)
                dk = tl.dot(round_to_bfloat16(dst), tl.trans(qt), dk,
                            input_precision=INPUT_PRECISION)
            else:
                dv = tl.dot(ptz.to(do_ptr.dtype.element_ty), do, dv,
                            input_precision=INPUT_PRECISION)
                dk = tl.dot(dst.to(q_ptr.dtype.element_ty), tl.trans(qt), dk,
                            input_precision=INPUT_PRECISION)
            qt_ptrs += BLOCK_M * stride_ql
            do_ptrs += BLOCK_M * stride_dl
            lse_ptrs += BLOCK_M * stride_ll
            delta_ptrs += BLOCK_M
            if HAS_MASK:
                mask_ptrs += BLOCK_M * stride_ml

    dk *= scale
    tl.store(dk_ptr + b * stride_dkb + hkv * stride_dkh
             + offs_n[:, None] * stride_dks + offs_e[None, :] * stride_dke,
             dk.to(dk_ptr.dtype.element_ty), mask=key_ok[:, None] & (offs_e[None, :] < E))
    tl.store(dv_ptr + b * stride_dvb + hkv * stride_dvh
             + offs_n[:, None] * stride_dvs + offs_ev[None, :] * stride_dve,
             dv.to(dv_ptr.dtype.element_ty), mask=key_ok[:, None] & (offs_ev[None, :] < Ev))


@triton.jit
def attention_dq_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    stride_qb, stride_qh, stride_ql, stride_qe,
    stride_kb, stride_kh, stride_ks, stride_ke,
    stride_vb, stride_vh, stride_vs, stride_ve,
    stride_mb, stride_mh, stride_ml, stride_ms,
    stride_db, stride_dh, stride_dl, stride_de,
    stride_lb, stride_lh, stride_ll,
    keys_ptr, stride_yb, stride_yh, stride_yl, drop_threshold, drop_scale,
    spans_ptr, stride_sl, stride_sc, softcap,
    stride_dqb, stride_dqh, stride_dql, stride_dqe,
    Hq, L, S, E, Ev, GROUP, scale, L_BUCKET, S_BUCKET,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr,
    HAS_SPANS: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)
    h = (bh % Hq).to(tl.int64)
    hkv = h // GROUP
    m0 = pid_m * BLOCK_M

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    row_ok = offs_m < L

    q = tl.load(q_ptr + b * stride_qb + h * stride_qh
                + offs_m[:, None] * stride_ql + offs_e[None, :] * stride_qe,
                mask=row_ok[:, None] & (offs_e[None, :] < E), other=0.0)
    do = tl.load(do_ptr + b * stride_db + h * stride_dh
                 + offs_m[:, None] * stride_dl + offs_ev[None, :] * stride_de,
                 mask=row_ok[:, None] & (offs_ev[None, :] < Ev), other=0.0)
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_m * stride_ll,
                  mask=row_ok, other=float("inf"))
    delta = tl.load(delta_ptr + bh.to(tl.int64) * L + offs_m, mask=row_ok, other=0.0)
    if DROPOUT:
        row_keys = tl.load(keys_ptr + b * stride_yb + h * stride_yh + offs_m * stride_yl,
                           mask=row_ok, other=0).to(tl.uint32, bitcast=True)
    if UPCAST:
        q, do = q.to(tl.float32), do.to(tl.float32)
    qk_scale = scale * LOG2E
    if SOFTCAP:  # s = c tanh(scale q k / c), in log2 units
        cap_in = scale / softcap
        cap_out = softcap * LOG2E
    lse2 = lse * LOG2E
    dq = tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.float32)

    # kᵀ (BLOCK_E, BLOCK_N), vᵀ (BLOCK_EV, BLOCK_N), mask (BLOCK_M, BLOCK_N).
    kt_ptrs = (k_ptr + b * stride_kb + hkv * stride_kh
               + offs_n[None, :] * stride_ks + offs_e[:, None] * stride_ke)
    vt_ptrs = (v_ptr + b * stride_vb + hkv * stride_vh
               + offs_n[None, :] * stride_vs + offs_ev[:, None] * stride_ve)
    if HAS_MASK:
        mask_ptrs = (mask_ptr + b * stride_mb + h * stride_mh
                     + offs_m[:, None] * stride_ml + offs_n[None, :] * stride_ms)
    lo = 0
    hi = S
    if HAS_SPANS:  # the forward's walk: the key blocks of [first, last)
        row_lo, row_hi, first, last, lo, hi = row_spans_walk(
            spans_ptr, offs_m, row_ok, m0, L, stride_sl, stride_sc, BLOCK_M, BLOCK_N)
        kt_ptrs += lo.to(tl.int64) * stride_ks
        vt_ptrs += lo.to(tl.int64) * stride_vs
        if HAS_MASK:
            mask_ptrs += lo.to(tl.int64) * stride_ms
    if CAUSAL:
        hi = tl.minimum(hi, m0 + BLOCK_M)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if HAS_SPANS:  # nothing outside [first, last) is read
            key_ok = (cols >= first) & (cols < last)
        else:
            key_ok = cols < S
        kt = tl.load(kt_ptrs, mask=(offs_e[:, None] < E) & key_ok[None, :], other=0.0)
        vt = tl.load(vt_ptrs, mask=(offs_ev[:, None] < Ev) & key_ok[None, :], other=0.0)
        if UPCAST:
            kt, vt = kt.to(tl.float32), vt.to(tl.float32)
        if SOFTCAP:
            t = softcap_tanh(tl.dot(q, kt, input_precision=INPUT_PRECISION) * cap_in)
            s = t * cap_out
        else:
            s = tl.dot(q, kt, input_precision=INPUT_PRECISION) * qk_scale
        if HAS_MASK:
            add = tl.load(mask_ptrs, mask=row_ok[:, None] & key_ok[None, :], other=0.0)
            s += add.to(tl.float32) * LOG2E
        visible = row_ok[:, None] & key_ok[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None])
        if HAS_SPANS:
            visible = visible & ((row_lo[:, None] <= cols[None, :])
                                 & (cols[None, :] < row_hi[:, None]))
        p = tl.where(visible, tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, vt, input_precision=INPUT_PRECISION)
        if DROPOUT:
            dp = dp * dropout_factors(row_keys[:, None], cols[None, :], drop_threshold,
                                      drop_scale)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:  # through the cap: d(c tanh(x / c)) = (1 - t²) dx
            ds = ds * (1.0 - t * t)
        if UPCAST:
            dq = tl.dot(round_to_bfloat16(ds), tl.trans(kt), dq, input_precision=INPUT_PRECISION)
        else:
            dq = tl.dot(ds.to(k_ptr.dtype.element_ty), tl.trans(kt), dq,
                        input_precision=INPUT_PRECISION)
        kt_ptrs += BLOCK_N * stride_ks
        vt_ptrs += BLOCK_N * stride_vs
        if HAS_MASK:
            mask_ptrs += BLOCK_N * stride_ms

    dq *= scale
    tl.store(dq_ptr + b * stride_dqb + h * stride_dqh
             + offs_m[:, None] * stride_dql + offs_e[None, :] * stride_dqe,
             dq.to(dq_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_e[None, :] < E))


@functools.cache
def attention_dkdv_kernel_autotuned(block_e: int, block_ev: int, itemsize: int,
                               masked: bool = False):
    """The autotuned dk/dv kernel for these head tiles."""
    return triton.autotune(configs=dkdv_configs(block_e, block_ev, itemsize, masked),
                           key=AUTOTUNE_KEY)(attention_dkdv_kernel)


@functools.cache
def attention_dq_kernel_autotuned(block_e: int, block_ev: int, itemsize: int,
                               masked: bool = False):
    """The autotuned dq kernel for these head tiles."""
    return triton.autotune(configs=dq_configs(block_e, block_ev, itemsize, masked),
                           key=AUTOTUNE_KEY)(attention_dq_kernel)


def attention_backward(q, k, v, o, do, lse, *optional, scale: float, causal: bool,
                       config: AttentionBackwardConfig, wrap=direct, dropout_p: float = 0.0,
                       spans: bool = False, softcap: float = 0.0, span_width: int = 0,
                       window=None):
    """(dq, dk, dv) of the canonical attention call (kernels/attention_shapes.py)
    for torch tensors in any layout, in q's dtype; dk and dv summed over the
    query heads of each kv head; `optional`: [mask][, spans, key_spans][,
    dropout keys]."""
    operands = attention_operands(optional, dict(dropout_p=dropout_p, spans=spans),
                                  backward=True)
    mask, keys = operands.mask, operands.keys
    dims = attention_dims(q.shape, k.shape, v.shape, None if mask is None else mask.shape)
    name = "attention backward (triton)"
    check_dtypes(name, q=q, k=k, v=v, o=o, do=do)
    b, hq, hkv, l, s = dims.batch, dims.q_heads, dims.kv_heads, dims.q_len, dims.kv_len
    e, ev = dims.head_dim, dims.value_dim
    if tuple(o.shape) != (b, hq, l, ev) or tuple(do.shape) != (b, hq, l, ev):
        raise ValueError(f"{name}: o {tuple(o.shape)} and do {tuple(do.shape)} must be "
                         f"{(b, hq, l, ev)}")
    if tuple(lse.shape) != (b, hq, l) or lse.dtype != torch.float32:
        raise ValueError(f"{name}: lse {tuple(lse.shape)} {lse.dtype} must be {(b, hq, l)} float32")
    check_head_dims_and_mask(name, dims, q, mask)
    check_spans(name, operands.spans, l)
    check_spans(name, operands.key_spans, s, "key_spans")

    out_dtype = interpreter_safe_dtype(q.dtype)
    delta = torch.empty((b, hq, l), dtype=torch.float32, device=q.device)
    dq = torch.empty((b, hq, l, e), dtype=out_dtype, device=q.device)
    dk = torch.empty((b, hkv, s, e), dtype=out_dtype, device=q.device)
    dv = torch.empty((b, hkv, s, ev), dtype=out_dtype, device=q.device)

    meta = kernel_constexprs(dims, q, mask, keys, causal=causal, precision=config.precision,
                             spans=operands.spans, softcap=softcap)
    block_ev = meta["BLOCK_EV"]
    delta_rows = min(128, max(16, config.delta_block // block_ev))
    wrap(attention_delta_kernel)[(triton.cdiv(l, delta_rows), b * hq)](
        o, do, delta, *o.stride(), *do.stride(), hq, l, ev,
        BLOCK_M=delta_rows, BLOCK_EV=block_ev,
    )

    mask_arg, mask_strides = mask_arguments(mask, q)
    operand_strides = (*q.stride(), *k.stride(), *v.stride(), *mask_strides, *do.stride(),
                       *lse.stride(), *dropout_arguments(keys, q, dropout_p))
    sizes = size_arguments(dims, scale)
    launch_options = dict(config=config, itemsize=q.element_size(), wrap=wrap)

    def dkdv_grid(meta):
        return (triton.cdiv(s, meta["BLOCK_N"]), b * hkv)

    dkdv_args = (q, k, v, mask_arg, do, lse, delta, dk, dv, *operand_strides,
                 *span_arguments(operands.key_spans, q, softcap),
                 *dk.stride(), *dv.stride(), hkv, *sizes)
    launch(attention_dkdv_kernel, attention_dkdv_kernel_autotuned, dkdv_grid, dkdv_args, meta,
           **launch_options)

    def dq_grid(meta):
        return (triton.cdiv(l, meta["BLOCK_M"]), b * hq)

    dq_args = (q, k, v, mask_arg, do, lse, delta, dq, *operand_strides,
               *span_arguments(operands.spans, q, softcap), *dq.stride(), hq, *sizes)
    launch(attention_dq_kernel, attention_dq_kernel_autotuned, dq_grid, dq_args, meta,
           **launch_options)

    if out_dtype != q.dtype:
        dq, dk, dv = dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)
    return dq, dk, dv


KERNEL = KernelSpec(run=attention_backward, default_config=AttentionBackwardConfig.default,
                    unsupported=unsupported)
