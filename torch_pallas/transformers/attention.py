"""`attn_implementation="pallas"`: transformers' attention interface on
`torch.ops.pallas.attention` (`attention_forward`), registered by
`register()` with the SDPA masks (and experts.py's experts_implementation
"pallas" beside it). The package's docstring says how a model
uses it.

Imports: `torch_pallas.ops`, `torch_pallas.transformers.experts`;
transformers itself only inside `register()`.
"""

from __future__ import annotations

import torch

# torch.ops.pallas.attention's public function (its direct path on plain eager calls).
from torch_pallas.ops import attention as pallas_ops
from torch_pallas.ops import attention_spans
from torch_pallas.ops.attention import attention as pallas_attention
from torch_pallas.transformers import experts as pallas_experts

NAME = "pallas"
# The oldest transformers this integration is tested on (CI runs it and the newest).
OLDEST_TRANSFORMERS = "4.56"


def require_transformers() -> None:
    """Raises ImportError, naming both versions, for a transformers older
    than OLDEST_TRANSFORMERS (its attention and mask interfaces differ)."""
    import transformers
    from packaging.version import Version  # a dependency of transformers

    if Version(transformers.__version__) < Version(OLDEST_TRANSFORMERS):
        raise ImportError(f"torch_pallas.transformers needs transformers>={OLDEST_TRANSFORMERS}; "
                          f"found {transformers.__version__}")


# Keywords transformers 5 passes to an attention function that change its
# result and that `pallas::attention` does not compute: refused by name
# rather than ignored.
UNSUPPORTED = {
    "indices": "a sparse selection of keys",
    "block_indices": "a sparse selection of key blocks",
}


def unsupported(kwargs: dict) -> str | None:
    """The first of `UNSUPPORTED` that these keywords set, said for an
    error message (None: none)."""
    for name, what in UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            return f"{name}={_short(kwargs[name])} ({what})"
    return None


def _short(value) -> str:
    return f"<tensor of shape {tuple(value.shape)}>" if isinstance(value, torch.Tensor) else repr(value)


