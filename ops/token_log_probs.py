"""torch.ops.pallas.token_log_probs: each token's log-probability under a
policy at a temperature, and its distribution's entropy, from the hidden
states and the LM head, never holding the (tokens x vocabulary) logits.

    u = (softcap * tanh(z / softcap) if softcap else z) / temperature
    z = F.linear(input, weight, bias)           (in input's dtype; u in float32)
    log_probs = log_softmax(u)[target]          entropy = -(softmax(u) * log_softmax(u)).sum(-1)

What RL and preference training (GRPO, DAPO, DPO) compute for every
completion token, TRL's `selective_log_softmax` and `entropy_from_logits`
on `logits / temperature`, whose logits and gradient are each 2.5 GB in
float32 at 4096 tokens of a 151936-word vocabulary. The rows go in chunks as
linear_cross_entropy's do (ops/linear_cross_entropy.py: a chunk's logits
from the matmul kernels, about the input's size): the forward kernel
reduces each row of a chunk to its log-probability, entropy and
log-sum-exp (kernels/<family>/token_log_probs.py); the backward recomputes
each chunk's logits, the backward kernel turns them and the upstream
gradients of both outputs (any: a loss weights each token, adds beta *
entropy) into the logits' gradient, and two products into the chunk's rows
of d_input and its share of d_weight and d_bias.

Three ops, as linear_cross_entropy's:
- `pallas::token_log_probs(input, weight, target, bias=None, *,
  temperature=1.0, ignore_index=-100, return_entropy=False, softcap=None)
  -> (log_probs, entropy)`, the public signature, CompositeImplicitAutograd:
  it checks its arguments and flattens the rows; entropy is empty unless
  `return_entropy`;
- `pallas::token_log_probs_forward(...) -> (log_prob, entropy, lse)` on rows;
- `pallas::token_log_probs_backward(grad_log_prob, grad_entropy, ...)`.

Both outputs are float32 with target's shape; a token whose target is
`ignore_index` gives 0 for both, and no gradient.
"""

from __future__ import annotations

import math

import torch

from torch_pallas.base import dtypes
from torch_pallas.library import registration
from torch_pallas.ops import checks
from torch_pallas.ops import linear_cross_entropy as lce
from torch_pallas.runtime import launch, registry

OP = "pallas::token_log_probs"
DTYPES = lce.DTYPES


def _check(input, weight, target, bias, temperature, ignore_index, softcap):
    lce.check_linear(OP, input, weight, bias, softcap)
    checks.tensor(OP, "target", target)
    checks.same_device(OP, input, target, names=("input", "target"))
    checks.dtype_in(OP, "target", target.dtype, lce.TARGET_DTYPES)
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise checks.RefusedLikeTorch(
            f"{OP}: target.shape={tuple(target.shape)} must be input's leading shape "
            f"{tuple(input.shape[:-1])} (one token per row)")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{OP}: ignore_index must be an int, got {ignore_index!r}")
    check_temperature(OP, temperature)


def check_temperature(op: str, temperature) -> None:
    """A temperature is a finite number > 0."""
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
            or not math.isfinite(temperature) or temperature <= 0):
        raise ValueError(f"{op}: temperature={temperature!r} must be a finite number > 0")


# A kernel target that no column matches, not even a padded one: a token of
# another vocabulary shard, whose row's log-probability here is -lse.
NO_CLASS = 2**31 - 1


def _kernel_targets(target, ignore_index: int, vocab: int, other_shards: bool):
    """The targets as the kernels take them (int32, -1 where ignored). With
    `other_shards` (the op on one shard of a vocabulary-split head) a target
    at or past the shard's vocabulary is another shard's token (NO_CLASS);
    otherwise every target not ignored must be a class (checked, naming
    the first that is not)."""
    if not other_shards:
        return lce.kernel_targets(target, ignore_index, vocab, OP)
    return torch.where(target == ignore_index, -1,
                       torch.where(target >= vocab, NO_CLASS, target)).to(torch.int32)


def _params(temperature, softcap) -> dict:
    return {"softcap": float(softcap or 0.0), "temperature": float(temperature)}


