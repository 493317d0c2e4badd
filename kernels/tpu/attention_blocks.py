"""What the TPU attention kernels (attention.py, attention_backward.py)
share: the two kernel bodies they choose between, the block sizes of each,
the score block's visibility rule and the products in float32.

Two bodies, chosen by the config:

- `Body.PIPELINED` (TPU, `tpu_interpret`): FlashAttention's blocks in VMEM,
  walked by `pltpu.emit_pipeline`, batch / heads / query blocks (or key
  blocks) PARALLEL and split across the TensorCores, the reduction axis
  ARBITRARY.
- `Body.BATCHED` (`interpret`, JAX's generic interpreter on CPU): that
  interpreter pays per grid step and per copied block, so the body reads
  (batch, kv-head, query-row) blocks straight from the operands, in a loop,
  and multiplies them with batched products (one XLA dot over every head in
  the block); keys are taken in chunks with an online softmax where the
  rows are long (their scores would exceed a cache-sized block) or where
  chunks ran faster (batched_blocks' bands of key counts, measured). The
  bound keeps memory flat for long sequences, and it keeps each block's
  scores in the CPU's caches (every product and softmax pass over a block
  that does not fit is memory-bound there). With spans (a window, packed
  sequences) a query block takes the keys its rows reach in one slab, a
  plain softmax, where a slab holds them (span_config, spans_config). It
  never lowers for a TPU.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels.attention_shapes import AttentionDims
from torch_pallas.kernels.padding import pad_to
from torch_pallas.kernels.shapes import cdiv, round_up
from torch_pallas.kernels.tpu import chip

# Batched body blocks (measured on the 2-core CPU; see batched_blocks).
# Keys: (up to this many keys, the most keys of a chunk; None: every key at
# once), the first band that holds the row's keys applies. Causal blocks
# are square (rows x keys), those above the diagonal skipped.
KEY_BANDS = ((128, None), (256, 128), (512, None), (None, 512))
BACKWARD_KEY_BANDS = ((1024, None), (None, 1024))
CAUSAL_KEY_BANDS = ((128, None), (1023, 128), (None, 512))
# Rows: every key at once, about BLOCK_SCORE_BYTES of float32 scores, the
# rows of several (batch, kv head) pairs packed where they fit; in chunks,
# CHUNKED_ROWS (causal: as many as the chunk's keys), of one pair at most
# unless a pair has fewer than PACKED_BELOW rows (decoding).
BLOCK_SCORE_BYTES = 2 * 2**20
CHUNKED_ROWS = 512
PACKED_BELOW = 64
# TPU vector tiles: sublanes (second-to-last axis; 16 covers packed 16-bit
# rows) and lanes (last axis).
SUBLANES = 16
LANES = 128


SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")


def unsupported(backend: str, avals, params) -> str | None:
    """Why the kernels cannot run a call (its q, k, v dtype), or None."""
    dtypes = {dtype for _, dtype in avals[:3]}
    if not dtypes <= set(SUPPORTED_DTYPES):
        return (f"backend '{backend}' has no attention kernel for {sorted(dtypes)} "
                f"(it computes {', '.join(SUPPORTED_DTYPES)})")
    return None


# Query rows and keys per block on a chip. 128 x 128 (JAX issue 24633: the
# shipped flash kernel's default, ~7 TFLOP/s on v5e) left v5e's MXU idle.
# Causal bfloat16 D128 on v5e, B2 H16 L4096 / B1 H16 L8192, forward (256
# keys a sub-step) and backward (dq fused) kernels (ms, bench/tpu_check.py's
# sweep, 2026-12-06): 512 x 512 2.10 + 3.21 / 3.60 + 5.68; 1024 x 512 1.72 +
# 3.13 / 2.83 + 5.30; 512 x 1024 1.85 + 3.11 / 3.00 + 5.29; 1024 x 1024 1.52
# + 3.00 / 2.47 + 5.02; 2048 x 1024 1.56 + 3.55 / 2.37 + 5.62 (splash
# attention at its best blocks: 1.505 / 2.382 forward, 4.378 / 7.481 both):
# 1024 x 1024 for the lightest kernels, smaller blocks where a kernel holds
# more in VMEM (Mosaic's 16 MiB): by its load, 1 for 16-bit operands (2 for
# float32, float16 included: it runs as float32 on the chip), 1 more for
# each of a mask, the rows' spans read block by block (packed sequences; a
# window's come from the indices), a softcap and the backward. Measured on
# v5e (compile):
# 1024 x 1024 fits a load of 2 (bfloat16 backward, float32 or masked
# bfloat16 forward) and overflows at 3 (17-19 MiB), 512 x 1024 fits 3
# (float32 backward) and overflows at 4, 512 x 512 fits 4 (masked float32
# backward); 256 x 512 for more.
CHIP_BLOCKS_BY_LOAD = {1: (1024, 1024), 2: (1024, 1024), 3: (512, 1024), 4: (512, 512)}
CHIP_BLOCKS_HEAVIEST = (256, 512)
# A sliding window at most NARROW_WINDOW_KEYS wide (its span_width) in
# blocks of at most NARROW_WINDOW_BLOCKS: a query block of 1024 visits 2048
# keys for its 1024, one of 512 visits 1536 in three steps. v5e, window
# (1023, 0), bfloat16 B1 H16 L8192 D128 (ms, bench/tpu_check.py's
# sweep_attention_window, 2026-12-07): forward / backward 1024 x 1024 (512
# keys a sub-step) 1.207 / 2.356, 512 x 512 1.169 / 2.161, 512 x 1024 1.286
# / 2.433, 1024 x 512 1.298 / 2.511 (splash at its fastest: 1.166 forward).
# Wider windows keep the load's blocks: 2048 keys 1.646 / 3.164 in
# 512-blocks against 1.554 / 3.131 in 1024-blocks, 4096 keys 2.442 / 4.761
# against 2.108 / 4.364.
NARROW_WINDOW_KEYS = 1024
NARROW_WINDOW_BLOCKS = (512, 512)
# Keys a key block's scores are made at a time (forward, backward's dk/dv).
# v5e, causal bfloat16 D128, 1024 x 1024 blocks, B2 H16 L4096 / B1 H16
# L8192 (ms, bench/tpu_check.py's sweep, 2026-12-06). Forward: all 1024 at
# once 1.657 / 2.690, 512 at a time 1.558 / 2.519, 256 1.525 / 2.452, 128
# 2.027 / 3.361 (splash's best, 512 at a time: 1.505 / 2.382). Backward
# (dq fused): all at once 2.996 / 5.030, 512 2.936 / 4.914, 256 2.973 /
# 4.988, 128 3.408 / 5.790. A sub-step's scores are a smaller live block
# (1024 x 256 float32: 1 MiB, not 4). Since then the forward's rows'
# maxima go unguarded where every row sees key 0 (no mask, no spans: no
# compare and select of the maxima against -inf each sub-step), and its
# block body for v5e (bench/tpu_bundles.py, which orders the sweep above
# as the chip did) takes 4581 bundles 512 keys at a time, 4665 256 at a
# time; guarded 4875 and 4708 (splash's 4545): not yet timed. A window a
# query block wide to the left takes its diagonal key block first and goes
# unguarded too: 4660 bundles at 512 keys, against 4750 guarded at 256.
CHIP_K_COMPUTE = {"forward": 256, "forward_unguarded": 512, "backward": 512}
# The simulator's budget for the backward's fused dq (no VMEM to run out of
# there; sized like a chip's to keep the two-kernel path for long rows).
SIMULATED_FUSED_DQ_BYTES = chip.RAISED_VMEM_LIMIT - chip.DEFAULT_VMEM_BUDGET


def chip_config(dtype: str, params, *, masked: bool, backward: bool,
                device=None) -> "AttentionConfig":
    """The chip's blocks for a kernel of this load (CHIP_BLOCKS_BY_LOAD), by
    its kernel parameters (`params`: the rows' spans read block by block
    unless they are a window's, which come from the indices; a softcap),
    no larger than NARROW_WINDOW_BLOCKS for a narrow window; the backward's
    fused dq takes what VMEM the chip has beyond the blocks' 16 MiB
    (chip.vmem_limit; none where the chip is unknown)."""
    spans = bool(params.get("spans"))
    row_spans = spans and "window" not in params
    load = ((1 if dtype == "bfloat16" else 2) + masked + backward + row_spans
            + bool(params.get("softcap")))
    block_q, block_k = CHIP_BLOCKS_BY_LOAD.get(load, CHIP_BLOCKS_HEAVIEST)
    window = params["window"] if spans and not row_spans else None
    if window is not None and 0 < params.get("span_width", 0) <= NARROW_WINDOW_KEYS:
        block_q = min(block_q, NARROW_WINDOW_BLOCKS[0])
        block_k = min(block_k, NARROW_WINDOW_BLOCKS[1])
    # The forward's maxima need no guard where a row's first sub-step has a
    # key it sees (no mask; no spans, or a window's, its diagonal block first).
    unguarded = not masked and (not spans or (
        not row_spans and rows_see_diagonal_key(window,
                                                block_k // math.gcd(block_q, block_k),
                                                block_q, block_k)))
    compute = CHIP_K_COMPUTE["backward" if backward else
                             "forward_unguarded" if unguarded else "forward"]
    config = AttentionConfig(Body.PIPELINED, block_q=block_q, block_k=block_k,
                             head_multiple=LANES, block_k_compute=compute)
    limit = chip.vmem_limit(device)
    if backward and limit > chip.DEFAULT_VMEM_BUDGET:
        config = dataclasses.replace(config, vmem_limit=limit,
                                     fused_dq_bytes=limit - chip.DEFAULT_VMEM_BUDGET)
    return config


class Body(enum.Enum):
    PIPELINED = "pipelined"  # VMEM blocks, emit_pipeline (TPU)
    BATCHED = "batched"  # whole blocks, batched products (generic interpreter, CPU)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """The tuning knobs of the forward and backward kernels."""

    body: Body
    block_q: int | None  # query rows per block; None: all
    block_k: int | None  # keys per block (pipelined) or per chunk (batched); None: all
    block_b: int | None = None  # batched: batch entries per block; None: all
    block_h: int | None = None  # batched: key/value heads per block; None: all
    head_multiple: int = 1  # head dimensions padded to a multiple of this
    # batched, with spans: the key counts a query block may take at once,
    # the narrowest that holds its spans (a sliding window's band, a packed
    # sequence's causal rows), a plain softmax; a block whose spans reach
    # further takes the key chunks. (): key chunks only
    slabs: tuple[int, ...] = ()
    # pipelined forward and dk/dv: keys a key block's scores are made at a
    # time (a divisor of the block; None: all of them at once)
    block_k_compute: int | None = None
    # pipelined backward: the most VMEM bytes dq may take fused into the
    # dk/dv kernel (attention_backward.fused_dq_bytes); 0: a kernel of its own
    fused_dq_bytes: int = 0
    # on a chip: the scoped VMEM asked of Mosaic (chip.vmem_limit); None: its default
    vmem_limit: int | None = None

    @classmethod
    def default(cls, backend: str) -> "AttentionConfig":
        """The batched body on `interpret`; otherwise the simulator's blocks
        (a chip's come from chip_config, by the kernel's load and the chip's
        VMEM)."""
        if backend == "interpret":
            return cls(Body.BATCHED, None, None)
        # the simulator: small blocks, quick to simulate, many of them; dq
        # fused as on a chip with VMEM to spare
        return cls(Body.PIPELINED, block_q=128, block_k=128, head_multiple=LANES,
                   fused_dq_bytes=SIMULATED_FUSED_DQ_BYTES)


@dataclasses.dataclass(frozen=True)
class BatchedBlocks:
    """One block of the batched body: `batch` x `kv_heads` (with all their
    query heads) x `q_rows` query rows, keys taken `k_chunk` at a time."""

    batch: int
    kv_heads: int
    q_rows: int
    k_chunk: int


def _divisors_down(n: int):
    return [d for d in range(n, 0, -1) if n % d == 0]


def _even(n: int, most: int) -> int:
    """The length of the fewest equal blocks of at most `most` covering `n`
    (n itself when it fits): a divisor of n where one is that close, so
    that padding, which copies the operands (the mask too), is rare and
    small."""
    if most >= n:
        return n
    return cdiv(n, cdiv(n, max(most, 1)))


def _band(bands, s: int):
    """The most keys of a chunk for rows of `s` keys (None: all of them)."""
    return next(most for upto, most in bands if upto is None or s <= upto)


def batched_blocks(dims: AttentionDims, *, causal: bool = False,
                   backward: bool = False) -> BatchedBlocks:
    """The batched body's blocks: large enough that XLA CPU's GEMMs run
    near their speed and the loop takes few steps, small enough that a
    block's scores stay in the CPU's caches and memory stays flat for long
    sequences. Measured on the 2-core AMD EPYC (1 MiB L2 per core, AVX2),
    B=4, H=8, E=64, float32, forward against torch's SDPA, each form
    compiled in one process and timed in interleaved rounds (2026-12-04;
    this VM's two cores alternate between two speeds for seconds at a time,
    so forms timed in different processes do not compare). Blocks as
    (rows x keys), one head each unless said:

    - L=S=128: 128 x 128 0.78-0.99x torch, all 32 heads in one block
      0.73-0.79x, 4 or 8 heads 0.51-0.63x. L=S=64 and 37: 0.74-0.88x
      whatever the packing.
    - L=S=192: 192 x 96 chunks 0.63x (1.05x in another run), 192 x 192
      0.48x (0.83x), 8 heads of 192 x 192 0.66x. L=S=256: 256 x 128 chunks
      0.60-0.72x, 128 x 128 0.57-0.93x, 256 x 256 0.44-0.52x, 8 heads of
      256 x 256 0.44-0.49x, two heads of 256 x 128 0.41-0.45x.
    - L=S=320: every key 0.52x, 107-key chunks 0.44x. L=S=384: every
      key, 2 or 1 heads, 0.53-0.65x; 128- and 192-key chunks 0.40-0.57x.
      L=S=512: every key, 2 or 1 heads, 0.73-0.79x; 256-key chunks
      0.60-0.67x, 128-key ones 0.53-0.58x, 512 x 128 0.34x.
    - L=S=768: 384 x 384 chunks 0.65x, 768 x 768 0.65x, 384 x 768 (every
      key) 0.53x. L=S=1024: 512 x 512 chunks 0.88x, every key 0.70-0.78x.
      L=S=2048 (B=2): 512 x 512 chunks 0.90x, 512 x 1024 0.73x.
    - causal (the diagonal blocks masked): 128 x 128 blocks 0.56x torch at
      128 keys, 0.66x at 190 and 256, 0.72x at 384, 0.79x at 512, 0.65x
      at 768; whole rows of keys (one masked block) 0.49x, 0.45x, 0.37x,
      0.51x, 0.63x and 0.58x. From 1024 keys on 512 x 512 blocks win: 0.68x
      against 0.67x at 1024, 0.71x against 0.60x at 2048 (B=2). Forward and
      backward at 256 and 512 keys: 128 x 128 blocks 0.61x and 0.80x
      torch, whole rows 0.48x and 0.72x. With 4 query heads a key/value
      head, at 512: 32 query rows (x 4 heads) 0.80x, 64 rows 0.87x, 128
      rows 0.58x.
    - backward (its five products per block), every key at once as far
      as 1024 keys and 2 MiB blocks: at 256, 8 heads of 256 x 256 22.2 ms,
      one head 25.4 ms, 256 x 128 chunks 21.0 ms; at 512, 2 heads 56.9 ms,
      one 66.4 ms; at 1024, 512 x 1024 236 ms, 512 x 512 chunks 244 ms.

    The GEMMs' speed moves with the block's shape in no simple way (XLA's
    YNNPACK dots), hence the bands. An earlier session on this host type
    measured 2 MiB blocks of every key fastest at 512 (0.88x) and 1024, and
    an AVX-512 Xeon preferred 1 MiB blocks and 128 x 128 causal chunks.

    Rows count every query head of the block; a block holds all G query
    heads of its key/value heads."""
    g, l, s = dims.group, dims.q_len, dims.kv_len
    least = g * min(l, 8)  # the fewest rows of a block: 8 query rows of each head
    bands = CAUSAL_KEY_BANDS if causal else BACKWARD_KEY_BANDS if backward else KEY_BANDS
    most = _band(bands, s)
    if most is None and BLOCK_SCORE_BYTES // (4 * s) >= least:
        chunk, rows = s, BLOCK_SCORE_BYTES // (4 * s)
    else:
        most = most or s
        chunk = _even(s, min(most, BLOCK_SCORE_BYTES // (4 * least)))
        rows = most if causal else CHUNKED_ROWS
        if g * l >= PACKED_BELOW:
            rows = min(rows, g * l)
        rows = max(rows, least)
    if rows < g * l:  # one (batch, kv head), part of its query rows
        return BatchedBlocks(1, 1, _even(l, rows // g), chunk)
    pairs = rows // (g * l)  # (batch, kv head) pairs per block
    bh = max(d for d in _divisors_down(dims.kv_heads) if d <= pairs)
    bb = max(d for d in _divisors_down(dims.batch) if d * bh <= pairs)
    return BatchedBlocks(bb, bh, l, chunk)


def pipelined_block(n: int, block: int, multiple: int) -> int:
    """A TPU block along an axis of `n`: `block`, or for a shorter axis the
    axis rounded up to `multiple` (one block)."""
    return min(block, round_up(n, multiple))


def visible(q_start, k_start, shape, *, causal: bool, kv_len: int, padded_kv_len: int,
            spans=None, window=None):
    """Which scores of a block starting at query row `q_start` and key
    `k_start` may be nonzero: keys inside the true sequence (the padding is
    masked out), with `causal` only keys at or before the query, with
    `spans` (the block's rows' (start, end) columns, each (rows, 1)) only
    keys in start <= key < end, with `window` (left, right; the spans'
    rule, attention_shapes.py) only keys within left before and right after
    the row (-1: unbounded), from the indices alone. None when every score
    is visible. `shape` ends with (rows, keys); the result broadcasts
    against it."""
    rows, keys = shape[-2:]
    lead = (1,) * (len(shape) - 2)
    cond = None

    def both(seen):
        return seen if cond is None else cond & seen

    key = k_start + jax.lax.broadcasted_iota(jnp.int32, (*lead, 1, keys), len(shape) - 1)
    if causal or window is not None:
        row = q_start + jax.lax.broadcasted_iota(jnp.int32, (*lead, rows, 1), len(shape) - 2)
    if padded_kv_len > kv_len and (spans is None or window is not None):
        cond = key < kv_len  # spans end at kv_len anyway
    if causal:
        cond = both(key <= row)
    if window is not None:
        # Two comparisons with iotas: Mosaic makes them in place, where the
        # spans' columns are broadcast across lanes (the v5e forward's key
        # block 4788 bundles instead of 7945, causal's 4708; docs/tpu.md).
        left, right = window
        if left >= 0:
            cond = both(key >= row - left)
        if right >= 0:
            cond = both(key <= row + right)
    elif spans is not None:
        start, end = spans
        cond = both((key >= start) & (key < end))
    return cond


def masked_scores(q, k, mask, *, scale, q_start, k_start, causal, kv_len, padded_kv_len,
                  contract, batch_dims=0, softcap=0.0, spans=None, window=None):
    """(the scores of a block, masked, and the tanh of a softcap, or None)."""
    s, t = capped(dot(q, k, contract, batch_dims) * scale, softcap)
    if mask is not None:
        s = s + mask.astype(jnp.float32)
    seen = visible(q_start, k_start, s.shape, causal=causal, kv_len=kv_len,
                   padded_kv_len=padded_kv_len, spans=spans, window=window)
    return (s if seen is None else jnp.where(seen, s, -jnp.inf)), t


def window_reach(window, blocks: int, block: int, other_block: int, others: int) -> int:
    """The most blocks of `other_block` (of `others`) that one of the
    `blocks` blocks of `block` reaches under `window` (left, right) from
    it: keys for query blocks; for key blocks, query rows, the window
    mirrored (right, left). Every block without a window or where a side is
    unbounded."""
    if window is None:
        return others
    left, right = window
    if left < 0 or right < 0:
        return others
    most = max((b * block + block - 1 + right) // other_block - (b * block - left) // other_block
               for b in range(blocks)) + 1
    return min(most, others)


def rows_see_diagonal_key(window, q_blocks: int, block_q: int, block_k: int,
                          kv_len: int | None = None) -> bool:
    """Whether, under `window` (left, right), every row of each of the
    `q_blocks` query blocks sees the first key of its diagonal key block
    (the one holding the key at the block's first row; keys below kv_len,
    None: any): then a forward that takes that block first gives every row a
    score in its first sub-step, and its running maxima need no guard
    against -inf. At v5e's 1024 x 1024 blocks, any window of 1023 keys or
    more to the left."""
    left = window[0]
    for i in range(q_blocks):
        q0 = i * block_q
        c0 = q0 // block_k * block_k
        if kv_len is not None and c0 >= kv_len:
            return False
        if left >= 0 and q0 + block_q - 1 - left > c0:
            return False
    return True


# The most causal steps listed (causal_steps, causal_key_steps), two int32
# each forward and three backward in SMEM (1 MiB on v5e): 16384 steps take
# 128 / 192 KiB; 128k tokens in 1024-blocks make 8256 a head.
MAX_LISTED_STEPS = 16384


def causal_steps(q_blocks: int, block_q: int, block_k: int, k_blocks: int):
    """The (query block, key block) pairs a causal mask leaves visible, row
    by row, keys in order, flattened [i0, j0, i1, j1, ...] (int32), for a
    grid that walks only them; None where there are more than
    MAX_LISTED_STEPS. A step whose keys are all masked costs the pipeline's
    bookkeeping though it computes nothing: 28 of a head's 64 steps at
    L = 8192 in 1024-blocks."""
    return _listed([(i, j) for i in range(q_blocks)
                    for j in range(min((i * block_q + block_q - 1) // block_k, k_blocks - 1) + 1)])


def causal_key_steps(k_blocks: int, block_k: int, block_q: int, q_blocks: int, group: int):
    """The backward's causal_steps: for each key block, each of the `group`
    query heads of its key/value head, the query blocks with a row that sees
    it, flattened [j0, g0, i0, j1, ...] (int32); a key block no row sees
    keeps one step per head at the last query block (its gradients are
    written, zero). None where there are more than MAX_LISTED_STEPS."""
    return _listed([(j, g, i) for j in range(k_blocks) for g in range(group)
                    for i in range(min(j * block_k // block_q, q_blocks - 1), q_blocks)])


def listed_pair(steps, t):
    """The t-th (query block, key block) pair of causal_steps' list (in SMEM)."""
    return steps[2 * t], steps[2 * t + 1]


def last_key_block(i, block_q: int, block_k: int, padded_kv_len: int):
    """The last key block a causal query block i sees (traced)."""
    return jnp.minimum((i * block_q + block_q - 1) // block_k, padded_kv_len // block_k - 1)


def query_block_step(grid, blocks_at, listed: bool, block_q: int, block_k: int,
                     padded_kv_len: int):
    """Where a query-block-major grid (the forward's, dq's: a query block
    resident, its key blocks streaming) is, inside its body: (the step's
    last indices, query block, key block, whether it is the block's first
    step, its last). `blocks_at` maps the last indices to the blocks; with
    `listed` causal steps (causal_steps) every step is visible and key
    block 0 comes first."""
    step = tuple(pl.program_id(d) for d in range(2, len(grid)))
    i, kb = blocks_at(*step)
    if listed:
        return step, i, kb, kb == 0, kb == last_key_block(i, block_q, block_k, padded_kv_len)
    return step, i, kb, step[1] == 0, step[1] == grid[3] - 1


def add_listed_steps(scratch: dict, operands: list, make_steps, *, pairs: int,
                     num_cores: int) -> None:
    """A causal grid's listed steps (make_steps(): causal_steps or
    causal_key_steps, None where too many) as the kernel's SMEM scratch
    `steps` and its last operand, where the grid's `pairs` (batch, head)
    pairs, all a listed grid splits across the TensorCores, divide among
    them; else nothing (the kernel then skips the masked blocks)."""
    if pairs % num_cores:
        return
    steps = make_steps()
    if steps is not None:
        scratch["steps"] = pltpu.SMEM(steps.shape, jnp.int32)
        operands.append(steps)


def _listed(steps):
    """Steps (tuples of block indices) flattened into one int32 array for
    SMEM; None where there are more than MAX_LISTED_STEPS."""
    if len(steps) > MAX_LISTED_STEPS:
        return None
    return jnp.asarray([n for step in steps for n in step], jnp.int32)


def row_spans(spans_ref):
    """A pipelined block's rows' (start, end) columns, or None without spans."""
    return None if spans_ref is None else (spans_ref[:, 0:1], spans_ref[:, 1:2])


def over_key_sub_steps(block_k: int, compute: int | None, step) -> None:
    """step(cols, offset) for each `compute` keys of a `block_k` key block
    (`cols` a pl.ds into the block, `offset` its first key's place in it),
    the whole block at once where `compute` is None (compute_block). A
    loop, not straight-line code, so that each sub-step's scores die before
    the next one's are made (straight-line halves ran 48-53% slower on
    v5e)."""
    if compute is None:
        step(pl.ds(0, block_k), 0)
        return

    def body(c, carry):
        offset = pl.multiple_of(c * compute, compute)
        step(pl.ds(offset, compute), offset)
        return carry

    jax.lax.fori_loop(0, block_k // compute, body, None, unroll=True)


def capped(s, softcap: float):
    """(scores, tanh of the uncapped ones / softcap) with a softcap, the
    scores capped: softcap * tanh(s / softcap); (s, None) without."""
    if not softcap:
        return s, None
    t = jnp.tanh(s * (1.0 / softcap))
    return softcap * t, t


def span_blocks(spans, block_rows: int, block_cols: int):
    """(2, rows // block_rows) int32: for each block of `block_rows` rows of
    `spans` (rows, 2) [start, end) columns (non-decreasing, padded with
    their edge values), the first and one past the last block of
    `block_cols` columns any of its rows reaches (first == past: none)."""
    first = spans[0::block_rows, 0] // block_cols
    past = -(-spans[block_rows - 1::block_rows, 1] // block_cols)
    return jnp.stack([first, jnp.maximum(past, first)]).astype(jnp.int32)


def reached(table, i, j, leading=None):
    """The j-th column block query block i reaches (table from span_blocks,
    in SMEM); past the last, the last again (the pipeline fetches nothing
    new), and block 0 .. for a block that reaches none, the nearest. With
    `leading` (a block it reaches), that one first, then the others in
    order."""
    first, past = table[0, i], table[1, i]
    if leading is None:
        return jnp.maximum(jnp.minimum(first + j, past - 1), 0)
    n = jnp.minimum(j, past - first - 1)
    other = first + n - 1
    return jnp.where(n == 0, leading, jnp.where(other >= leading, other + 1, other))


def split_operands(operands, spans: bool, dropout_p: float):
    """(mask, spans, span table, dropout keys) of a pipelined kernel's
    optional operands `[mask][, spans, table][, keys]`, None where absent."""
    rest = list(operands)
    keys = rest.pop() if dropout_p > 0 else None
    table = spans_ = None
    if spans:
        table = rest.pop()
        spans_ = rest.pop()
    return (rest[0] if rest else None), spans_, table, keys


def split_blocks(blocks, spans: bool, dropout_p: float):
    """(mask, spans, dropout keys) blocks of a pipeline body's optional
    inputs `[mask][, spans][, keys]`."""
    rest = list(blocks)
    keys = rest.pop() if dropout_p > 0 else None
    spans_ = rest.pop() if spans else None
    return (rest[0] if rest else None), spans_, keys


def edge_padded(spans, rows: int):
    """spans (n, 2) padded to `rows` rows with its last row (so that the
    columns stay non-decreasing and a block's last row bounds it)."""
    return jnp.pad(spans.astype(jnp.int32), ((0, rows - spans.shape[0]), (0, 0)), mode="edge")


def dot(a, b, contract, batch_dims: int = 0):
    """a and b contracted along axes `contract` = (a's, b's) (ints or
    tuples), sharing their first `batch_dims` axes, accumulated in float32."""
    batch = tuple(range(batch_dims))
    ca, cb = (c if isinstance(c, tuple) else (c,) for c in contract)
    return jax.lax.dot_general(
        a, b, ((ca, cb), (batch, batch)),
        precision=chip.precision(a.dtype), preferred_element_type=jnp.float32)


def mask_block_index(mask_shape, b, h):
    """The mask's (batch, head) block for query batch `b` and head `h`:
    0 along a broadcast (size 1) axis, so the mask is read in place."""
    bm, hm = mask_shape[:2]
    return (b if bm > 1 else 0), (h if hm > 1 else 0)


def batched_config(dims, *, causal: bool = False, backward: bool = False) -> AttentionConfig:
    """The batched body's config for these sizes (see batched_blocks)."""
    blk = batched_blocks(dims, causal=causal, backward=backward)
    return AttentionConfig(Body.BATCHED, block_q=blk.q_rows, block_k=blk.k_chunk,
                           block_b=blk.batch, block_h=blk.kv_heads)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One call's operands as a body reads them, and its results given
    back: query rows padded to `lp`, keys to `sp` (zeros; the kernels mask
    the padded keys and the padded rows are sliced off), head dimensions to
    `e` and `ev`. `grouped` (the batched body): the rows of the G query
    heads of a key/value head together, (B, Hkv, G, Lp, ...), and per-row
    statistics (B, Hkv, G, Lp). Otherwise (the pipelined body) (B, Hq, Lp,
    ...), the statistics as (B, Hq, Lp, 1) columns for their blocks."""

    dims: AttentionDims
    lp: int
    sp: int
    e: int
    ev: int
    grouped: bool

    def rows(self, x, width: int | None = None, fill: float = 0.0):
        """A per-query-row operand, (B, Hq, L, ...) of `width` columns, or
        per-row statistics (B, Hq, L) where `width` is None; padded rows
        hold `fill`."""
        d = self.dims
        shape = (d.batch, d.q_heads, self.lp) + (() if width is None else (width,))
        if fill:
            x = jnp.pad(x, [(0, n - m) for m, n in zip(x.shape, shape)], constant_values=fill)
        x = pad_to(x, shape)
        if self.grouped:
            return as_groups(x, d.kv_heads)
        return x if width is not None else x.reshape(*shape, 1)

    def kv(self, x, width: int):
        """A per-key operand (k or v: B, Hkv, S, ...) of `width` columns."""
        return pad_to(x, (self.dims.batch, self.dims.kv_heads, self.sp, width))

    def optional(self, mask, keys) -> list:
        """[mask][, dropout keys] as the kernels read them: the mask (Bm,
        Hm, L, S) padded (its broadcast axes left at 1), grouped for the
        batched body; the rows' dropout keys (B, Hq, L) like statistics."""
        operands = []
        if mask is not None:
            mask = pad_to(mask, (*mask.shape[:2], self.lp, self.sp))
            operands.append(mask_groups(mask, self.dims.kv_heads) if self.grouped else mask)
        if keys is not None:
            operands.append(self.rows(keys))
        return operands

    def row_type(self, width: int | None, dtype) -> jax.ShapeDtypeStruct:
        """The type of a per-row result laid out like `rows`."""
        d = self.dims
        lead = ((d.batch, d.kv_heads, d.group) if self.grouped else (d.batch, d.q_heads))
        tail = (width,) if width is not None else (() if self.grouped else (1,))
        return jax.ShapeDtypeStruct((*lead, self.lp, *tail), dtype)

    def kv_type(self, width: int, dtype) -> jax.ShapeDtypeStruct:
        d = self.dims
        return jax.ShapeDtypeStruct((d.batch, d.kv_heads, self.sp, width), dtype)

    def row_result(self, x, width: int | None = None):
        """A per-row result (`row_type`) as (B, Hq, L[, width])."""
        d = self.dims
        if self.grouped:
            x = x.reshape(d.batch, d.q_heads, self.lp, *x.shape[4:])
        elif width is None:
            x = x[..., 0]
        x = x[:, :, :d.q_len]
        return x if width is None else x[..., :width]

    def kv_result(self, x, width: int):
        """A per-key result (`kv_type`) as (B, Hkv, S, width)."""
        return x[:, :, :self.dims.kv_len, :width]


def compute_block(config: AttentionConfig, block_k: int) -> int | None:
    """The keys per sub-step of a `block_k` key block: the
    config's where it divides the block (a short sequence's single block
    may be narrower), else the whole block (None)."""
    c = config.block_k_compute
    return c if c and c < block_k and block_k % c == 0 else None


def pipelined_layout(dims: AttentionDims, config: AttentionConfig):
    """(Layout, query block, key block) of the pipelined body: whole blocks
    of rows and keys, head dimensions in whole lanes."""
    bq = pipelined_block(dims.q_len, config.block_q, SUBLANES)
    bk = pipelined_block(dims.kv_len, config.block_k, LANES)
    layout = Layout(dims, round_up(dims.q_len, bq), round_up(dims.kv_len, bk),
                    round_up(dims.head_dim, config.head_multiple),
                    round_up(dims.value_dim, config.head_multiple), grouped=False)
    return layout, bq, bk


def batched_layout(op: str, dims: AttentionDims, config: AttentionConfig, num_cores: int):
    """(Layout, (batch, kv heads, query rows, key chunk) per block) of the
    batched body; `op` names the caller in its errors."""
    if num_cores != 1:
        raise ValueError(f"{op}: the batched body runs on one core, not {num_cores=} "
                         "(it is the generic interpreter's; use Body.PIPELINED)")
    b, hkv = dims.batch, dims.kv_heads
    bb, bh = config.block_b or b, config.block_h or hkv
    bq, ck = config.block_q or dims.q_len, config.block_k or dims.kv_len
    if b % bb or hkv % bh:
        raise ValueError(f"{op}: {config.block_b=} and {config.block_h=} must divide the "
                         f"batch {b} and the key/value heads {hkv}")
    layout = Layout(dims, round_up(dims.q_len, bq), round_up(dims.kv_len, ck),
                    dims.head_dim, dims.value_dim, grouped=True)
    return layout, (bb, bh, bq, ck)


# Spans of a known width (a sliding window): query blocks of SLAB_ROWS rows
# take their band of keys in one slab, as many heads at once as keep the
# scores within SLAB_SCORE_BYTES. Measured on the 2-core EPYC (Zen 4),
# 4096 tokens, 8 heads, E=64, a causal window of 512, float32, forward:
# 128-row blocks of all 8 heads 50-52 ms, 192 rows 51-53, 256 rows 51-53,
# 64 rows 65, 128 rows of one head 62-63; the chunk loop's 512 x 512 blocks
# 60-62 ms; full causal 136-142 ms (docs/performance.md).
SLAB_ROWS = 128
SLAB_SCORE_BYTES = 4 * 2**20


def span_config(dims: AttentionDims, width: int) -> AttentionConfig:
    """The batched body's blocks for spans at most `width` keys wide: one
    slab of the block's rows plus the width, chunks of the rows' size where
    a block's spans reach further (packed sequences)."""
    rows = min(dims.q_len, SLAB_ROWS)
    slab = min(dims.kv_len, rows - 1 + width)
    per_head = dims.group * rows * slab * 4
    bh = max([d for d in _divisors_down(dims.kv_heads) if d * per_head <= SLAB_SCORE_BYTES] or [1])
    return AttentionConfig(Body.BATCHED, block_q=rows, block_k=_even(dims.kv_len, rows),
                           block_b=1, block_h=bh, slabs=(slab,))


# Spans of no known width (packed sequences): query blocks of about
# SLAB_ROWS rows take their keys in the narrowest of a ladder of slabs, in
# steps of half a block up to PACKED_SLAB_MOST keys (a causal block's keys
# reach back to its sequence's start), as many heads at once as keep the
# widest slab's scores within PACKED_SCORE_BYTES; blocks that reach further
# (longer sequences) take key chunks of the rows' size.
PACKED_SLAB_MOST = 1280
PACKED_SCORE_BYTES = 8 * 2**20


def spans_config(dims: AttentionDims, *, backward: bool = False) -> AttentionConfig:
    """The batched body's blocks for spans of no known width (packed
    sequences): blocks and key chunks of about SLAB_ROWS, exact divisors of
    the rows and keys where there are such (a padded operand is a copy of
    it), and the ladder of slabs above. Measured on the 2-core EPYC (Zen
    4), 8 causal sequences of 64-1024 tokens packed into 4030, 8 heads,
    E=64, float32, forward, kernel level, interleaved: 130-row blocks of all
    8 heads, slabs in steps of 65 keys 43-44 ms, of 130 keys 45-47, of 130
    keys with 4 heads a block 48-50; 65-row blocks with 65-key steps 49-51;
    155-row blocks 47-50; the chunk loop alone (130 x 130, one head) 60-61
    ms; torch's SDPA on the padded batch (8, 8, 1024, 64) 80-82. Earlier,
    chunk loops only: 128 x 128 (padded to 4096) 69-70, the causal bands'
    504 x 504 78-89, 256 x 256 93-109 (docs/performance.md).

    The backward keeps the chunk loop, one head at a time: on the same
    case, interleaved, 130 x 130 chunks 168-183 ms, slabs in steps of 130
    keys 181-230 (two heads a block 197-214), in steps of 65 193-238, of 65
    with all 8 heads 220-242; with each slab's dK and dV added outside the
    branches no better; skipping the dK and dV updates altogether changed
    nothing (the time is the five products); a ladder of 20 slabs took 4 s
    to compile."""
    rows = _divisor_near(dims.q_len, SLAB_ROWS)
    keys = _divisor_near(dims.kv_len, SLAB_ROWS)
    if backward:
        return AttentionConfig(Body.BATCHED, block_q=rows, block_k=keys, block_b=1, block_h=1)
    step = cdiv(rows, 2)
    slabs = tuple(range(step, min(dims.kv_len, PACKED_SLAB_MOST) + step, step))
    per_head = dims.group * rows * slabs[-1] * 4
    bh = max([d for d in _divisors_down(dims.kv_heads) if d * per_head <= PACKED_SCORE_BYTES]
             or [1])
    return AttentionConfig(Body.BATCHED, block_q=rows, block_k=keys, block_b=1, block_h=bh,
                           slabs=slabs)


def _divisor_near(n: int, target: int) -> int:
    """A divisor of n within 3/4 .. 5/4 of `target`, the nearest; n itself
    when n is no longer; else `_even`'s near-equal blocks."""
    if n <= target:
        return n
    near = [d for d in range(target * 3 // 4, target * 5 // 4 + 1) if n % d == 0]
    return min(near, key=lambda d: abs(d - target)) if near else _even(n, target)


def slabs(config: AttentionConfig, lay) -> tuple[int, ...]:
    """The slabs the batched body takes (narrowest first; (): none): the
    config's, those narrower than the padded keys and the padded keys
    themselves where a wider one is asked for."""
    widths = {min(w, lay.sp) for w in config.slabs if w > 0}
    return tuple(sorted(widths))


def slab_choice(spans, row: int, rows: int, widths: tuple[int, ...], keys: int):
    """(branch, starts) for the block of `rows` rows from `row`: the index
    of the narrowest of `widths` whose slab holds every row's span
    (len(widths): none does), and each slab's first key: the block's
    first row's span start, moved back to stay within the `keys` keys."""
    first, past = spans[row, 0], spans[row + rows - 1, 1]
    starts = [jnp.clip(first, 0, keys - w) for w in widths]
    branch = sum((past - start > w).astype(jnp.int32) for start, w in zip(starts, widths))
    return branch, starts


def take_branch(branch, branches):
    """branches[branch](), as a two-way `lax.cond` where there are two: a
    window's one slab in an indexed `lax.switch` made its forward and
    backward slower on XLA CPU (4096 tokens, window 512: 415 against 246 ms;
    the backward's whole dK and dV sums seemingly copied per query block)."""
    if len(branches) == 2:
        return jax.lax.cond(branch == 0, *branches)
    return jax.lax.switch(branch, branches)


def select_config(backend: str, dims: AttentionDims, params, *, backward: bool = False):
    """On `interpret`, batched blocks with cache-sized scores
    (batched_blocks); TPU blocks elsewhere."""
    if backend != "interpret":
        return AttentionConfig.default(backend)
    if params.get("span_width"):
        return span_config(dims, int(params["span_width"]))
    if params.get("spans"):
        return spans_config(dims, backward=backward)
    return batched_config(dims, causal=bool(params.get("causal", False)), backward=backward)


def as_groups(x, kv_heads: int):
    """(B, Hq, ...) viewed as (B, Hkv, G, ...): query head h = kv * G + g
    (a reshape, no copy)."""
    b, hq, *rest = x.shape
    return x.reshape(b, kv_heads, hq // kv_heads, *rest)


def mask_groups(mask, kv_heads: int):
    """The mask (Bm, Hm, L, S) as (Bm, Hkv or 1, G or 1, L, S)."""
    bm, hm, l, s = mask.shape
    if hm == 1:
        return mask.reshape(bm, 1, 1, l, s)
    return mask.reshape(bm, kv_heads, hm // kv_heads, l, s)
