"""The contract every attention kernel file keeps (kernels/<family>/attention.py
and attention_backward.py), and the sizes of its operands. Plain integer
arithmetic (no JAX, no Triton), shared by every family.

The op layer (ops/attention.py) reduces torch's
`scaled_dot_product_attention` to one canonical call: batch dimensions
broadcast and flattened, 3-D inputs given a head axis, a boolean mask turned
additive. The kernels see only this:

Forward: `run(q, k, v[, mask], *, scale, causal, config, **execution) -> (o, lse)`

- q (B, Hq, L, E); k (B, Hkv, S, E); v (B, Hkv, S, Ev), one dtype: float32,
  float16 or bfloat16. Hq is a multiple of Hkv (G = Hq // Hkv): query head h
  reads key/value head h // G in place (GQA and MQA; Hq == Hkv is plain
  multi-head attention). L, S >= 1 and E, Ev in 1..256, any of them ragged.
- mask, optional: (Bm, Hm, L, S) with Bm in {1, B} and Hm in {1, Hq} (1: the
  same for every batch / head, broadcast, never copied), float32 or q's
  dtype; added to the scores: s = scale * q.kᵀ + mask. -inf masks out.
- causal: key j is visible to query i only if j <= i (top-left aligned, as
  torch aligns `is_causal` when L != S); applies on top of a mask if both
  are given.
- Scores, softmax statistics and both products accumulate in float32.
- o (B, Hq, L, Ev) in q's dtype: softmax(s) @ v; a row with no visible key
  (every score -inf) is 0, as torch gives.
- lse (B, Hq, L) float32: the natural log of sum_j exp(s_ij); +inf for a row
  with no visible key, so that exp(s - lse) is 0 on it everywhere.

Backward: `run(q, k, v, o, do, lse[, mask], *, scale, causal, config, **execution)
-> (dq, dk, dv)`

- q, k, v, mask, scale, causal as in the forward; o and lse what it returned;
  do (B, Hq, L, Ev) in q's dtype.
- dq (B, Hq, L, E), dk (B, Hkv, S, E), dv (B, Hkv, S, Ev) in q's dtype; dk
  and dv summed over the G query heads that share each key/value head.
- FlashAttention-2's algorithm: delta = rowsum(do * o) (float32), then per
  block p = exp(s - lse), dv += pᵀ do, dp = do vᵀ, ds = p * (dp - delta),
  dq += scale * ds k, dk += scale * dsᵀ q, with no (L, S) tensor in memory
  on the GPU kernels.

Dropout (`dropout_p` in (0, 1] among the params; absent, and no operand
added, when 0): one more operand after the mask, `keys` (B, Hq, L) int32,
and in both directions the attention probabilities P = softmax(s) are
dropped as SDPA drops them in training: o = (P * Z) v with Z = keep / (1 -
p). The keep bit of score (i, j) of batch b, query head h is one hash of
global indices (so block sizes never change it), in uint32 arithmetic
(int32 bits where a family has no unsigned type):

    mix(x)        = lowbias32: x ^= x >> 16; x *= MIX_1; x ^= x >> 15;
                    x *= MIX_2; x ^= x >> 16              (logical shifts)
    absorb(r, n)  = mix(r + n * GOLDEN)                    (mod 2**32)
    keys[b, h, i] = absorb(absorb(seed, b * Hq + h), i)    (the op layer's)
    keep(i, j)    = absorb(keys[b, h, i], j) >> 8 >= round(p * 2**24)

so each kernel hashes only (its row's key, the key index j). lse stays the
undropped softmax's. The backward uses the forward's keys: dv += (p Z)ᵀ do,
dp = (do vᵀ) Z, ds = p * (dp - delta), delta = rowsum(do * o) of the
dropped o (FlashAttention-2's derivation: rowsum(P * dp) = rowsum(do * o)).

Spans and softcap (sliding windows, packed sequences, softcapping; the
params name them only when used, so that a call without them is the kernel
traced before they existed):

- `spans=True` among the params: one more operand after the mask, spans
  (L, 2) int32, the same for every batch and head: query row i sees key j
  only if spans[i, 0] <= j < spans[i, 1] (on top of the mask; the op layer
  folds a causal rule into the spans, so causal is False with them). Both
  columns are non-decreasing in i and 0 <= spans[i, 0] <= spans[i, 1] <= S
  (start == end: the row sees nothing, and gets o = 0, lse = +inf). This
  one form carries SDPA with a window, a causal window aligned bottom-right
  and packed variable-length sequences (rows of one sequence see a window
  of that sequence's keys).
  The backward gets a second operand right after it, key_spans (S, 2)
  int32: key j is seen by query rows key_spans[j, 0] <= i < key_spans[j, 1]
  (the transpose of spans, also non-decreasing; made by the op layer).
  The kernels visit only the key blocks a query block's spans reach
  (forward, dq: from spans[first row, 0] to spans[last row, 1]) and only
  the query blocks a key block's key_spans reach (dk, dv), so the work is
  that of the keys attended, not of the L x S square; element masks apply
  where a block straddles a span's edge.
- `span_width=w` among the params, with spans: no row's span is wider
  than w keys (a sliding window's left + right + 1); a hint the kernels may
  choose their blocks by (the batched TPU body takes a window's band in one
  slab), never a promise they rely on for correctness.
- `window=(left, right)` among the params, with spans: the spans are
  exactly a sliding window's, aligned top-left: row i's are
  [max(i - left, 0), min(i + right + 1, S)) clipped to [0, S] (-1: that
  side unbounded, 0 or S), a promise the op layer keeps (it builds the
  spans from the same window). The kernels may take the rule from the
  indices instead of reading each row's span (the pipelined TPU kernels
  do: two comparisons with iotas, and only as many key or query blocks a
  step as the window reaches); the others read the spans.
- `softcap=c` (c > 0) among the params: scores are capped before masking,
  s = c * tanh(scale * q.kᵀ / c) + mask (Gemma 2's logit softcapping). The
  backward multiplies the scores' gradient by 1 - tanh², computed from the
  same unmasked value: dq = scale * Σ_j ds_ij (1 - t_ij²) k_j, dk likewise.

Sinks (a logit per query head in each row's softmax denominator) need no
kernel: the op layer folds them into o and lse after the forward (o *=
exp(lse - lse'), lse' = logaddexp(lse, sink)) and hands the backward that
lse, with which the backward's p = exp(s - lse) is the probability with the
sink; the sink's own gradient is a reduction the op layer does.

Operands after the fixed ones are therefore `[mask][, spans][, key_spans]
[, keys]`; `attention_operands` names them from the params.

`execution` is what the backend passes (kernels/spec.py).
"""