def packed_sequences(query: torch.Tensor, kwargs: dict):
    """(cu_seq_q, cu_seq_k) int32 of a padding-free batch (one row of packed
    sequences): the `cu_seq_lens_*` transformers' flash-attention keywords
    carry, or the starts of `position_ids` that restart (each position not
    one past the previous, as transformers detects packing). None for an
    unpacked batch.

    Under torch.compile only the keywords count: the restarts of
    `position_ids` are data, and `pallas_mask` gives such a batch the dense
    mask there whenever transformers detected the packing itself (no cache)."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        cu_q = cu_k if cu_q is None else cu_q
        cu_k = cu_q if cu_k is None else cu_k
        return cu_q.to(torch.int32), cu_k.to(torch.int32)
    positions = kwargs.get("position_ids")
    if positions is None or torch.compiler.is_compiling() or query.shape[0] != 1 or positions.shape[-1] != query.shape[2]:
        return None
    positions = positions.reshape(-1)
    restarts = torch.nonzero(positions[1:] - positions[:-1] != 1).reshape(-1) + 1
    if restarts.numel() == 0:
        return None
    ends = torch.cat([restarts, restarts.new_full((1,), positions.numel())])
    cu = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
    return cu, cu


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, position_bias: torch.Tensor | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """An attention layer's computation, as transformers' interface calls it:
    query (B, H, L, D), key and value (B, Hkv, S, D); returns the output as
    (B, L, H, Dv) and no attention weights.

    It honours what transformers passes: `sliding_window=W` (query i sees
    keys i - W + 1 .. i), `softcap` (Gemma 2's logit softcapping), `s_aux`
    (gpt-oss's sinks) and, for a padding-free batch, `cu_seq_lens_q` /
    `cu_seq_lens_k` or `position_ids` that restart: each packed sequence
    attends to itself alone (`pallas_mask` leaves such batches without a
    mask). Raises ValueError, naming the keyword, for what it does not
    compute (`UNSUPPORTED`)."""
    why = unsupported(kwargs)
    if why is not None:
        raise ValueError(f"torch_pallas.transformers: attn_implementation={NAME!r} does not "
                         f"support {why}; use 'eager'")
    if attention_mask is not None and attention_mask.dim() == 2:  # `pallas_mask`'s padding
        return padded_attention(query, key, value, attention_mask, dropout, scaling,
                                kwargs.get("sliding_window"), kwargs.get("softcap") or 0.0,
                                kwargs.get("s_aux", kwargs.get("sinks"))), None
    q_length, kv_length = query.shape[2], key.shape[2]
    # As transformers' SDPA path decides it: decoding (one query) and
    # explicit masks attend as the mask says.
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = q_length > 1 and attention_mask is None and is_causal
    if position_bias is not None:  # T5-style bias, folded into the mask as for SDPA
        from transformers.integrations.sdpa_attention import create_position_bias_mask

        attention_mask = create_position_bias_mask(position_bias, attention_mask, is_causal,
                                                   query, key)
        is_causal = False
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap") or 0.0
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    # A mask carries the window where transformers built one (padding, a
    # cache); without one the window is the attention's, aligned with the
    # causal diagonal (the same top-left or bottom-right when L == S).
    left = -1
    if window is not None and attention_mask is None and kv_length > window:
        if q_length != kv_length:
            raise ValueError(f"torch_pallas.transformers: sliding_window={window} over "
                             f"{kv_length} keys for {q_length} queries without a mask")
        left = window - 1
    packed = packed_sequences(query, kwargs) if attention_mask is None else None
    gqa = key.shape[1] != query.shape[1]
    if packed is not None:
        if not is_causal:
            raise ValueError("torch_pallas.transformers: packed sequences in a non-causal "
                             "attention without a mask")
        scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        seed = pallas_ops.dropout_seed(query.device) if dropout > 0 else None
        out, _ = torch.ops.pallas.attention_forward(
            query, key, value, None, scale, False, float(dropout), seed, left, 0,
            float(softcap), sinks, *packed, 0, 0)
    else:
        window_size = (left, 0 if left >= 0 else -1)
        out = pallas_attention(query, key, value, attention_mask, float(dropout),
                               bool(is_causal), scale=scaling, enable_gqa=gqa,
                               window_size=window_size, softcap=float(softcap), sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


def padded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     padding: torch.Tensor, dropout: float, scaling: float | None,
                     window: int | None, softcap: float, sinks: torch.Tensor | None):
    """Causal self-attention over a padded batch, `padding` (B, S) the
    tokenizer's mask (true at real tokens) as `pallas_mask` passes it:
    the batch folded into one row of packed sequences
    (attention_spans.padded_batch_sequences), which every kernel family and
    the JAX-side forms take, with no (L, S) tensor and no read of the mask's
    values. Returns (B, L, H, Dv). A real token's output is the eager
    model's; a padding token's is 0 (it sees no key), as after
    flash-attention's unpadding. A row whose real tokens are not one run
    (a mask with holes, which `pallas_mask` sends as a dense mask where it
    can read it) gives NaN: under a trace nothing else can say so (the
    next layer may spread it across the batch, whose rows share the folded
    row's blocks)."""
    batch, heads, length, _ = query.shape
    if key.shape[2] != length:
        raise ValueError(f"torch_pallas.transformers: a padding mask {tuple(padding.shape)} for "
                         f"{length} queries over {key.shape[2]} keys (padded batches are "
                         "served without a cache)")
    cu_q, cu_k, holes = attention_spans.padded_batch_sequences(padding)

    def fold(t):  # (B, H, S, D) -> (1, H, B·S, D); a view where t is (B, S, H, D) in memory
        return t.transpose(1, 2).reshape(1, batch * length, t.shape[1], t.shape[3]).transpose(1, 2)

    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    seed = pallas_ops.dropout_seed(query.device) if dropout > 0 else None
    left = window - 1 if window is not None else -1
    out, _ = torch.ops.pallas.attention_forward(
        fold(query), fold(key), fold(value), None, scale, False, float(dropout), seed, left, 0,
        float(softcap), sinks, cu_q, cu_k, 0, 0)
    out = out.transpose(1, 2).reshape(batch, length, heads, out.shape[-1])
    return torch.where(holes.reshape(batch, 1, 1, 1), torch.nan, out)


# --- the mask -------------------------------------------------------------------

# transformers' mask functions that only say what the attention computes by
# itself from its keywords: causality, a sliding window, packed sequences.
_STRUCTURAL = ("causal_mask_function", "sliding_window_overlay.", "and_masks.",
               "packed_sequence_mask_function.", "remap_positions_for_packed_sequence.",
               "sliding_window_causal_mask_function.")
_PACKING = ("packed_sequence_mask_function.", "remap_positions_for_packed_sequence.")

# What a mask function says (`mask_structure`).
DENSE = 0  # something only a mask says: padding, chunks, a user's and_/or_mask_function
PLAIN = 1  # causality and a sliding window
PACKED = 2  # that, and packed sequences (position ids that restart)


@torch.compiler.assume_constant_result
def mask_structure(mask_function) -> int:
    """DENSE, PLAIN or PACKED: what `mask_function`, one of transformers'
    closures, composes (walked through their cells by name).

    Under torch.compile, Dynamo runs this on the real closure and bakes the
    answer into the graph: a closure's makeup follows from the model's code
    path and config (sliding window, packing detected, a user's extra mask
    functions), on which the compiled graph is guarded already, and Dynamo
    cannot trace a walk over `__closure__`."""
    name = getattr(mask_function, "__qualname__", "")
    if not name.startswith(_STRUCTURAL):
        return DENSE
    structure = PACKED if name.startswith(_PACKING) else PLAIN
    for cell in getattr(mask_function, "__closure__", None) or ():
        contents = cell.cell_contents
        parts = contents if isinstance(contents, tuple) else (contents,)
        for part in parts:
            if callable(part) and not isinstance(part, torch.Tensor):
                inner = mask_structure(part)
                if inner == DENSE:
                    return DENSE
                structure = max(structure, inner)
    return structure


def pallas_mask(*args, **kwargs):
    """The mask transformers builds for attn_implementation="pallas",
    for a fresh batch (no cache offset) whose mask function says causal,
    a sliding window or packed sequences, which the attention applies
    itself from `sliding_window`, `position_ids` or `cu_seq_lens_*`:

    - None where there is no padding (no mask, or, where its values may be
      read, one of all ones);
    - a causal or windowed batch with padding: the padding mask itself,
      (B, S) bool, which `attention_forward` serves as packed sequences
      (`padded_attention`), with no (L, S) tensor and no read of its
      values: eagerly, under torch.compile, under torchax's jax.jit and on
      torch_tpu. Where the values may be read (a plain eager tensor) a mask
      of all ones gives None, and one with holes (a row's real tokens not
      one run) the dense mask below;
    - else transformers' SDPA mask, built from the very arguments
      transformers passed: a cache, a user's mask functions, chunks, and
      packed sequences under torch.compile (their boundaries are data) or
      of more than one row (the attention reads packing off a single row).

    transformers 5.x calls it with keywords `batch_size`, `q_length`,
    `kv_length`, `q_offset`, `kv_offset`, `mask_function`, `attention_mask`;
    4.x with `cache_position` in place of the lengths and offsets: there the
    SDPA mask is used as is."""
    # Names from the module itself, not `from transformers import
    # masking_utils`: torch.compile traces this function, and Dynamo (torch
    # 2.11) refuses an import whose result is transformers' top-level
    # package (a ModuleType subclass, _LazyModule); masking_utils is a
    # plain module.
    from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask

    if args or "q_length" not in kwargs:
        return sdpa_mask(*args, **kwargs)
    q_length, kv_length = kwargs["q_length"], kwargs["kv_length"]
    q_offset, kv_offset = kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0)
    mask_function = kwargs.get("mask_function") or causal_mask_function
    kwargs["mask_function"] = mask_function
    fresh = (not isinstance(q_offset, torch.Tensor) and not isinstance(kv_offset, torch.Tensor)
             and q_offset == 0 and kv_offset == 0 and q_length == kv_length)
    if not fresh:
        return sdpa_mask(**kwargs)
    structure = mask_structure(mask_function)
    padding = prepare_padding_mask(kwargs.get("attention_mask"), kv_length, kv_offset)
    readable = padding is not None and _readable(padding)
    if structure == PLAIN:
        if padding is None:
            return None
        padding = padding[:, :kv_length]
        if readable:  # one read: all ones, and holes (which only a dense mask says)
            holes = attention_spans.padded_batch_sequences(padding)[2]
            every_token_real, any_holes = torch.stack((padding.all(), holes.any())).tolist()
            if every_token_real:
                return None
            if any_holes:
                return sdpa_mask(**kwargs)
        return padding.bool()
    if structure == PACKED and kwargs.get("batch_size") == 1 and not torch.compiler.is_compiling():
        if padding is None or (readable and bool(padding.all())):
            return None
    return sdpa_mask(**kwargs)


def _readable(tensor: torch.Tensor) -> bool:
    """Whether a mask's values may be read on the host: a plain eager
    tensor, not a trace's (torch.compile), a torchax tensor (jax.jit) nor a
    torch_tpu one (whose read would stop the device's queue)."""
    return (not torch.compiler.is_compiling() and type(tensor) is torch.Tensor
            and tensor.device.type in ("cpu", "cuda"))


def register() -> None:
    """Registers attn_implementation="pallas" with transformers and, where
    transformers has the experts interface (5.x), experts_implementation=
    "pallas" (`experts.register`) (idempotent)."""
    require_transformers()
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, pallas_mask)
    pallas_experts.register()
