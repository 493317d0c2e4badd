"""Scaled dot-product attention, backward, on TPU: FlashAttention-2's
backward pass (Dao, "FlashAttention-2: Faster Attention with Better
Parallelism and Work Partitioning", 2023, Algorithm 2), recomputing the
probabilities from the forward's logsumexp instead of storing them.

The contract is kernels/attention_shapes.py's: delta = rowsum(do * o)
(float32, computed once outside the kernels), then per (query block, key
block) p = exp(s - lse), dv += pᵀ do, dp = do vᵀ, ds = p * (dp - delta),
dq += scale * ds k, dk += scale * dsᵀ q. A row whose lse is +inf (it saw no
key) has p = 0, hence zero gradients.

Pipelined body (TPU, `tpu_interpret`): `pl.kernel` on the TensorCore mesh
with `pltpu.emit_pipeline`, each TensorCore owning what it writes:

- dk/dv: grid (B, Hkv, S/bk, G·L/bq). A key/value block stays in VMEM with
  float32 accumulators while the query blocks of all G query heads that share
  its key/value head stream past (the last axis, ARBITRARY): the GQA sum over
  the group happens in the accumulator, never through memory.
- dq, fused into it where VMEM holds a float32 accumulator for every query
  row of the key/value head's G query heads (G·L·E; `config.fused_dq_bytes`,
  with the output block): each step adds its ds k to the rows of its query
  block, and the (B, Hkv) pair's dq is written once, after its last key
  block. Five products a block instead of seven (the scores and dp are not
  recomputed); only (B, Hkv) is split across TensorCores then.
- dq otherwise in a second kernel: grid (B, Hq, L/bq, S/bk), a query block
  resident and the key blocks streaming, as in the forward.

Causal, the dk/dv grid walks only the (key block, query head, query block)
steps with a row that sees the key block, listed in SMEM (causal_key_steps),
and the dq kernel's the visible (query block, key block) pairs, as the
forward's does (causal_steps); where the steps do not divide among the
TensorCores, with spans or with too many steps to list, the blocks no query
of the block can see are skipped (no compute; their index maps repeat a
visible block, so nothing is fetched).
The mask is read block by block, broadcast axes mapped to block 0; ragged L
and S are padded once outside (padded keys masked inside, padded query rows
given lse = +inf, hence p = 0).

Batched body (`interpret`, the generic interpreter on CPU): whole (batch,
kv-head) blocks with all their query heads; query blocks in sequence, keys in
chunks when the scores would exceed the budget (attention_blocks.py), dq
finished per query block, dk/dv accumulated in float32 across all of them.

Dropout, in every body: the rows' keys come in blocks like lse, and each
score block's mask Z is recomputed from them as the forward computed it
(kernels/attention_dropout.py): dv += (p Z)ᵀ do, ds = p * (dp Z - delta).
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
from torch_pallas.kernels.tpu.attention_blocks import AttentionConfig, Body, dot
from torch_pallas.kernels.tpu.cores import pipeline_core_split, tensorcore_mesh


def _uncapped(ds, t):
    """The scores' gradient before a softcap: times 1 - tanh²."""
    return ds if t is None else ds * (1.0 - t * t)


# ---------------------------------------------------------------------------
# Pipelined bodies (TPU)


