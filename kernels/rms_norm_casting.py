"""Where an RMSNorm rounds: the casting modes of Liger-Kernel's rms_norm,
one per way the models compute it. With n = x * rstd in float32 (rstd =
1 / sqrt(mean(x^2) + eps), x upcast to float32) and w the weight:

    NONE   out = (n * w) in float32, rounded once to x's dtype
           (torch.nn.functional.rms_norm)
    LLAMA  out = w * n.to(x's dtype): n rounded to x's dtype, then the product
           of the two (upcast, multiplied in float32, rounded once) in
           promote_types(x, w)'s dtype (transformers' LlamaRMSNorm, T5's,
           Mistral's, Qwen's...); without a weight, n.to(x's dtype)
    GEMMA  out = (n * (1 + w in float32)) rounded once to x's dtype
           (GemmaRMSNorm: Gemma, Gemma 2, Gemma 3; the weight is stored as
           an offset from one)

The backward treats each rounding as the identity, as autograd does: dx
from g = dy * w (dy * (1 + w) for GEMMA), and dw = sum over rows of dy * n
(dy * n.to(x's dtype) for LLAMA, the factor its forward multiplied).

No JAX here: the op layer, the Triton kernels and the JAX kernels read the
same enum (rms_norm_math.py holds the JAX kernels' formulas).
"""

from __future__ import annotations

import enum


class Casting(enum.Enum):
    """An RMSNorm's rounding, by the name the op takes (`casting_mode`)."""

    NONE = "none"
    LLAMA = "llama"
    GEMMA = "gemma"

    @property
    def rounds_normalized(self) -> bool:
        """Whether n is rounded to x's dtype before the weight multiplies it."""
        return self is Casting.LLAMA

    @property
    def offsets_weight(self) -> bool:
        """Whether the weight multiplies as 1 + w (a weight is then required)."""
        return self is Casting.GEMMA

    def output_dtype(self, x_dtype, weight_dtype, promote_types):
        """The output's dtype: x's, or for a weighted LLAMA output
        promote_types(x, weight) (a float32 weight on a bfloat16 input gives
        float32), `promote_types` being the caller's library's (torch's or
        JAX's: they agree on these three dtypes). `weight_dtype` None: no
        weight."""
        if weight_dtype is not None and self is Casting.LLAMA:
            return promote_types(x_dtype, weight_dtype)
        return x_dtype
