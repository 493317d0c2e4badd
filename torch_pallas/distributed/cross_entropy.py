"""pallas::linear_cross_entropy and pallas::token_log_probs under DTensor:
the tokens split (input,
target, the per-token lse and the input's gradient alike); the weight and
bias stay whole, their gradients (sums over the tokens) Partial. The loss
of a split call is split for "none" and Partial for "sum"; a "mean" over
split tokens divides by the count of every rank's tokens, so the composite
computes it as the "sum" over the count (ops/linear_cross_entropy.py) and
the forward op is never asked for a split "mean".

A weight split along the vocabulary (a ColwiseParallel LM head) never
reaches these ops: each token's log-sum-exp needs every logit, so the
composite computes the loss from each rank's shard instead (its rows'
log-sum-exps, `pallas::linear_logsumexp`, gathered, and its target logits
summed: `_vocabulary_parallel` in ops/linear_cross_entropy.py), as torch's
`loss_parallel` does for cross_entropy. Only label smoothing of
soft-capped logits, whose mean needs every capped logit, leaves the weight
to DTensor, which gathers it.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.experimental import register_sharding

from torch_pallas.distributed.labels import strategies

TOKENS = ("tokens", None)
WHOLE = (None, None)


@register_sharding(torch.ops.pallas.linear_cross_entropy_forward.default)
def linear_cross_entropy_forward(input, weight, target, bias, ignore_index, reduction,
                                 label_smoothing, softcap, grads):
    loss = ("tokens",) if reduction == "none" else ()
    results = [loss, ("tokens",), TOKENS, WHOLE, (None,)]
    summed = [2, 3, 4] + ([0] if reduction == "sum" else [])
    arguments = [TOKENS, WHOLE, ("tokens",), None if bias is None else (None,),
                 None, None, None, None, None]
    return strategies(results, arguments, summed=summed)


@register_sharding(torch.ops.pallas.linear_cross_entropy_backward.default)
def linear_cross_entropy_backward(grad_loss, input, weight, target, bias, lse, ignore_index,
                                  reduction, label_smoothing, softcap, grads):
    per_token = ("tokens",) if grad_loss.ndim else ()
    arguments = [per_token, TOKENS, WHOLE, ("tokens",), None if bias is None else (None,),
                 ("tokens",), None, None, None, None, None]
    return strategies([TOKENS, WHOLE, (None,)], arguments, summed=[0, 1, 2])


@register_sharding(torch.ops.pallas.linear_logsumexp.default)
def linear_logsumexp(input, weight, bias, softcap):
    arguments = [TOKENS, WHOLE, None if bias is None else (None,), None]
    return strategies([("tokens",)], arguments)


@register_sharding(torch.ops.pallas.linear_logsumexp_backward.default)
def linear_logsumexp_backward(grad, input, weight, bias, lse, softcap, grads):
    arguments = [("tokens",), TOKENS, WHOLE, None if bias is None else (None,), ("tokens",),
                 None, None]
    return strategies([TOKENS, WHOLE, (None,)], arguments, summed=[1, 2])


@register_sharding(torch.ops.pallas.token_log_probs_forward.default)
def token_log_probs_forward(input, weight, target, bias, ignore_index, temperature, softcap,
                            other_shards=False):
    arguments = [TOKENS, WHOLE, ("tokens",), None if bias is None else (None,),
                 None, None, None, None]
    return strategies([("tokens",)] * 3, arguments)


@register_sharding(torch.ops.pallas.token_log_probs_backward.default)
def token_log_probs_backward(grad_log_prob, grad_entropy, input, weight, target, bias, lse,
                             entropy, ignore_index, temperature, softcap, grads,
                             other_shards=False):
    arguments = [("tokens",), ("tokens",), TOKENS, WHOLE, ("tokens",),
                 None if bias is None else (None,), ("tokens",), ("tokens",),
                 None, None, None, None, None]
    return strategies([TOKENS, WHOLE, (None,)], arguments, summed=[1, 2])