from __future__ import annotations

import dataclasses

MAX_HEAD_DIM = 256

# The dropout hash's constants (see above): the golden ratio's odd 32-bit
# multiplier, and lowbias32's (Wellons, "Hash function prospector", 2018).
DROPOUT_GOLDEN = 0x9E3779B9
DROPOUT_MIX = (0x7FEB352D, 0x846CA68B)
DROPOUT_BITS = 24  # the hash's top bits compared with the threshold


@dataclasses.dataclass(frozen=True)
class AttentionDims:
    batch: int  # B
    q_heads: int  # Hq
    kv_heads: int  # Hkv
    q_len: int  # L
    kv_len: int  # S
    head_dim: int  # E
    value_dim: int  # Ev

    @property
    def group(self) -> int:
        """Query heads per key/value head (G)."""
        return self.q_heads // self.kv_heads


def attention_dims(q_shape, k_shape, v_shape, mask_shape=None) -> AttentionDims:
    """The sizes of a canonical attention call, after checking its shapes
    keep the contract above (the op layer has already told the user, in
    torch's terms, about anything wrong)."""
    b, hq, l, e = q_shape
    bk, hkv, s, ek = k_shape
    bv, hv, sv, ev = v_shape
    if (bk, ek) != (b, e) or (bv, hv, sv) != (bk, hkv, s) or hq % hkv:
        raise ValueError(f"attention: q {tuple(q_shape)}, k {tuple(k_shape)}, v "
                         f"{tuple(v_shape)} do not keep the canonical layout")
    if mask_shape is not None:
        bm, hm, lm, sm = mask_shape
        if bm not in (1, b) or hm not in (1, hq) or (lm, sm) != (l, s):
            raise ValueError(f"attention: mask {tuple(mask_shape)} is not (1 or {b}, "
                             f"1 or {hq}, {l}, {s})")
    return AttentionDims(b, hq, hkv, l, s, e, ev)


