"""`attn_implementation="pallas"`: transformers' attention interface on
`torch.ops.pallas.attention` (`attention_forward`), registered by
`register()` with the SDPA masks. The package's docstring says how a model
uses it.

Imports: `torch_pallas.ops`; transformers itself only inside `register()`.
"""

from __future__ import annotations

import torch

# torch.ops.pallas.attention's public function (its direct path on plain eager calls).
from torch_pallas.ops.attention import attention as pallas_attention

NAME = "pallas"


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, position_bias: torch.Tensor | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """An attention layer's computation, as transformers' interface calls it:
    query (B, H, L, D), key and value (B, Hkv, S, D); returns the output as
    (B, L, H, Dv) and no attention weights."""
    if kwargs.get("softcap") is not None:
        raise ValueError(f"torch_pallas.transformers: attn_implementation={NAME!r} does not "
                         f"support softcap={kwargs['softcap']}; use 'eager'")
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
    """Registers attn_implementation="pallas" with transformers (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