def dkdv_kernel(q_hbm, k_hbm, v_hbm, do_hbm, lse_hbm, delta_hbm, *refs, dk_vmem, dv_vmem,
                scale, causal, kv_len, group, block_q, block_k, num_cores, dropout_p=0.0,
                spans=False, table=None, softcap=0.0, dq_vmem=None, block_k_compute=None,
                window=None, steps=None):
    """Inputs padded: q (B, Hq, Lp, Ep), k (B, Hkv, Sp, Ep), v (B, Hkv, Sp,
    Evp), do (B, Hq, Lp, Evp), lse and delta (B, Hq, Lp, 1), optional mask
    (Bm, Hm, Lp, Sp), with spans the rows' spans (Lp, 2) and each key
    block's query blocks (2, Sp / bk) (copied to the SMEM scratch `table`),
    with dropout the rows' keys (B, Hq, Lp, 1) int32; outputs [dq like q,
    with `dq_vmem` (G, Lp, Ep),] dk, dv like k, v; float32 accumulators. A
    key block meets a query block `block_k_compute` keys at a time (None:
    all at once). With the spans' `window`, as the forward: masks from the
    indices, and for each query head the most query blocks a key block's
    window reaches. With the SMEM scratch `steps` (causal, no spans) the
    grid's last axis walks the (key block, query head, query block) steps
    listed in the last input (blocks_.causal_key_steps), the visible ones,
    instead of every query block of every head."""
    fused = dq_vmem is not None
    *ins, dk_hbm, dv_hbm = refs
    if fused:
        *ins, dq_hbm = ins
    if steps is not None:
        *ins, steps_hbm = ins
        pltpu.sync_copy(steps_hbm, steps)
    mask_hbm, spans_hbm, blocks_hbm, keys_hbm = blocks_.split_operands(ins, spans, dropout_p)
    batch, kv_heads, sp, e = k_hbm.shape
    lp, ev = q_hbm.shape[2], v_hbm.shape[3]
    bq, bk = block_q, block_k
    nq = lp // bq
    # query blocks a key block steps through for each query head
    per_head = blocks_.window_reach(window and window[::-1], sp // bk, bk, bq, nq)
    if steps is not None:
        grid = (batch, kv_heads, steps.shape[0] // 3)
    else:
        grid = (batch, kv_heads, sp // bk, group * per_head)
    row_blocks = spans and window is None  # the rows' spans, block by block
    if spans:
        pltpu.sync_copy(blocks_hbm, table)

    def first_visible(j):  # the first query block with a row that sees key block j
        return jnp.minimum((j * bk) // bq, nq - 1)

    def q_block(j, t):
        i = t % per_head
        if spans:  # the i-th query block that reaches key block j
            return blocks_.reached(table, j, i)
        return jnp.maximum(i, first_visible(j)) if causal else i

    def blocks_at(*step):
        """(key block, query head of the group, query block) of a grid
        step's last indices."""
        if steps is not None:
            return steps[3 * step[0]], steps[3 * step[0] + 1], steps[3 * step[0] + 2]
        j, t = step
        return j, t // per_head, q_block(j, t)

    def q_index(b, h, *step):
        _, g, i = blocks_at(*step)
        return (b, h * group + g, i, 0)

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        outs = 3 if fused else 2
        mask_ref, spans_ref, keys_ref = blocks_.split_blocks(rest[:-outs], row_blocks,
                                                             dropout_p)
        dq_ref, dk_ref, dv_ref = (None, *rest[-2:]) if not fused else rest[-3:]
        # Global block indices (emit_pipeline adds the core's offset).
        step = tuple(pl.program_id(d) for d in range(2, len(grid)))
        j, g, i = blocks_at(*step)
        if steps is not None:  # a key block's steps: heads in order, each from its first block
            first_of_j = (g == 0) & (i == first_visible(j))
            last_of_j = (g == group - 1) & (i == nq - 1)
            first, last = step[0] == 0, step[0] == grid[2] - 1
        else:
            t = step[1]
            i = i if spans else t % nq  # causal: unclamped, for the test below
            first_of_j, last_of_j = t == 0, t == grid[3] - 1
            first = (j == 0) & (t == 0)
            last = (j == grid[2] - 1) & (t == grid[3] - 1)

        @pl.when(first_of_j)
        def _():
            dk_vmem[...] = jnp.zeros_like(dk_vmem)
            dv_vmem[...] = jnp.zeros_like(dv_vmem)

        if fused:
            @pl.when(first)
            def _():
                dq_vmem[...] = jnp.zeros_like(dq_vmem)

        def sub_step(cols, offset):
            """Keys `cols` of the key block against the query block."""
            k_start = j * bk + offset
            q, do, k = q_ref[...], do_ref[...], k_ref[cols, :]
            s, cap = blocks_.masked_scores(
                q, k, None if mask_ref is None else mask_ref[:, cols], scale=scale,
                q_start=i * bq, k_start=k_start, causal=causal, kv_len=kv_len,
                padded_kv_len=sp, contract=(1, 1), softcap=softcap,
                spans=blocks_.row_spans(spans_ref), window=window)
            p = jnp.exp(s - lse_ref[...])  # 0 where lse is +inf
            dp = dot(do, v_ref[cols, :], (1, 1))
            z = attention_dropout.block_factors(None if keys_ref is None else keys_ref[...],
                                                k_start, p.shape, dropout_p)
            pz, dp = (p, dp) if z is None else (p * z, dp * z)
            dv_vmem[cols, :] += dot(pz.astype(do.dtype), do, (0, 0))
            ds = _uncapped(p * (dp - delta_ref[...]), cap).astype(q.dtype)
            dk_vmem[cols, :] += scale * dot(ds, q, (0, 0))
            if fused:
                rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
                dq_vmem[g, rows, :] += scale * dot(ds, k, (1, 0))

        def update():
            blocks_.over_key_sub_steps(bk, block_k_compute, sub_step)

        if spans:
            pl.when(table[0, j] + step[1] % per_head < table[1, j])(update)
        elif causal:  # listed steps too: a key block no row sees keeps one
            pl.when(i * bq + bq - 1 >= j * bk)(update)
        else:
            update()

        @pl.when(last_of_j)
        def _():
            dk_ref[...] = dk_vmem[...].astype(dk_ref.dtype)
            dv_ref[...] = dv_vmem[...].astype(dv_ref.dtype)

        if fused:
            @pl.when(last)
            def _():  # the pair's last step: its dq is complete
                dq_ref[...] = dq_vmem[...].astype(dq_ref.dtype)

    def row_spec(width):
        return pl.BlockSpec((None, None, bq, width), q_index)

    def kv_spec(width):
        return pl.BlockSpec((None, None, bk, width),
                            lambda b, h, *step: (b, h, blocks_at(*step)[0], 0))

    in_specs = [row_spec(e), kv_spec(e), kv_spec(ev), row_spec(ev), row_spec(1), row_spec(1)]
    operands = [q_hbm, k_hbm, v_hbm, do_hbm, lse_hbm, delta_hbm]
    if mask_hbm is not None:
        def mask_index(b, h, *step):
            j, g, i = blocks_at(*step)
            return (*blocks_.mask_block_index(mask_hbm.shape, b, h * group + g), i, j)

        in_specs.append(pl.BlockSpec((None, None, bq, bk), mask_index))
        operands.append(mask_hbm)
    if row_blocks:
        in_specs.append(pl.BlockSpec((bq, 2), lambda b, h, j, t: (q_block(j, t), 0)))
        operands.append(spans_hbm)
    if keys_hbm is not None:
        in_specs.append(row_spec(1))
        operands.append(keys_hbm)
    out_specs, outs = [kv_spec(e), kv_spec(ev)], [dk_hbm, dv_hbm]
    if fused:  # one block per (B, Hkv) pair, written after its last step
        out_specs.insert(0, pl.BlockSpec((None, group, lp, e), lambda b, h, *step: (b, h, 0, 0)))
        outs.insert(0, dq_hbm)
    # the key blocks split across the cores too where each has its own steps
    parallel = 2 if fused or steps is not None else 3
    pltpu.emit_pipeline(
        body, grid=grid, in_specs=in_specs, out_specs=out_specs,
        **pipeline_core_split(num_cores, parallel_dims=parallel,
                              sequential_dims=len(grid) - parallel),
    )(*operands, *outs)


def dq_kernel(q_hbm, k_hbm, v_hbm, do_hbm, lse_hbm, delta_hbm, *refs, dq_vmem, scale, causal,
              kv_len, group, block_q, block_k, num_cores, dropout_p=0.0, spans=False,
              table=None, softcap=0.0, window=None, steps=None):
    """Inputs as dkdv_kernel's, the span table each query block's key
    blocks (2, Lp / bq); output dq like q; a float32 accumulator. The
    spans' `window` as in the forward. With the SMEM scratch `steps`
    (causal, no spans), as the forward's, the grid's last axis walks the
    visible (query block, key block) pairs listed in the last input
    (blocks_.causal_steps)."""
    *ins, dq_hbm = refs
    if steps is not None:
        *ins, steps_hbm = ins
        pltpu.sync_copy(steps_hbm, steps)
    mask_hbm, spans_hbm, blocks_hbm, keys_hbm = blocks_.split_operands(ins, spans, dropout_p)
    batch, q_heads, lp, e = q_hbm.shape
    sp, ev = k_hbm.shape[2], v_hbm.shape[3]
    bq, bk = block_q, block_k
    if steps is not None:
        grid = (batch, q_heads, steps.shape[0] // 2)
    else:
        grid = (batch, q_heads, lp // bq,
                blocks_.window_reach(window, lp // bq, bq, bk, sp // bk))
    row_blocks = spans and window is None
    if spans:
        pltpu.sync_copy(blocks_hbm, table)

    def kv_block(i, j):
        if spans:  # the j-th key block the query block reaches
            return blocks_.reached(table, i, j)
        # a skipped causal block repeats the last visible one
        return jnp.minimum(j, blocks_.last_key_block(i, bq, bk, sp)) if causal else j

    def blocks_at(*step):
        """(query block, key block) of a grid step's last indices."""
        if steps is not None:
            return blocks_.listed_pair(steps, step[0])
        return step[0], kv_block(*step)

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        mask_ref, spans_ref, keys_ref = blocks_.split_blocks(rest[:-1], row_blocks, dropout_p)
        dq_ref = rest[-1]
        # Global block indices (emit_pipeline adds the core's offset).
        step, i, kj, first, last = blocks_.query_block_step(grid, blocks_at, steps is not None,
                                                            bq, bk, sp)

        @pl.when(first)
        def _():
            dq_vmem[...] = jnp.zeros_like(dq_vmem)

        def update():
            k = k_ref[...]
            s, cap = blocks_.masked_scores(
                q_ref[...], k, None if mask_ref is None else mask_ref[...], scale=scale,
                q_start=i * bq, k_start=kj * bk, causal=causal, kv_len=kv_len,
                padded_kv_len=sp, contract=(1, 1), softcap=softcap,
                spans=blocks_.row_spans(spans_ref), window=window)
            p = jnp.exp(s - lse_ref[...])
            dp = dot(do_ref[...], v_ref[...], (1, 1))
            z = attention_dropout.block_factors(None if keys_ref is None else keys_ref[...],
                                                kj * bk, p.shape, dropout_p)
            if z is not None:
                dp = dp * z
            ds = _uncapped(p * (dp - delta_ref[...]), cap)
            dq_vmem[...] += scale * dot(ds.astype(k.dtype), k, (1, 0))

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
            dq_ref[...] = dq_vmem[...].astype(dq_ref.dtype)

    def row_spec(width):
        return pl.BlockSpec((None, None, bq, width),
                            lambda b, h, *step: (b, h, blocks_at(*step)[0], 0))

    def kv_spec(width):
        return pl.BlockSpec((None, None, bk, width),
                            lambda b, h, *step: (b, h // group, blocks_at(*step)[1], 0))

    in_specs = [row_spec(e), kv_spec(e), kv_spec(ev), row_spec(ev), row_spec(1), row_spec(1)]
    operands = [q_hbm, k_hbm, v_hbm, do_hbm, lse_hbm, delta_hbm]
    if mask_hbm is not None:
        def mask_index(b, h, *step):
            return (*blocks_.mask_block_index(mask_hbm.shape, b, h), *blocks_at(*step))

        in_specs.append(pl.BlockSpec((None, None, bq, bk), mask_index))
        operands.append(mask_hbm)
    if row_blocks:
        in_specs.append(pl.BlockSpec((bq, 2), lambda b, h, i, j: (i, 0)))
        operands.append(spans_hbm)
    if keys_hbm is not None:
        in_specs.append(row_spec(1))
        operands.append(keys_hbm)
    pltpu.emit_pipeline(
        body, grid=grid, in_specs=in_specs, out_specs=[row_spec(e)],
        **pipeline_core_split(num_cores, parallel_dims=len(grid) - 1),
    )(*operands, dq_hbm)


def fused_dq_bytes(lay, group: int, dtype) -> int:
    """The VMEM a fused dq takes: a float32 accumulator of the G query heads'
    rows and its output block, double-buffered."""
    return group * lay.lp * lay.e * (4 + 2 * jnp.dtype(dtype).itemsize)


def pipelined_backward(q, k, v, do, lse, delta, mask, spans, key_spans, keys, *, scale, causal,
                       dropout_p, softcap, config, interpret, num_cores, window=None):
    dims = attention_dims(q.shape, k.shape, v.shape, None if mask is None else mask.shape)
    lay, bq, bk = blocks_.pipelined_layout(dims, config)
    fused = (0 < fused_dq_bytes(lay, dims.group, q.dtype) <= config.fused_dq_bytes
             and (dims.batch * dims.kv_heads) % num_cores == 0)
    static = dict(scale=scale, causal=causal, kv_len=dims.kv_len, group=dims.group,
                  block_q=bq, block_k=bk, num_cores=num_cores, **dropout_param(dropout_p),
                  **softcap_param(softcap), **({"spans": True} if spans is not None else {}),
                  **({"window": window} if window is not None else {}))
    dkdv_scratch = dict(dk_vmem=pltpu.VMEM((bk, lay.e), jnp.float32),
                        dv_vmem=pltpu.VMEM((bk, lay.ev), jnp.float32))
    dkdv_out = (lay.kv_type(lay.e, q.dtype), lay.kv_type(lay.ev, q.dtype))
    if fused:
        dkdv_scratch["dq_vmem"] = pltpu.VMEM((dims.group, lay.lp, lay.e), jnp.float32)
        dkdv_out = (lay.row_type(lay.e, q.dtype), *dkdv_out)
    dkdv_tables = ()
    if spans is not None:
        spans = blocks_.edge_padded(spans, lay.lp)
        by_key = blocks_.span_blocks(blocks_.edge_padded(key_spans, lay.sp), bk, bq)
        dkdv_tables = (spans, by_key)
        dkdv_scratch["table"] = pltpu.SMEM(by_key.shape, jnp.int32)
    run = functools.partial(chip.kernel, mesh=tensorcore_mesh(num_cores), interpret=interpret,
                            vmem_limit=config.vmem_limit)
    dkdv_operands = _operands(lay, q, k, v, do, lse, delta, mask, keys, dkdv_tables)
    if causal and spans is None:
        blocks_.add_listed_steps(
            dkdv_scratch, dkdv_operands,
            lambda: blocks_.causal_key_steps(lay.sp // bk, bk, bq, lay.lp // bq, dims.group),
            pairs=dims.batch * dims.kv_heads, num_cores=num_cores)
    dkdv = run(functools.partial(dkdv_kernel, **static,
                                 block_k_compute=blocks_.compute_block(config, bk)),
               out_type=dkdv_out, scratch_types=dkdv_scratch)
    grads = dkdv(*dkdv_operands)
    if fused:
        return _results(lay, *grads)
    dq_scratch = dict(dq_vmem=pltpu.VMEM((bq, lay.e), jnp.float32))
    dq_tables = ()
    if spans is not None:
        dq_tables = (spans, blocks_.span_blocks(spans, bq, bk))
        dq_scratch["table"] = pltpu.SMEM(dq_tables[1].shape, jnp.int32)
    dq_operands = _operands(lay, q, k, v, do, lse, delta, mask, keys, dq_tables)
    if causal and spans is None:
        blocks_.add_listed_steps(
            dq_scratch, dq_operands,
            lambda: blocks_.causal_steps(lay.lp // bq, bq, bk, lay.sp // bk),
            pairs=dims.batch * dims.q_heads, num_cores=num_cores)
    dq_only = run(functools.partial(dq_kernel, **static),
                  out_type=lay.row_type(lay.e, q.dtype), scratch_types=dq_scratch)
    dq = dq_only(*dq_operands)
    return _results(lay, dq, *grads)


def _operands(lay, q, k, v, do, lse, delta, mask, keys, tables=()) -> list:
    """Both bodies' operands, laid out by `lay`: q, k, v, do, lse, delta[,
    mask][, span tables][, dropout keys]; padded rows get lse +inf, so p = 0
    there."""
    return [lay.rows(q, lay.e), lay.kv(k, lay.e), lay.kv(v, lay.ev), lay.rows(do, lay.ev),
            lay.rows(lse, fill=jnp.inf), lay.rows(delta), *lay.optional(mask, None),
            *tables, *lay.optional(None, keys)]


def _results(lay, dq, dk, dv):
    """(dq, dk, dv) as the inputs are shaped: unpadded, ungrouped."""
    d = lay.dims
    return (lay.row_result(dq, d.head_dim), lay.kv_result(dk, d.head_dim),
            lay.kv_result(dv, d.value_dim))


# ---------------------------------------------------------------------------
# Batched body (generic interpreter, CPU)


def batched_kernel(q_hbm, k_hbm, v_hbm, do_hbm, lse_hbm, delta_hbm, *refs, blocks, scale,
                   causal, kv_len, dropout_p=0.0, spans=False, softcap=0.0, slabs=()):
    """q and do (B, Hkv, G, Lp, E / Ev), k and v (B, Hkv, Sp, E / Ev), lse and
    delta (B, Hkv, G, Lp), an optional mask (Bm, Hkv or 1, G or 1, Lp, Sp),
    with spans the rows' spans (Lp, 2) and each query block's key chunks
    (2, Lp / bq), with dropout the rows' keys (B, Hkv, G, Lp) int32; outputs
    dq like q, dk and dv like k and v; `slabs` as the forward's."""
    *ins, dq_hbm, dk_hbm, dv_hbm = refs
    mask_hbm, spans_hbm, table_hbm, keys_hbm = blocks_.split_operands(ins, spans, dropout_p)
    batch, kv_heads, _, lp, _ = q_hbm.shape
    sp = k_hbm.shape[2]
    bb, bh, bq, ck = blocks
    nq, nk = lp // bq, sp // ck

    def one_block(bi, hi):
        heads = (pl.ds(bi * bb, bb), pl.ds(hi * bh, bh))

        def grads(qi, c0, n, q, do, lse, delta, row_keys, row_spans):
            """(dq, dkᵀ, dvᵀ) of query block qi against keys c0 .. c0 + n."""
            kv = (*heads, pl.ds(c0, n))
            k, v = k_hbm[kv].astype(jnp.float32), v_hbm[kv].astype(jnp.float32)
            mask = None
            if mask_hbm is not None:
                mb = heads[0] if mask_hbm.shape[0] > 1 else slice(None)
                mh = heads[1] if mask_hbm.shape[1] > 1 else slice(None)
                mask = mask_hbm[mb, mh, :, pl.ds(qi * bq, bq), pl.ds(c0, n)]
            s, cap = blocks_.masked_scores(q, k, mask, scale=scale, q_start=qi * bq,
                                           k_start=c0, causal=causal, kv_len=kv_len,
                                           padded_kv_len=sp, contract=(4, 3), batch_dims=2,
                                           softcap=softcap,
                                           spans=row_spans)  # (bb, bh, G, bq, n)
            p = jnp.exp(s - lse[..., None])
            dp = dot(do, v, (4, 3), batch_dims=2)
            z = attention_dropout.block_factors(row_keys, c0, p.shape, dropout_p)
            pz, dp = (p, dp) if z is None else (p * z, dp * z)
            # dk and dv transposed, (E, n): contracting the score block along
            # its rows as the right operand is XLA CPU's fast layout (about
            # 1.7x the backward's speed here); both summed over the group.
            dv_t = dot(do, pz, ((2, 3), (2, 3)), batch_dims=2)
            ds = _uncapped(p * (dp - delta[..., None]), cap)
            dq = scale * dot(ds, k, (4, 2), batch_dims=2)
            dk_t = scale * dot(q, ds, ((2, 3), (2, 3)), batch_dims=2)
            return dq, dk_t, dv_t

        def query_block(qi, dk_dv):
            rows = (*heads, slice(None), pl.ds(qi * bq, bq))
            q, do = q_hbm[rows].astype(jnp.float32), do_hbm[rows].astype(jnp.float32)
            lse, delta = lse_hbm[rows], delta_hbm[rows]
            row_keys = None if keys_hbm is None else keys_hbm[rows][..., None]
            row_spans = None
            if spans_hbm is not None:
                span = spans_hbm[pl.ds(qi * bq, bq), :]
                row_spans = (span[:, 0:1], span[:, 1:2])
            if nk == 1:
                dq, dk_t, dv_t = grads(qi, 0, sp, q, do, lse, delta, row_keys, row_spans)
                dq_hbm[rows] = dq.astype(dq_hbm.dtype)
                return dk_dv[0] + dk_t, dk_dv[1] + dv_t

            def add(total, part, c0):
                start = (0, 0, 0, c0)
                old = jax.lax.dynamic_slice(total, start, part.shape)
                return jax.lax.dynamic_update_slice(total, old + part, start)

            def chunks_loop():
                def chunk(c, carry):
                    dq, dk_all, dv_all = carry
                    c0 = c * ck
                    dq_c, dk_c, dv_c = grads(qi, c0, ck, q, do, lse, delta, row_keys, row_spans)
                    return dq + dq_c, add(dk_all, dk_c, c0), add(dv_all, dv_c, c0)

                first, chunks = 0, nk
                if causal:  # the chunks holding a key some row of the block sees
                    chunks = jnp.minimum(nk, (qi * bq + bq + ck - 1) // ck)
                if table_hbm is not None:  # the chunks the block's spans reach
                    first, chunks = table_hbm[0, qi], table_hbm[1, qi]
                return jax.lax.fori_loop(first, chunks, chunk,
                                         (jnp.zeros(q.shape, jnp.float32), *dk_dv))

            if slabs:  # the block's keys in the narrowest slab that holds them
                branch, starts = blocks_.slab_choice(spans_hbm, qi * bq, bq, slabs, sp)

                def one_slab(start, width):
                    dq, dk_s, dv_s = grads(qi, start, width, q, do, lse, delta, row_keys,
                                           row_spans)
                    return dq, add(dk_dv[0], dk_s, start), add(dk_dv[1], dv_s, start)

                dq, dk_t, dv_t = blocks_.take_branch(branch, [
                    *(functools.partial(one_slab, start, w) for start, w in zip(starts, slabs)),
                    chunks_loop])
            else:
                dq, dk_t, dv_t = chunks_loop()
            dq_hbm[rows] = dq.astype(dq_hbm.dtype)
            return dk_t, dv_t

        zeros = (jnp.zeros((bb, bh, k_hbm.shape[-1], sp), jnp.float32),
                 jnp.zeros((bb, bh, v_hbm.shape[-1], sp), jnp.float32))
        if nq == 1:
            dk_t, dv_t = query_block(0, zeros)
        else:
            dk_t, dv_t = jax.lax.fori_loop(0, nq, query_block, zeros)
        dk_hbm[heads] = dk_t.swapaxes(-1, -2).astype(dk_hbm.dtype)
        dv_hbm[heads] = dv_t.swapaxes(-1, -2).astype(dv_hbm.dtype)

    steps = (batch // bb) * (kv_heads // bh)
    if steps == 1:
        one_block(0, 0)
        return

    @pl.loop(0, steps)
    def _(t):
        one_block(t // (kv_heads // bh), t % (kv_heads // bh))


def batched_backward(q, k, v, do, lse, delta, mask, spans, key_spans, keys, *, scale, causal,
                     dropout_p, softcap, config, interpret, num_cores):
    dims = attention_dims(q.shape, k.shape, v.shape, None if mask is None else mask.shape)
    lay, blocks = blocks_.batched_layout("attention_backward", dims, config, num_cores)
    tables = ()
    if spans is not None:  # query blocks in turn: key_spans are not needed here
        spans = blocks_.edge_padded(spans, lay.lp)
        tables = (spans, blocks_.span_blocks(spans, blocks[2], blocks[3]))
    dq, dk, dv = pl.kernel(
        functools.partial(batched_kernel, blocks=blocks, scale=scale, causal=causal,
                          kv_len=dims.kv_len, **dropout_param(dropout_p),
                          **softcap_param(softcap),
                          **({"spans": True, "slabs": blocks_.slabs(config, lay)}
                             if spans is not None else {})),
        out_type=(lay.row_type(lay.e, q.dtype), lay.kv_type(lay.e, q.dtype),
                  lay.kv_type(lay.ev, q.dtype)),
        mesh=tensorcore_mesh(num_cores),
        interpret=interpret,
    )(*_operands(lay, q, k, v, do, lse, delta, mask, keys, tables))
    return _results(lay, dq, dk, dv)


# ---------------------------------------------------------------------------
# Entry point


def attention_backward(q, k, v, o, do, lse, *optional, scale: float, causal: bool,
                       config: AttentionConfig, interpret, num_cores: int,
                       dropout_p: float = 0.0, spans: bool = False, softcap: float = 0.0,
                       span_width: int = 0, window=None):
    """(dq, dk, dv) of the forward's o = attention(q, k, v, mask) given do,
    per kernels/attention_shapes.py; `o` and `lse` are what the forward
    returned; `optional`: [mask][, spans, key_spans][, dropout keys]. The
    batched body reads a window's spans like any others."""
    extra = attention_operands(optional, {"spans": spans, "dropout_p": dropout_p},
                               backward=True)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    run = pipelined_backward
    if config.body is Body.BATCHED:
        run, window = batched_backward, None
    return run(q, k, v, do, lse.astype(jnp.float32), delta, extra.mask, extra.spans,
               extra.key_spans, extra.keys, scale=float(scale), causal=bool(causal),
               dropout_p=float(dropout_p), softcap=float(softcap), config=config,
               interpret=interpret, num_cores=num_cores,
               **({"window": tuple(window)} if window is not None else {}))


def _masked(avals, params) -> bool:
    shapes = [shape for shape, _ in avals]
    return attention_operands(shapes[6:], params, backward=True).mask is not None


def select_config(backend: str, avals, params, device=None) -> AttentionConfig:
    if backend == "tpu":
        return blocks_.chip_config(avals[0][1], params, masked=_masked(avals, params),
                                   backward=True, device=device)
    return blocks_.select_config(backend, _dims(avals, params), params, backward=True)


def _dims(avals, params):
    shapes = [shape for shape, _ in avals]
    return attention_dims(*shapes[:3],
                          attention_operands(shapes[6:], params, backward=True).mask)


def flops(avals, params) -> float:
    """The backward's five products: 2.5 forwards (as FlashAttention counts)."""
    return 2.5 * attention_flops(_dims(avals, params), bool(params.get("causal", False)))


KERNEL = KernelSpec(run=chip.widening_float16(attention_backward), default_config=AttentionConfig.default,
                    select_config=select_config, unsupported=blocks_.unsupported, flops=flops)
