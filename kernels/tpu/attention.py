"""Scaled dot-product attention, forward, on TPU: FlashAttention with VMEM
blocks and an online softmax (Dao et al., "FlashAttention: Fast and
Memory-Efficient Exact Attention with IO-Awareness", 2022; FlashAttention-2,
Dao 2023, for the loop order and the statistics kept).

The contract (inputs, outputs, masks, causal, GQA, the +inf lse of a row that
sees no key) is kernels/attention_shapes.py's.

Pipelined body (TPU, `tpu_interpret`): `pl.kernel` on the TensorCore mesh;
`pltpu.emit_pipeline` walks the grid (B, Hq, L/bq, S/bk). A query block stays
resident in VMEM while key/value blocks stream past it: the key axis is
ARBITRARY (sequential), the others PARALLEL and split across the TensorCores.
Per (query block, key block): s = scale * q kᵀ (+ the mask block), then the
running row maximum m, denominator l and float32 accumulator acc (VMEM
scratch) are rescaled by exp(m_old - m_new) and updated; the last key block
writes o = acc / l and lse = m + log l. Causal, the grid walks only the
(query block, key block) pairs below the diagonal, listed in SMEM
(`causal_steps`; 36 of a head's 64 at L = 8192 in 1024-blocks) where the
(batch, head) pairs divide among the TensorCores; otherwise, where there
are too many to list, and with spans, blocks wholly out of reach are
skipped: their body does nothing, and their key/value/mask index maps repeat
the last visible block, so the pipeline fetches nothing new. A sliding
window at least a query block wide to the left takes each query block's
diagonal key block first: every row then has a score in the first sub-step,
and the running maxima need no guard against -inf, as without a mask. The
mask is read block by block from (Bm, Hm, L, S), a broadcast batch or head
axis mapped to block 0 by the index map (never copied); key/value head
h // G serves query head h the same way (GQA, never repeated in memory).
Ragged L and S are zero-padded to whole blocks once, outside the kernel (a
mask too, its broadcast axes left at 1; with L and S whole blocks nothing is
copied); the padded keys are masked (-inf) inside it, the padded rows sliced
off. Head dimensions are padded to whole lanes (128). Blocks: 128 query rows
(16 for a shorter L) x 128 keys, a starting point not yet timed on a TPU.

Batched body (`interpret`, JAX's generic interpreter on CPU): see
attention_blocks.py. Whole (batch, kv-head, query-row) blocks, all query
heads of a key/value head together, one batched product per block; keys in
chunks with the same online softmax when the scores would exceed the budget.

Dropout (kernels/attention_shapes.py), in both bodies: the rows' keys come
in blocks beside the query rows; each score block's probabilities enter
the sums l as they are and the product with v dropped and rescaled
(kernels/attention_dropout.py). Without dropout none of it is traced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torch_pallas.kernels import attention_dropout
from torch_pallas.kernels.attention_shapes import (attention_dims, attention_flops,
                                                   attention_operands, dropout_param,
                                                   softcap_param)
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.kernels.tpu import chip
from torch_pallas.kernels.tpu import attention_blocks as blocks_
from torch_pallas.kernels.tpu.attention_blocks import AttentionConfig, Body, dot, visible
from torch_pallas.kernels.tpu.cores import pipeline_core_split, tensorcore_mesh


# ---------------------------------------------------------------------------
# Pipelined body (TPU)


def _lanes(column, width: int):
    """A (rows, LANES) array whose lanes repeat one value per row, as (rows,
    width): the lanes tiled where width is a whole number of them (no lane
    broadcast), else its first column broadcast."""
    if width % blocks_.LANES == 0:
        return jnp.tile(column, (1, width // blocks_.LANES))
    return column[:, :1]


def pipelined_kernel(q_hbm, k_hbm, v_hbm, *refs, m_vmem, l_vmem, acc_vmem, scale, causal,
                     kv_len, group, block_k, num_cores, dropout_p=0.0, spans=False,
                     table=None, softcap=0.0, block_k_compute=None, window=None, steps=None):
    """q_hbm (B, Hq, Lp, Ep), k_hbm (B, Hkv, Sp, Ep), v_hbm (B, Hkv, Sp, Evp),
    an optional mask (Bm, Hm, Lp, Sp), with spans the rows' spans (Lp, 2)
    and each query block's key blocks (2, Lp / bq) [first, past] (copied to
    the SMEM scratch `table`), with dropout the rows' keys (B, Hq, Lp, 1)
    int32; outputs o (B, Hq, Lp, Evp) and lse (B, Hq, Lp, 1); scratch m, l
    (bq, LANES) and acc (bq, Evp), float32. A key block's scores are made
    `block_k_compute` keys at a time (None: all at once). With the spans'
    `window`, the element masks come from the indices (the rows' spans are
    not read) and a query block steps through the most key blocks a
    window reaches, not all of them, its diagonal block first where every
    row sees that block's first key. With the SMEM scratch `steps` (causal,
    no spans) the grid's last axis walks the visible (query block, key
    block) pairs listed in the last operand (blocks_.causal_steps) instead
    of every pair."""
    *ins, o_hbm, lse_hbm = refs
    if steps is not None:
        *ins, steps_hbm = ins
        pltpu.sync_copy(steps_hbm, steps)
    mask_hbm, spans_hbm, blocks_hbm, keys_hbm = blocks_.split_operands(ins, spans, dropout_p)
    batch, q_heads, lp, _ = q_hbm.shape
    sp = k_hbm.shape[2]
    bq, bk = acc_vmem.shape[0], block_k
    if steps is not None:
        grid = (batch, q_heads, steps.shape[0] // 2)
    else:
        grid = (batch, q_heads, lp // bq,
                blocks_.window_reach(window, lp // bq, bq, bk, sp // bk))
    row_blocks = spans and window is None  # the rows' spans, block by block
    # A window wide enough takes each query block's diagonal key block first:
    # every row sees its first key.
    diagonal_first = (window is not None and mask_hbm is None
                      and blocks_.rows_see_diagonal_key(window, lp // bq, bq, bk, kv_len))
    # Without a mask or spans every row sees key 0, in its first sub-step
    # (j = 0 is key block 0), or the diagonal block's first key: its running
    # maximum is never -inf.
    first_sub_step_seen = (mask_hbm is None and not spans) or diagonal_first
    if spans:
        pltpu.sync_copy(blocks_hbm, table)

    def kv_step(i, j):
        if spans:  # the j-th block the query block reaches; past them the last again
            return blocks_.reached(table, i, j, i * bq // bk if diagonal_first else None)
        # a skipped causal block repeats the last visible one
        return jnp.minimum(j, blocks_.last_key_block(i, bq, bk, sp)) if causal else j

    def blocks_at(*step):
        """(query block, key block) of a grid step's last indices."""
        if steps is not None:
            return blocks_.listed_pair(steps, step[0])
        return step[0], kv_step(*step)

    def body(q_ref, k_ref, v_ref, *rest):
        mask_ref, spans_ref, keys_ref = blocks_.split_blocks(rest[:-2], row_blocks, dropout_p)
        o_ref, lse_ref = rest[-2:]
        # Global block indices (emit_pipeline adds the core's offset).
        step, i, kb, first, last = blocks_.query_block_step(grid, blocks_at, steps is not None,
                                                            bq, bk, sp)

        @pl.when(first)
        def _():
            m_vmem[...] = jnp.full_like(m_vmem, -jnp.inf)
            l_vmem[...] = jnp.zeros_like(l_vmem)
            acc_vmem[...] = jnp.zeros_like(acc_vmem)

        def sub_step(cols, offset):
            """Keys `cols` of the block: the online softmax's update."""
            k_start = kb * bk + offset
            s, _ = blocks_.masked_scores(
                q_ref[...], k_ref[cols, :], None if mask_ref is None else mask_ref[:, cols],
                scale=scale, q_start=i * bq, k_start=k_start, causal=causal, kv_len=kv_len,
                padded_kv_len=sp, contract=(1, 1), softcap=softcap,
                spans=blocks_.row_spans(spans_ref), window=window)
            m_old = m_vmem[...]  # (bq, LANES), every lane the same
            m_new = jnp.maximum(m_old, s.max(axis=1, keepdims=True))
            # -inf where a row has seen nothing yet (then 0, for the exps)
            m_safe = m_new if first_sub_step_seen else jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - _lanes(m_safe, s.shape[1]))
            alpha = jnp.exp(m_old - m_safe)
            l_vmem[...] = alpha * l_vmem[...] + p.sum(axis=1, keepdims=True)
            v = v_ref[cols, :]
            if keys_ref is not None:
                p = p * attention_dropout.block_factors(keys_ref[...], k_start, p.shape,
                                                        dropout_p)
            acc_vmem[...] = (acc_vmem[...] * _lanes(alpha, acc_vmem.shape[1])
                             + dot(p.astype(v.dtype), v, (1, 0)))
            m_vmem[...] = m_new

        def update():
            blocks_.over_key_sub_steps(bk, block_k_compute, sub_step)

        if steps is not None:
            update()
        elif spans:
            pl.when(table[0, i] + step[1] < table[1, i])(update)
        elif causal:
            pl.when(step[1] * bk <= i * bq + bq - 1)(update)
        else:
            update()

        @pl.when(last)
        def _():
            # One reciprocal a row, in the lanes l is kept in: 952 bundles
            # for v5e against 1134 dividing by a broadcast column.
            l = l_vmem[...]  # (bq, LANES), every lane the same
            empty = l == 0.0  # a row that saw nothing: o = 0, lse = +inf
            inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
            o_ref[...] = (acc_vmem[...] * _lanes(inv, acc_vmem.shape[1])).astype(o_ref.dtype)
            l, empty = l[:, :1], empty[:, :1]
            lse_ref[...] = jnp.where(empty, jnp.inf, m_vmem[...][:, :1] + chip.log(l))

    e, ev = q_hbm.shape[3], v_hbm.shape[3]

    def rows(b, h, *step):
        return (b, h, blocks_at(*step)[0], 0)

    def kv_rows(b, h, *step):
        return (b, h // group, blocks_at(*step)[1], 0)

    in_specs = [
        pl.BlockSpec((None, None, bq, e), rows),
        pl.BlockSpec((None, None, bk, e), kv_rows),
        pl.BlockSpec((None, None, bk, ev), kv_rows),
    ]
    operands = [q_hbm, k_hbm, v_hbm]
    if mask_hbm is not None:
        def mask_index(b, h, *step):
            return (*blocks_.mask_block_index(mask_hbm.shape, b, h), *blocks_at(*step))

        in_specs.append(pl.BlockSpec((None, None, bq, bk), mask_index))
        operands.append(mask_hbm)
    if row_blocks:
        in_specs.append(pl.BlockSpec((bq, 2), lambda b, h, i, j: (i, 0)))
        operands.append(spans_hbm)
    if keys_hbm is not None:
        in_specs.append(pl.BlockSpec((None, None, bq, 1), rows))
        operands.append(keys_hbm)
    out_specs = [
        pl.BlockSpec((None, None, bq, ev), rows),
        pl.BlockSpec((None, None, bq, 1), rows),
    ]
    pltpu.emit_pipeline(
        body, grid=grid, in_specs=in_specs, out_specs=out_specs,
        **pipeline_core_split(num_cores, parallel_dims=len(grid) - 1),
    )(*operands, o_hbm, lse_hbm)


def pipelined_attention(q, k, v, mask, spans, keys, *, scale, causal, dropout_p, softcap,
                        config, interpret, num_cores, window=None):
    dims = attention_dims(q.shape, k.shape, v.shape, None if mask is None else mask.shape)
    lay, bq, bk = blocks_.pipelined_layout(dims, config)
    scratch = dict(m_vmem=pltpu.VMEM((bq, blocks_.LANES), jnp.float32),
                   l_vmem=pltpu.VMEM((bq, blocks_.LANES), jnp.float32),
                   acc_vmem=pltpu.VMEM((bq, lay.ev), jnp.float32))
    tables = ()
    if spans is not None:
        spans = blocks_.edge_padded(spans, lay.lp)
        tables = (spans, blocks_.span_blocks(spans, bq, bk))
        scratch["table"] = pltpu.SMEM(tables[1].shape, jnp.int32)
    operands = _operands(lay, q, k, v, mask, keys, tables)
    if causal and spans is None:
        blocks_.add_listed_steps(
            scratch, operands, lambda: blocks_.causal_steps(lay.lp // bq, bq, bk, lay.sp // bk),
            pairs=dims.batch * dims.q_heads, num_cores=num_cores)
    o, lse = pl.kernel(
        functools.partial(pipelined_kernel, scale=scale, causal=causal, kv_len=dims.kv_len,
                          group=dims.group, num_cores=num_cores, block_k=bk,
                          block_k_compute=blocks_.compute_block(config, bk),
                          **dropout_param(dropout_p), **softcap_param(softcap),
                          **({"spans": True} if spans is not None else {}),
                          **({"window": window} if window is not None else {})),
        out_type=(lay.row_type(lay.ev, q.dtype), lay.row_type(None, jnp.float32)),
        mesh=tensorcore_mesh(num_cores),
        scratch_types=scratch,
        interpret=interpret,
    )(*operands)
    return lay.row_result(o, dims.value_dim), lay.row_result(lse)


def _operands(lay, q, k, v, mask, keys, tables=()) -> list:
    """Both bodies' operands, laid out by `lay`: q, k, v[, mask][, spans
    tables][, dropout keys]."""
    rows = [lay.rows(q, lay.e), lay.kv(k, lay.e), lay.kv(v, lay.ev), *lay.optional(mask, None)]
    return rows + list(tables) + lay.optional(None, keys)


# ---------------------------------------------------------------------------
# Batched body (generic interpreter, CPU)


def batched_kernel(q_hbm, k_hbm, v_hbm, *refs, blocks, scale, causal, kv_len, dropout_p=0.0,
                   spans=False, softcap=0.0, slabs=()):
    """q_hbm (B, Hkv, G, Lp, E), k_hbm (B, Hkv, Sp, E), v_hbm (B, Hkv, Sp, Ev),
    an optional mask (Bm, Hkv or 1, G or 1, Lp, Sp), with spans the rows'
    spans (Lp, 2) and the query blocks' key chunks (2, Lp / bq), with
    dropout the rows' keys (B, Hkv, G, Lp) int32; outputs o (B, Hkv, G, Lp,
    Ev) and lse (B, Hkv, G, Lp). Blocks are read straight from the operands
    (the generic interpreter's refs are arrays). `slabs` (with spans): key
    counts, narrowest first; a query block takes its keys in the narrowest
    slab that holds its spans, from its first row's start, a plain softmax
    (a sliding window's band, a packed sequence's rows: no chunk loop, and
    only the keys the rows reach, rounded up to a slab, computed); blocks
    that reach further take the chunks."""
    *ins, o_hbm, lse_hbm = refs
    mask_hbm, spans_hbm, table_hbm, keys_hbm = blocks_.split_operands(ins, spans, dropout_p)
    batch, kv_heads, _, lp, _ = q_hbm.shape
    sp = k_hbm.shape[2]
    bb, bh, bq, ck = blocks
    grid = (batch // bb, kv_heads // bh, lp // bq)

    # Products over (bb * bh) batches of (G * rows) x keys, two-dimensional
    # when the block has one (batch, kv head): the shapes XLA CPU's GEMM
    # library takes without copying kᵀ. The scale multiplies q, not the
    # scores (a pass over (rows, E), not (rows, keys)).
    flat, g = bb * bh, q_hbm.shape[2]

    def product(a, b, contract):
        if flat == 1:
            return dot(a[0], b[0], (contract[0] - 1, contract[1] - 1))[None]
        return dot(a, b, contract, batch_dims=1)

    def one_block(bi, hi, qi):
        rows = (pl.ds(bi * bb, bb), pl.ds(hi * bh, bh), slice(None), pl.ds(qi * bq, bq))
        q = (q_hbm[rows].astype(jnp.float32) * scale).reshape(flat, g * bq, -1)
        row_keys = None if keys_hbm is None else keys_hbm[rows].reshape(flat, g * bq, 1)
        row_spans = None
        if spans_hbm is not None:
            span = spans_hbm[pl.ds(qi * bq, bq), :]
            row_spans = (span[:, 0:1], span[:, 1:2])

        def weights(p, c0):
            """What multiplies v: p, dropped and rescaled with dropout."""
            z = attention_dropout.block_factors(row_keys, c0, p.shape, dropout_p)
            return p if z is None else p * z

        def keys(c0, n):
            kv = (pl.ds(bi * bb, bb), pl.ds(hi * bh, bh), pl.ds(c0, n))
            k = k_hbm[kv].astype(jnp.float32).reshape(flat, n, -1)
            v = v_hbm[kv].astype(jnp.float32).reshape(flat, n, -1)
            s, _ = blocks_.capped(product(q, k, (2, 2)), softcap)  # (bb * bh, G * bq, n)
            seen = visible(qi * bq, c0, (bb, bh, g, bq, n), causal=causal, kv_len=kv_len,
                           padded_kv_len=sp, spans=row_spans)
            if mask_hbm is not None or seen is not None:
                s = s.reshape(bb, bh, g, bq, n)
                if mask_hbm is not None:
                    mb = pl.ds(bi * bb, bb) if mask_hbm.shape[0] > 1 else slice(None)
                    mh = pl.ds(hi * bh, bh) if mask_hbm.shape[1] > 1 else slice(None)
                    s = s + mask_hbm[mb, mh, :, pl.ds(qi * bq, bq), pl.ds(c0, n)].astype(
                        jnp.float32)
                if seen is not None:
                    s = jnp.where(seen, s, -jnp.inf)
                s = s.reshape(flat, g * bq, n)
            return s, v

        def softmax(c0, n):
            """(m, l, acc) of the keys c0 .. c0 + n at once: a plain softmax."""
            s, v = keys(c0, n)
            m = s.max(axis=-1, keepdims=True)
            m = jnp.where(m == -jnp.inf, 0.0, m)
            p = jnp.exp(s - m)
            return m, p.sum(axis=-1, keepdims=True), product(weights(p, c0), v, (2, 1))

        def online_softmax():
            """(m, l, acc) over the key chunks the block may see."""
            first, chunks = 0, sp // ck
            if causal:  # the chunks holding a key some row of the block sees
                chunks = jnp.minimum(chunks, (qi * bq + bq + ck - 1) // ck)
            if table_hbm is not None:  # the chunks the block's spans reach
                first, chunks = table_hbm[0, qi], table_hbm[1, qi]

            def step(c, carry):
                m_old, l_old, acc_old = carry
                s, v = keys(c * ck, ck)
                m_new = jnp.maximum(m_old, s.max(axis=-1, keepdims=True))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                p = jnp.exp(s - m_safe)
                alpha = jnp.exp(m_old - m_safe)
                return (m_new, alpha * l_old + p.sum(axis=-1, keepdims=True),
                        alpha * acc_old + product(weights(p, c * ck), v, (2, 1)))

            stats = (flat, g * bq, 1)
            init = (jnp.full(stats, -jnp.inf, jnp.float32), jnp.zeros(stats, jnp.float32),
                    jnp.zeros((flat, g * bq, v_hbm.shape[-1]), jnp.float32))
            m, l, acc = jax.lax.fori_loop(first, chunks, step, init)
            return jnp.where(m == -jnp.inf, 0.0, m), l, acc

        if ck >= sp and spans_hbm is None:  # every key at once
            m, l, acc = softmax(0, sp)
        elif slabs:  # the block's keys in the narrowest slab that holds them
            branch, starts = blocks_.slab_choice(spans_hbm, qi * bq, bq, slabs, sp)
            m, l, acc = blocks_.take_branch(branch, [
                *(functools.partial(softmax, start, w) for start, w in zip(starts, slabs)),
                online_softmax])
        else:
            m, l, acc = online_softmax()
        empty = l == 0.0
        o = jnp.where(empty, 0.0, acc / jnp.where(empty, 1.0, l))
        o_hbm[rows] = o.reshape(bb, bh, g, bq, -1).astype(o_hbm.dtype)
        lse_hbm[rows] = jnp.where(empty, jnp.inf, m + jnp.log(l)).reshape(bb, bh, g, bq)

    steps = grid[0] * grid[1] * grid[2]
    if steps == 1:
        one_block(0, 0, 0)
        return

    @pl.loop(0, steps)
    def _(t):
        one_block(t // (grid[1] * grid[2]), (t // grid[2]) % grid[1], t % grid[2])


def batched_attention(q, k, v, mask, spans, keys, *, scale, causal, dropout_p, softcap, config,
                      interpret, num_cores):
    dims = attention_dims(q.shape, k.shape, v.shape, None if mask is None else mask.shape)
    lay, blocks = blocks_.batched_layout("attention", dims, config, num_cores)
    tables = ()
    if spans is not None:
        spans = blocks_.edge_padded(spans, lay.lp)
        tables = (spans, blocks_.span_blocks(spans, blocks[2], blocks[3]))
    operands = _operands(lay, q, k, v, mask, keys, tables)
    o, lse = pl.kernel(
        functools.partial(batched_kernel, blocks=blocks, scale=scale, causal=causal,
                          kv_len=dims.kv_len, **dropout_param(dropout_p),
                          **softcap_param(softcap),
                          **({"spans": True, "slabs": blocks_.slabs(config, lay)}
                             if spans is not None else {})),
        out_type=(lay.row_type(lay.ev, q.dtype), lay.row_type(None, jnp.float32)),
        mesh=tensorcore_mesh(num_cores),
        interpret=interpret,
    )(*operands)
    return lay.row_result(o, dims.value_dim), lay.row_result(lse)


# ---------------------------------------------------------------------------
# Entry point


def attention(q, k, v, *optional, scale: float, causal: bool, config: AttentionConfig,
              interpret, num_cores: int, dropout_p: float = 0.0, spans: bool = False,
              softcap: float = 0.0, span_width: int = 0, window=None):
    """(o, lse) of softmax(scale * q kᵀ + mask [+ causal]) v, per
    kernels/attention_shapes.py; `optional`: [mask][, spans][, dropout keys].
    The batched body reads a window's spans like any others."""
    extra = attention_operands(optional, {"spans": spans, "dropout_p": dropout_p})
    run = pipelined_attention
    if config.body is Body.BATCHED:
        run, window = batched_attention, None
    return run(q, k, v, extra.mask, extra.spans, extra.keys, scale=float(scale),
               causal=bool(causal), dropout_p=float(dropout_p), softcap=float(softcap),
               config=config, interpret=interpret, num_cores=num_cores,
               **({"window": tuple(window)} if window is not None else {}))


def _dims(avals, params):
    shapes = [shape for shape, _ in avals]
    return attention_dims(*shapes[:3], attention_operands(shapes[3:], params).mask)


def _masked(avals, params) -> bool:
    shapes = [shape for shape, _ in avals]
    return attention_operands(shapes[3:], params).mask is not None


def select_config(backend: str, avals, params, device=None) -> AttentionConfig:
    if backend == "tpu":
        return blocks_.chip_config(avals[0][1], params, masked=_masked(avals, params),
                                   backward=False)
    return blocks_.select_config(backend, _dims(avals, params), params)


def flops(avals, params) -> float:
    return attention_flops(_dims(avals, params), bool(params.get("causal", False)))


KERNEL = KernelSpec(run=chip.widening_float16(attention), default_config=AttentionConfig.default,
                    select_config=select_config, unsupported=blocks_.unsupported, flops=flops)
