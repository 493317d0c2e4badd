"""The key spans of kernels/attention_shapes.py: for each query row the
[start, end) of the keys it may see, from a sliding window and causal rule
(SDPA's top-left alignment) or from packed sequences (`cu_seq_q`,
`cu_seq_k`, each sequence's window aligned bottom-right, as FlashAttention
aligns it), and their transpose for the backward. Torch ops on the
tensors' device, no host read: what the op traces under torch.compile.

A window (left, right) lets query i see keys d - left <= j <= d + right,
d the query's diagonal key (i top-left; within a sequence of Lq queries and
Lk keys, its row + Lk - Lq, bottom-right); -1 is unbounded on that side,
(-1, 0) is causal.
"""

from __future__ import annotations

import torch


def _bounded(spans_start, spans_end, low, high):
    """[start, end) clipped to [low, high], end never before start (a row
    that sees nothing has start == end), as one (rows, 2) int32 tensor."""
    start = torch.minimum(torch.maximum(spans_start, low), high)
    end = torch.maximum(torch.minimum(spans_end, high), start)
    return torch.stack((start, end), dim=-1).to(torch.int32)


def window_spans(length: int, kv_length: int, left: int, right: int, device) -> torch.Tensor:
    """(length, 2) int32: query row i's keys under the window (left, right)
    aligned top-left (d = i)."""
    i = torch.arange(length, dtype=torch.int64, device=device)
    start = i - left if left >= 0 else torch.zeros_like(i)
    end = i + right + 1 if right >= 0 else torch.full_like(i, kv_length)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return _bounded(start, end, zero, zero + kv_length)


def sequence_spans(cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, rows: int, left: int,
                   right: int) -> torch.Tensor:
    """(rows, 2) int32 for packed sequences: row t of sequence b (cu_seq_q[b]
    <= t < cu_seq_q[b + 1]) sees keys of cu_seq_k[b] <= j < cu_seq_k[b + 1]
    within the window aligned bottom-right; rows past cu_seq_q[-1] see
    nothing."""
    cu_q, cu_k = cu_seq_q.to(torch.int64), cu_seq_k.to(torch.int64)
    t = torch.arange(rows, dtype=torch.int64, device=cu_q.device)
    # Each row's sequence; the rows past the last sequence get index N and
    # an empty span at the last key.
    sequences = cu_q.shape[0] - 1
    b = torch.bucketize(t, cu_q[1:], right=True)
    inside = b < sequences
    b = b.clamp(max=max(sequences - 1, 0))
    q0, q1 = cu_q.index_select(0, b), cu_q.index_select(0, b + 1)
    k0, k1 = cu_k.index_select(0, b), cu_k.index_select(0, b + 1)
    diagonal = k0 + (t - q0) + (k1 - k0) - (q1 - q0)
    start = diagonal - left if left >= 0 else k0
    end = diagonal + right + 1 if right >= 0 else k1
    last = cu_k[-1]
    start = torch.where(inside, torch.maximum(start, k0), last)
    return _bounded(start, torch.where(inside, end, last), torch.zeros_like(k0),
                    torch.where(inside, k1, last))


def key_spans(spans: torch.Tensor, kv_length: int) -> torch.Tensor:
    """(kv_length, 2) int32: key j is seen by the rows key_spans[j, 0] <= i <
    key_spans[j, 1] (spans' columns are non-decreasing, so those rows are
    one range: past the rows that end at or before j, before the rows that
    start after j)."""
    j = torch.arange(kv_length, dtype=torch.int32, device=spans.device)
    first = torch.searchsorted(spans[:, 1].contiguous(), j, right=True)
    past = torch.searchsorted(spans[:, 0].contiguous(), j, right=True)
    return torch.stack((first, torch.maximum(past, first)), dim=-1).to(torch.int32)


def visible(spans: torch.Tensor, kv_length: int) -> torch.Tensor:
    """(rows, kv_length) bool: which keys each row sees (for references)."""
    j = torch.arange(kv_length, device=spans.device)
    return (spans[:, :1] <= j) & (j < spans[:, 1:])


# --- a padded batch as packed sequences ---------------------------------------------
#
# A self-attention batch padded to one length (B rows of S tokens, `padding`
# (B, S) true at the real tokens, each row's real tokens one run: left,
# right or both sides padded) is folded into one row of B·S tokens, row b's
# tokens at b·S + j, and cut into five sequences a row:
#
#     queries:  padding before | (none)          | real | padding after | (none)
#     keys:     (none)         | padding before  | real | (none)        | padding after
#
# so a real token sees its row's real tokens alone (the window and causal
# rule aligned in the real run, which starts at the same index for queries
# and keys), a padding token's query sees no key (o = 0, gradient 0: what
# flash-attention gives a padded row after unpadding), and no padding key
# is seen. The lengths are data; the number of sequences, 5B, is not.

SEQUENCES_PER_ROW = 5
# What the JAX-side paths say, refusing a dense mask, that they serve instead.
PADDING_SERVED = ('a padding mask is served as packed sequences: '
                  'torch_pallas.jax.attention(padding_mask=...), and transformers\' '
                  'attn_implementation="pallas" sends a tokenizer\'s attention_mask that way')


def padded_batch_sequences(padding: torch.Tensor):
    """(cu_seq_q, cu_seq_k, holes) for `padding` (B, S), bool or 0/1
    integers (1: a real token): cu_seq_* (5B + 1,) int32 of the folded batch
    (above), holes (B,) bool true where a row's real tokens are not one run
    (the sequences then cover the run from its first real token to its
    last, padding between included: callers refuse or poison such rows)."""
    real = padding != 0
    batch, length = real.shape
    index = torch.arange(length, dtype=torch.int64, device=real.device)
    count = real.sum(-1)
    start = torch.where(real, index, length).amin(-1)
    end = torch.where(real, index + 1, 0).amax(-1)
    start = torch.where(count > 0, start, 0)  # a row with no real token: all of it padding
    end = torch.maximum(end, start)
    holes = count != end - start
    zero, size = torch.zeros_like(start), end - start
    queries = torch.stack((start, zero, size, length - end, zero), dim=-1)
    keys = torch.stack((zero, start, size, zero, length - end), dim=-1)
    first = torch.zeros(1, dtype=torch.int64, device=real.device)
    cu_q = torch.cat((first, queries.reshape(-1).cumsum(0))).to(torch.int32)
    cu_k = torch.cat((first, keys.reshape(-1).cumsum(0))).to(torch.int32)
    return cu_q, cu_k, holes