# --- the forward op on rows ---------------------------------------------------

def _forward_fake(input, weight, target, bias, ignore_index, temperature, softcap,
                  other_shards=False):
    return tuple(input.new_empty((input.shape[0],), dtype=torch.float32) for _ in range(3))


def forward_implementation(input, weight, target, bias, ignore_index, temperature, softcap,
                           other_shards=False):
    rows, hidden = input.shape
    t32 = _kernel_targets(target, ignore_index, weight.shape[0], other_shards)
    step = lce.chunk_rows(rows, hidden, weight.shape[0])
    params = _params(temperature, softcap)
    found = []
    for start in range(0, rows, step):
        size = min(step, rows - start)
        z = lce.chunk_logits(input.narrow(0, start, size), weight, bias)
        found.append(launch.run("token_log_probs", input.device,
                                (z, t32.narrow(0, start, size)), params))
    if not found:  # no rows
        return _forward_fake(input, weight, target, bias, ignore_index, temperature, softcap)
    return tuple(torch.cat(parts) for parts in zip(*found))


def _setup_context(ctx, inputs, output):
    input, weight, target, bias, ignore_index, temperature, softcap, *other_shards = inputs
    _, entropy, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.arguments = (ignore_index, temperature, softcap)
    ctx.other_shards = bool(other_shards and other_shards[0])  # (a default may be left out)
    ctx.save_for_backward(input, weight, target, bias, lse, entropy)


def _backward(ctx, grad_log_prob, grad_entropy, _):
    input, weight, target, bias, lse, entropy = ctx.saved_tensors
    wanted = [ctx.needs_input_grad[i] for i in (0, 1, 3)]
    if not any(wanted):
        return (None,) * 8
    zero = lse.new_zeros(lse.shape)
    grads = torch.ops.pallas.token_log_probs_backward(
        zero if grad_log_prob is None else grad_log_prob,
        zero if grad_entropy is None else grad_entropy,
        input, weight, target, bias, lse, entropy, *ctx.arguments, wanted, ctx.other_shards)
    d_input, d_weight, d_bias = (g if w else None for g, w in zip(grads, wanted))
    return d_input, d_weight, None, d_bias, None, None, None, None


registration.define(
    "pallas::token_log_probs_forward", forward_implementation, fake=_forward_fake,
    schema="(Tensor input, Tensor weight, Tensor target, Tensor? bias, int ignore_index, "
           "float temperature, float? softcap, bool other_shards=False) "
           "-> (Tensor, Tensor, Tensor)",
    backward=_backward, setup_context=_setup_context,
)


# --- the backward op on rows ---------------------------------------------------

def _written(grads, bias) -> tuple[bool, bool, bool]:
    """The gradients a call computes: those asked for, d_bias only with a bias."""
    return bool(grads[0]), bool(grads[1]), bool(grads[2]) and bias is not None


def _backward_fake(grad_log_prob, grad_entropy, input, weight, target, bias, lse, entropy,
                   ignore_index, temperature, softcap, grads, other_shards=False):
    grads = _written(grads, bias)
    empty = weight.new_empty((0,))
    return (input.new_empty(input.shape) if grads[0] else input.new_empty((0,)),
            weight.new_empty(weight.shape) if grads[1] else empty,
            weight.new_empty((weight.shape[0],)) if grads[2] else empty)


def backward_implementation(grad_log_prob, grad_entropy, input, weight, target, bias, lse,
                            entropy, ignore_index, temperature, softcap, grads,
                            other_shards=False):
    """The gradients asked for in `grads` (d_input, d_weight, d_bias; empty
    where not asked): each chunk's logits recomputed, their gradient from
    the backward kernel (E = lse - entropy: each row's p-weighted mean of
    the tempered logits), then the chunk's products."""
    rows, hidden = input.shape
    t32 = _kernel_targets(target, ignore_index, weight.shape[0], other_shards)
    valid = t32 >= 0
    per_row = (lse, lse - entropy, torch.where(valid, grad_log_prob.float(), 0.0),
               torch.where(valid, grad_entropy.float(), 0.0))
    grads = _written(grads, bias)
    sums = lce.gradient_sums(input, weight, grads)
    step = lce.chunk_rows(rows, hidden, weight.shape[0])
    params = _params(temperature, softcap)
    for start in range(0, rows, step):
        size = min(step, rows - start)
        xc = input.narrow(0, start, size)
        z = lce.chunk_logits(xc, weight, bias)
        dz = launch.run("token_log_probs_backward", input.device,
                        (z, t32.narrow(0, start, size),
                         *(v.narrow(0, start, size) for v in per_row)), params)
        del z
        lce.add_chunk_gradients(sums, dz, xc, weight, start, step)
    return lce.finished_gradients(sums, input, weight)


