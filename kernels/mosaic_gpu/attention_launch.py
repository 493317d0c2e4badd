"""What the Hopper attention entry points (attention.py, attention_backward.py)
share before their kernels run: the launch prologue (`prologue`: the call's
checks, its operands zero-padded to whole tiles as attention_blocks.py
describes, the kernels' static keywords, the persistent grid) and the choice
of a config (`config_for_call`: the first candidate whose kernels fit a
Hopper block's shared memory; on a GPU one program per SM, in the simulator
one warpgroup doing both jobs on one program).

The forward and the backward differ here only by what they pass: the op's
name (for errors), the tiles the query rows and keys are padded to, where
the optional operands start among the avals, their candidates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from torch_pallas.kernels.attention_shapes import (AttentionDims, attention_dims,
                                                   attention_operands, dropout_param,
                                                   softcap_param)
from torch_pallas.kernels.mosaic_gpu.attention_blocks import (
    PROGRAMS_AXIS,
    SUPPORTED_DTYPES,
    Target,
    pad_rows,
    padded_head_dim,
    thread_axes,
)
from torch_pallas.kernels.shapes import round_up


@dataclasses.dataclass(frozen=True)
class Launch:
    """One checked call, ready for its kernels: `q`, `k`, `v` and `optional`
    ([mask (Bm, Hm, Lp, Sp)][, spans (2, Lp)][, key spans (2, Sp)][, dropout
    keys (B, Hq, Lp)], in the order the kernels read them) zero-padded to
    `lp` query rows, `sp` keys and head dims `e`, `ev` (multiples of
    attention_blocks.HEAD_DIM_MULTIPLE). The spans are transposed (starts,
    then ends: the kernels copy a tile's rows of both by TMA) and padded
    with empty spans."""

    dims: AttentionDims
    lp: int
    sp: int
    e: int
    ev: int
    q: jax.Array
    k: jax.Array
    v: jax.Array
    optional: tuple
    target: Target
    config: Any  # the entry point's config (AttentionConfig, BackwardConfig)
    interpret: Any
    static: dict  # the kernels' static keywords

    def kernel_options(self, tiles: int) -> dict:
        """`plgpu.kernel`'s keywords for a persistent grid over `tiles` tiles:
        `config.num_programs` programs at most (None: one per tile), and the
        config's warpgroups."""
        config = self.config
        return dict(grid=(min(tiles, config.num_programs or tiles),),
                    grid_names=(PROGRAMS_AXIS,),
                    **thread_axes(config.warp_specialized, config.compute_wgs),
                    interpret=self.interpret)


def prologue(op: str, q, k, v, optional: Sequence, *, scale: float, causal: bool,
             dropout_p: float, config, interpret, row_tile: int, key_tile: int,
             spans: bool = False, softcap: float = 0.0, backward: bool = False) -> Launch:
    """The call (q, k, v, *optional) of `op` checked (shapes per
    kernels/attention_shapes.py, q, k, v in one of SUPPORTED_DTYPES, `config`
    against the call's head dims, mask dtype, dropout and spans) and padded:
    query rows to a multiple of `row_tile`, keys of `key_tile`. `backward`:
    the operands are the backward's (key spans after the spans)."""
    params = {"dropout_p": dropout_p, "spans": spans}
    named = attention_operands(optional, params, backward=backward)
    mask, keys = named.mask, named.keys
    dims = attention_dims(q.shape, k.shape, v.shape, None if mask is None else mask.shape)
    if jnp.dtype(q.dtype).name not in SUPPORTED_DTYPES or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{op} (mosaic_gpu): q, k, v are {q.dtype}, {k.dtype}, {v.dtype}; "
                         f"the kernel takes one of {SUPPORTED_DTYPES}")
    for name, table, rows in (("spans", named.spans, dims.q_len),
                              ("key_spans", named.key_spans, dims.kv_len)):
        if table is not None and (tuple(table.shape) != (rows, 2)
                                  or jnp.dtype(table.dtype) != jnp.int32):
            raise ValueError(f"{op} (mosaic_gpu): {name} is {table.dtype}{tuple(table.shape)}, "
                             f"not int32 ({rows}, 2)")
    config.check(q.dtype, dims.head_dim, dims.value_dim, None if mask is None else mask.dtype,
                 keys is not None, **({"spans": True} if spans else {}))
    lp, sp = round_up(dims.q_len, row_tile), round_up(dims.kv_len, key_tile)
    e, ev = padded_head_dim(dims.head_dim), padded_head_dim(dims.value_dim)
    q, k, v = pad_rows(q, lp, e), pad_rows(k, sp, e), pad_rows(v, sp, ev)
    padded_optional = [] if mask is None else [pad_rows(mask, lp, sp)]
    for table, rows in ((named.spans, lp), (named.key_spans, sp)):
        if table is not None:  # (2, rows): starts, ends; padded rows see nothing
            padded_optional.append(jnp.pad(table.T, ((0, 0), (0, rows - table.shape[0]))))
    if keys is not None:
        padded_optional.append(pad_rows(keys, lp))
    target = Target.of(interpret)
    static = dict(scale=float(scale), causal=bool(causal), kv_len=dims.kv_len, group=dims.group,
                  has_mask=mask is not None, target=target, config=config,
                  **dropout_param(dropout_p), **softcap_param(softcap))
    if spans:  # the kernels' last valid row bounds a tile's reach
        static.update(spans=True, q_len=dims.q_len)
    return Launch(dims, lp, sp, e, ev, q, k, v, tuple(padded_optional), target, config,
                  interpret, static)


