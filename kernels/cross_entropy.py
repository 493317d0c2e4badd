"""The cross-entropy formulas the JAX kernel families share (the TPU and
Mosaic GPU kernels of linear_cross_entropy), on float32 arrays of any
layout: elementwise, so a kernel applies them to whatever tile it holds.

For logits z over a vocabulary of V classes, a target class t, label
smoothing e and an optional soft cap c (Gemma 2's `c * tanh(z / c)`,
applied to the logits before everything else):

    lse    = log(sum_j exp(z_j))
    loss   = lse - (1 - e) * z_t - e * mean_j(z_j)
    dL/dz_j = softmax_j - (1 - e) * [j == t] - e / V     (times dz_capped/dz
                                                          = 1 - (z_capped/c)^2)

which is torch's `F.cross_entropy(z, t, label_smoothing=e)` per row: the
smoothed target puts (1 - e) + e/V on t and e/V on every other class.

token_log_probs (post-training: a policy's log-probs at a temperature T and
its entropy) works on u = capped(z) / T, p = softmax(u), E = sum_j p_j u_j:

    log p_t = u_t - lse          entropy H = lse - E
    dH/du_j = p_j * (E - u_j)    d(log p_t)/du_j = [j == t] - p_j

so for upstream gradients a (of log p_t) and b (of H), per row,
dz_j = (a * ([j == t] - p_j) + b * p_j * (E - u_j)) / T, times the cap's
derivative. E accumulates online beside the sum of exponentials.
"""

from __future__ import annotations

import jax.numpy as jnp


def capped(z, softcap: float):
    """The logits after the soft cap (themselves without one)."""
    return softcap * jnp.tanh(z / softcap) if softcap else z


def row_loss(lse, target_logit, logit_sum, *, vocab: int, smoothing: float):
    """A row's loss from its log-sum-exp, its target's logit and (with label
    smoothing) the sum of its logits."""
    loss = lse - (1.0 - smoothing) * target_logit
    if smoothing:
        loss = loss - smoothing * logit_sum / vocab
    return loss


def logit_gradient(z_capped, lse, is_target, scale, *, vocab: int, smoothing: float,
                   softcap: float):
    """dL/dz for a tile of capped logits, `lse` and `scale` (the row's
    gradient factor: 0 for an ignored row) broadcast to the tile."""
    grad = jnp.exp(z_capped - lse) - jnp.where(is_target, 1.0 - smoothing, 0.0)
    if smoothing:
        grad = grad - smoothing / vocab
    if softcap:
        grad = grad * (1.0 - (z_capped / softcap) ** 2)
    return grad * scale


def tempered(z, softcap: float, temperature: float):
    """u = capped(z) / T: the logits a policy samples from at temperature T."""
    z = capped(z, softcap)
    return z if temperature == 1.0 else z * (1.0 / temperature)


def log_prob_gradient(u, lse, expected, is_target, grad_log_prob, grad_entropy, *,
                      softcap: float, temperature: float):
    """dz for a tile of tempered logits u, from the row's `lse` and E (the
    p-weighted mean of u) and the upstream gradients of log p_t and of the
    entropy (0 on an ignored row), all broadcast to the tile."""
    p = jnp.exp(u - lse)
    grad = grad_log_prob * (jnp.where(is_target, 1.0, 0.0) - p) + grad_entropy * p * (expected - u)
    if temperature != 1.0:
        grad = grad * (1.0 / temperature)
    if softcap:
        grad = grad * (1.0 - (u * (temperature / softcap)) ** 2)
    return grad
