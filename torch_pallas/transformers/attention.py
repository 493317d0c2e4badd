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
# result and that `pallas::attention` does not compute: refused by name (as
# transformers' SDPA refuses softcap) rather than ignored.
UNSUPPORTED = {
    "softcap": "logit soft-capping (Gemma 2)",
    "s_aux": "attention sinks (gpt-oss)",
    "sinks": "attention sinks",
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


def _unmasked(kwargs: dict, key_length: int) -> str | None:
    """What these keywords ask of a call without a mask that the Pallas
    attention does not compute (None: nothing). A sliding window changes
    nothing where it does not bind (no more keys than the window), and the
    mask carries it where it does (transformers' SDPA mask, registered with
    this attention, is built with the window whenever it binds); packed
    sequences (`cu_seq_lens_*`) likewise need their mask."""
    window = kwargs.get("sliding_window")
    if window is not None and key_length > window:
        return f"sliding_window={window} over {key_length} keys without a mask"
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        sequences = kwargs.get(name)
        if sequences is not None and sequences.numel() > 2:
            return f"{name} of {sequences.numel() - 1} packed sequences without a mask"
    return None


def _short(value) -> str:
    return f"<tensor of shape {tuple(value.shape)}>" if isinstance(value, torch.Tensor) else repr(value)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, position_bias: torch.Tensor | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """An attention layer's computation, as transformers' interface calls it:
    query (B, H, L, D), key and value (B, Hkv, S, D); returns the output as
    (B, L, H, Dv) and no attention weights. Raises ValueError, naming the
    keyword, for what it does not compute (`UNSUPPORTED`, a sliding window
    or packed sequences that reach it without their mask)."""
    why = unsupported(kwargs) or (_unmasked(kwargs, key.shape[2]) if attention_mask is None
                                  else None)
    if why is not None:
        raise ValueError(f"torch_pallas.transformers: attn_implementation={NAME!r} does not "
                         f"support {why}; use 'eager'")
    q_length = query.shape[2]
    # As transformers' SDPA path decides it: decoding (one query) and
    # explicit masks attend as the mask says.
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = q_length > 1 and attention_mask is None and is_causal
    if position_bias is not None:  # T5-style bias, folded into the mask as for SDPA
        from transformers.integrations.sdpa_attention import create_position_bias_mask

        attention_mask = create_position_bias_mask(position_bias, attention_mask, is_causal,
                                                   query, key)
        is_causal = False
    out = pallas_attention(query, key, value, attention_mask, float(dropout), bool(is_causal),
                           scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Registers attn_implementation="pallas" with transformers and, where
    transformers has the experts interface (5.x), experts_implementation=
    "pallas" (`experts.register`) (idempotent)."""
    require_transformers()
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    pallas_experts.register()