def check_tiles(op: str, config) -> None:
    """What `wgmma` and the kernels' warpgroups ask of any config of `op`."""
    if config.block_q % 64 or config.block_kv % 64:
        raise ValueError(f"{op}: {config} needs block_q and block_kv multiples of 64 "
                         "(wgmma rows, 128-byte swizzle of 16-bit tiles)")
    wgs = config.compute_wgs
    if wgs not in (1, 2) or (wgs > 1 and not config.warp_specialized):
        raise ValueError(f"{op}: {config} needs 1 or 2 compute warpgroups, 1 "
                         "without warp specialization")


def first_fitting(op: str, candidates, dtype, head_dim: int, value_dim: int, mask_dtype,
                  dropout: bool, spans: bool = False):
    """The first of `candidates` whose kernels fit a Hopper block's shared
    memory (`config.fits`)."""
    extra = {"spans": True} if spans else {}
    for config in candidates:
        if config.fits(dtype, head_dim, value_dim, mask_dtype, dropout, **extra):
            return config
    raise ValueError(f"{op}: no configuration fits head dims {head_dim}/{value_dim}")


def config_for_call(backend: str, avals, params, device, *, optional_at: int,
                    config_for: Callable, default: Callable):
    """An entry point's config for a call (avals: q, k, v first, the optional
    operands from `optional_at` on: 3 for the forward's, 6 for the
    backward's): `config_for` the query length, head dims, mask dtype,
    dropout and spans; on a GPU warp-specialized, one program per SM of
    `device`; in the simulator one warpgroup doing both jobs (see
    attention_blocks.tile_pipeline) with the same tiles, on one program
    (which the simulator compiles once). `default(backend)` for a dtype the
    kernels refuse (`refusal`)."""
    (q_shape, dtype), (k_shape, _), (v_shape, _) = avals[:3]
    named = attention_operands(avals[optional_at:], params, backward=optional_at > 3)
    mask, keys = named.mask, named.keys
    if dtype not in SUPPORTED_DTYPES:
        return default(backend)
    hardware = backend == "mosaic_gpu"
    config = config_for(dtype, q_shape[2], k_shape[-1], v_shape[-1],
                        None if mask is None else mask[1], warp_specialized=hardware,
                        dropout=keys is not None,
                        **({"spans": True} if named.spans is not None else {}))
    programs = getattr(device, "core_count", None) if hardware else 1
    return dataclasses.replace(config, num_programs=programs)


def refusal(computes: str, avals) -> str | None:
    """Why the kernels cannot run a call whose q is not 16-bit (`computes`:
    what they compute), or None."""
    dtype = avals[0][1]
    if dtype not in SUPPORTED_DTYPES:
        return (f"computes {computes} on the Tensor Cores in float16 or bfloat16 only; q is "
                f"{dtype} (wgmma would read float32 as TF32)")
    return None