registration.define(
    "pallas::token_log_probs_backward", backward_implementation, fake=_backward_fake,
    schema="(Tensor grad_log_prob, Tensor grad_entropy, Tensor input, Tensor weight, "
           "Tensor target, Tensor? bias, Tensor lse, Tensor entropy, int ignore_index, "
           "float temperature, float? softcap, bool[] grads, bool other_shards=False) "
           "-> (Tensor, Tensor, Tensor)",
)


# --- the composite, the public signature ---------------------------------------

def _vocabulary_parallel(input, weight, target, bias, temperature, ignore_index, softcap,
                         dim: int):
    """Both outputs over a weight split on the vocabulary along mesh
    dimension `dim` (a ColwiseParallel LM head), without gathering the
    weight or the logits, as linear_cross_entropy's `_vocabulary_parallel`
    does: each rank computes on its shard (`local_map`) every row's
    log-sum-exp lse_s and p-weighted mean logit E_s over its classes (the
    forward op with every token another shard's: log-prob -lse_s, entropy
    lse_s - E_s) and its target's tempered logit where the target is one of
    its classes; DTensor gathers (lse_s, E_s), two floats per row and rank,
    and sums the target logits. lse = logsumexp_s lse_s, E = sum_s
    softmax_s(lse_s) E_s; log p_t = u_t - lse, entropy = lse - E. The
    input's gradient is Partial over the ranks, the weight's stays split."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import local_map

    mesh, vocab, hidden = weight.device_mesh, weight.shape[0], input.shape[-1]
    whole = [Replicate()] * mesh.ndim
    split, summed = list(whole), list(whole)
    split[dim], summed[dim] = Shard(0), Partial()
    if tuple(input.placements) != tuple(whole):  # (only then: its gradient stays Partial)
        input = input.redistribute(placements=whole)
    x = input.reshape(-1, hidden)
    t = target.full_tensor() if checks.is_dtensor(target) else target
    t32 = lce.kernel_targets(t.reshape(-1), ignore_index, vocab, OP)
    valid = t32 >= 0
    start = min(mesh.get_coordinate()[dim] * -(-vocab // mesh.size(dim)), vocab)  # torch.chunk's

    def shard_terms(x, w, b):
        others = torch.where(valid, w.shape[0], -1)
        minus_lse, entropy, _ = torch.ops.pallas.token_log_probs_forward(
            x, w, others, b, -1, temperature, softcap, True)
        mine = (t32 >= start) & (t32 < start + w.shape[0])
        rows = torch.where(mine, t32 - start, 0)
        z = (x.float() * w[rows].float()).sum(-1).to(x.dtype)  # as F.linear rounds
        if b is not None:
            z = z + b[rows]
        u = z.float()
        if softcap is not None:
            u = softcap * torch.tanh(u / softcap)
        u = u / temperature
        terms = torch.stack([-minus_lse, -minus_lse - entropy])  # lse_s, E_s
        return terms.unsqueeze(0), torch.where(mine, u, 0.0)

    weights = (split, split) if bias is not None else (split, None)
    stacked, target_logit = local_map(
        shard_terms, out_placements=(split, summed),
        in_placements=(whole, *weights), in_grad_placements=(summed, *weights),
        device_mesh=mesh)(x, weight, bias)
    lses, means = stacked.redistribute(placements=whole).unbind(1)
    lse = torch.logsumexp(lses, dim=0)
    mean = (torch.softmax(lses, dim=0) * means).sum(0)
    valid = DTensor.from_local(valid, mesh, whole, run_check=False)
    log_prob = torch.where(valid, target_logit.redistribute(placements=whole) - lse, 0.0)
    return log_prob, torch.where(valid, lse - mean, 0.0)


def token_log_probs_implementation(input, weight, target, bias=None, *, temperature=1.0,
                                   ignore_index=-100, return_entropy=False, softcap=None):
    _check(input, weight, target, bias, temperature, ignore_index, softcap)
    split = lce._vocabulary_split(input, weight, bias, 0.0, softcap)
    if split is not None:
        log_prob, entropy = _vocabulary_parallel(input, weight, target, bias, temperature,
                                                 ignore_index, softcap, split)
        entropy = entropy.reshape(target.shape) if return_entropy else entropy.new_empty((0,))
        return log_prob.reshape(target.shape), entropy
    log_prob, entropy, _ = torch.ops.pallas.token_log_probs_forward(
        input.reshape(-1, input.shape[-1]), weight, target.reshape(-1), bias, ignore_index,
        temperature, softcap)
    entropy = entropy.reshape(target.shape) if return_entropy else entropy.new_empty((0,))
    return log_prob.reshape(target.shape), entropy


registration.define_composite(
    OP,
    "(Tensor input, Tensor weight, Tensor target, Tensor? bias=None, *, "
    "float temperature=1.0, int ignore_index=-100, bool return_entropy=False, "
    "float? softcap=None) -> (Tensor, Tensor)",
    token_log_probs_implementation,
)


def token_log_probs(input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                    bias: torch.Tensor | None = None, *, temperature: float = 1.0,
                    ignore_index: int = -100, return_entropy: bool = False,
                    softcap: float | None = None):
    """Each token's log-probability `log_softmax(z / temperature)[target]`
    of z = F.linear(input, weight, bias) (Gemma 2's `softcap * tanh(z /
    softcap)` first when `softcap` is set), in float32 with target's shape,
    never materialising z; with `return_entropy`, also each position's
    entropy `-(softmax * log_softmax).sum(-1)`: a tuple (log_probs,
    entropy). input (..., H), weight (V, H), target (...) integer tokens or
    `ignore_index` (0 for both outputs there). Differentiable in input,
    weight and bias through both outputs."""
    log_probs, entropy = torch.ops.pallas.token_log_probs(
        input, weight, target, bias, temperature=temperature, ignore_index=ignore_index,
        return_entropy=return_entropy, softcap=softcap)
    return (log_probs, entropy) if return_entropy else log_probs


def token_log_probs_backward(grad_log_prob, grad_entropy, input, weight, target, bias, lse,
                             entropy, ignore_index=-100, temperature=1.0, softcap=None,
                             grads=(True, True, True)):
    """The backward op on rows: (d_input, d_weight, d_bias) for the upstream
    gradients of each row's log-probability and entropy, from the
    forward's lse and entropy; `grads` says which to compute (the others
    are empty)."""
    return torch.ops.pallas.token_log_probs_backward(
        grad_log_prob, grad_entropy, input, weight, target, bias, lse, entropy, ignore_index,
        temperature, softcap, list(grads))


# --- references and examples ---------------------------------------------------

def of_logits(z, target, *, temperature=1.0, ignore_index=-100, softcap=None):
    """(log_probs, entropy) from logits z (..., V), in z's dtype (float32 or
    float64): TRL's `selective_log_softmax(z / T, target)` and
    `entropy_from_logits(z / T)`, 0 where target is ignore_index."""
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    log_p = torch.log_softmax(z / temperature, dim=-1)
    ignored = target == ignore_index
    picked = log_p.gather(-1, torch.where(ignored, 0, target).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return torch.where(ignored, 0.0, picked), torch.where(ignored, 0.0, entropy)


def torch_token_log_probs(input, weight, target, bias=None, *, temperature=1.0,
                          ignore_index=-100, return_entropy=False, softcap=None):
    """torch's composition, which the op replaces (it holds the logits)."""
    out = of_logits(torch.nn.functional.linear(input, weight, bias).float(), target,
                    temperature=temperature, ignore_index=ignore_index, softcap=softcap)
    return out if return_entropy else out[0]


def reference(input, weight, target, bias=None, **kwargs):
    """torch's composition in float64, the logits rounded to the input's
    dtype first, as F.linear rounds them: (log_probs, entropy)."""
    z = torch.nn.functional.linear(*(t.detach().cpu().double() if t is not None else None
                                     for t in (input, weight, bias)))
    kwargs.pop("return_entropy", None)
    return of_logits(z.to(input.dtype).double(), target.cpu(), **kwargs)


def error_bound(input, weight, ref, temperature=1.0):
    """linear_cross_entropy's bound, the logits scaled by 1 / temperature."""
    return lce.error_bound(input, weight, ref) / min(temperature, 1.0)


def examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """A ragged bfloat16 call with a bias, an ignored token and a
    temperature, and a float32 one with a soft cap, both with the entropy."""
    found = []
    cases = (((2, 7, 24), 83, torch.bfloat16, True, {"temperature": 0.7}),
             ((9, 16), 300, torch.float32, False, {"softcap": 3.0}))
    for shape, vocab, dtype, has_bias, kwargs in cases:
        kwargs = {**kwargs, "return_entropy": True}
        x, w, b, target = lce.example_inputs(device, shape, vocab, dtype, has_bias,
                                          requires_grad)
        ref = reference(x, w, target, b, **kwargs)
        temperature = kwargs.get("temperature", 1.0)
        found.append(registry.Example((x, w, target, b), kwargs, ref,
                                      tuple(error_bound(x, w, r, temperature) for r in ref)))
    return found


registry.register(registry.OpInfo(
    name="token_log_probs",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.token_log_probs",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.token_log_probs",
        "triton": "torch_pallas.kernels.triton.token_log_probs",
    },
    function=token_log_probs,
    torch_function=torch_token_log_probs,
    examples=examples,
))


def reference_gradients(grad_log_prob, grad_entropy, input, weight, target, bias, lse, entropy,
                        ignore_index=-100, temperature=1.0, softcap=None,
                        grads=(True, True, True)):
    """(d_input, d_weight, d_bias) in float64 (d_bias empty without a bias)."""
    leaves = [t.detach().cpu().double().requires_grad_() if t is not None else None
              for t in (input, weight, bias)]
    log_p, h = torch_token_log_probs(*leaves[:2], target.cpu(), leaves[2],
                                     temperature=temperature, ignore_index=ignore_index,
                                     return_entropy=True, softcap=softcap)
    wanted = [t for t in leaves if t is not None]
    found = list(torch.autograd.grad((log_p, h), wanted,
                                     (grad_log_prob.cpu().double(), grad_entropy.cpu().double())))
    if bias is None:
        found.append(torch.zeros(0, dtype=torch.float64))
    return tuple(found)


def backward_examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """The backward of a ragged float16 call with a bias, an ignored token
    and a temperature, and of a float32 one with a soft cap."""
    found = []
    cases = ((11, 20, 70, torch.float16, True, 0.7, None),
             (6, 12, 45, torch.float32, False, 1.0, 2.0))
    for rows, hidden, vocab, dtype, has_bias, temperature, softcap in cases:
        x, w, b, target = lce.example_inputs(device, (rows, hidden), vocab, dtype, has_bias)
        _, entropy, lse = torch.ops.pallas.token_log_probs_forward(x, w, target, b, -100,
                                                                   temperature, softcap)
        args = (torch.randn(rows, device=device), torch.randn(rows, device=device), x, w, target,
                b, lse, entropy, -100, temperature, softcap, [True] * 3)
        expected = reference_gradients(*args)
        bounds = tuple((e.abs() + 1) * dtypes.ROUNDING[dtype] * 8 * (hidden + rows) ** 0.5
                       for e in expected)
        found.append(registry.Example(args, {}, expected, bounds))
    return found


registry.register(registry.OpInfo(
    name="token_log_probs_backward",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.token_log_probs_backward",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.token_log_probs_backward",
        "triton": "torch_pallas.kernels.triton.token_log_probs_backward",
    },
    function=token_log_probs_backward,
    torch_function=reference_gradients,
    examples=backward_examples,
))