def attention_flops(dims: AttentionDims, causal: bool) -> int:
    """FLOPs of the forward's two products (4·B·Hq·L·S·E, with Ev for the
    second), halved when causal (as FlashAttention counts them)."""
    flops = 2 * dims.batch * dims.q_heads * dims.q_len * dims.kv_len * (dims.head_dim + dims.value_dim)
    return flops // 2 if causal else flops


def dropout_threshold(dropout_p: float) -> int:
    """The kept scores' least hash value (top DROPOUT_BITS bits): p = 1
    gives 2**24, which no hash reaches (all dropped)."""
    return round(float(dropout_p) * 2**DROPOUT_BITS)


def dropout_scale(dropout_p: float) -> float:
    """What a kept probability is multiplied by: 1 / (1 - p) (0 for p = 1,
    where nothing is kept)."""
    return 0.0 if dropout_p >= 1.0 else 1.0 / (1.0 - float(dropout_p))


def dropout_param(dropout_p: float) -> dict:
    """A kernel body's dropout keyword: none without dropout, so that the
    body traced then is the one traced before dropout existed."""
    return {"dropout_p": float(dropout_p)} if dropout_p > 0 else {}


def optional_operands(operands, dropout_p: float = 0.0) -> tuple:
    """(mask or None, dropout keys or None) from the operands after the fixed
    ones (q, k, v; or q, k, v, o, do, lse): `[mask][, keys]`, keys present
    exactly when dropout_p > 0. Works on arrays and on avals alike."""
    operands = tuple(operands)
    keys = None
    if dropout_p > 0:
        if not operands:
            raise ValueError(f"attention: dropout_p={dropout_p} needs the dropout keys operand")
        *operands, keys = operands
    if len(operands) > 1:
        raise ValueError(f"attention: {len(operands)} operands where a mask or none is expected")
    return (operands[0] if operands else None), keys


@dataclasses.dataclass(frozen=True)
class AttentionOperands:
    """The optional operands of an attention call, None where absent."""

    mask: object = None
    spans: object = None  # (L, 2) int32 [start, end) of each query row's keys
    key_spans: object = None  # (S, 2) int32, backward only
    keys: object = None  # dropout's rows' keys


def attention_operands(operands, params, *, backward: bool = False) -> AttentionOperands:
    """Names the operands after the fixed ones (q, k, v; or q, k, v, o, do,
    lse): `[mask][, spans][, key_spans][, keys]`, spans present when
    params["spans"], key_spans with them in the backward, keys when
    params["dropout_p"] > 0. Works on arrays and on avals alike."""
    rest = list(operands)
    keys = key_spans = spans = None
    if params.get("dropout_p", 0.0) > 0:
        if not rest:
            raise ValueError("attention: dropout_p > 0 needs the dropout keys operand")
        keys = rest.pop()
    if params.get("spans", False):
        if len(rest) < (2 if backward else 1):
            raise ValueError("attention: spans=True needs the spans operand"
                             + (" and key_spans" if backward else ""))
        if backward:
            key_spans = rest.pop()
        spans = rest.pop()
    if len(rest) > 1:
        raise ValueError(f"attention: {len(rest)} operands where a mask or none is expected")
    return AttentionOperands(rest[0] if rest else None, spans, key_spans, keys)


def softcap_param(softcap: float) -> dict:
    """A kernel's softcap keyword: none when off (0)."""
    return {"softcap": float(softcap)} if softcap > 0 else {}
