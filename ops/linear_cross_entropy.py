"""torch.ops.pallas.linear_cross_entropy: a language model's head and its
loss in one op that never holds the (tokens x vocabulary) logits.

    loss = F.cross_entropy(z.float(), target, ignore_index=..., reduction=...,
                           label_smoothing=...)
    z = F.linear(input, weight, bias)      (softcap * tanh(z / softcap) with a softcap)

At a vocabulary of 128k and 8k tokens the logits are 4 GB in float32 and
their gradient as much again; here the rows go through in chunks (as
Liger-Kernel's fused linear cross entropy does): a chunk's logits come from
the matmul kernels (`pallas::matmul`, in the input's dtype, as F.linear
rounds them), the loss kernel reduces each row to its loss and log-sum-exp,
and when gradients are wanted the backward kernel turns the chunk's logits
into their gradient, which two more products turn into the chunk's rows of
d_input and its share of d_weight (and d_bias), accumulated in float32.
Peak memory grows with the chunk, not with tokens x vocabulary.

Three ops, as the norms':
- `pallas::linear_cross_entropy(input, weight, target, bias=None, *,
  ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None)`,
  the public signature; CompositeImplicitAutograd: it checks its arguments,
  flattens the rows and calls the forward op, asking for the gradients
  autograd will want;
- `pallas::linear_cross_entropy_forward(...) -> (loss, lse, d_input,
  d_weight, d_bias)`: the loss, each row's log-sum-exp, and for "mean" and
  "sum" the gradients of the loss, written during the forward (empty where
  not asked for); its backward scales them by the loss's gradient;
- `pallas::linear_cross_entropy_backward(grad_loss, ...)`: the gradients
  for a per-row `grad_loss` ("none"), recomputing each chunk's logits from
  the saved log-sum-exp.

The loss is float32; "none" keeps target's shape. Every row ignored gives
what torch gives: nan for "mean", 0 for "sum".
"""

from __future__ import annotations

import torch

from torch_pallas.base import dtypes
from torch_pallas.library import registration
from torch_pallas.ops import checks
from torch_pallas.runtime import compile_path, launch, registry

OP = "pallas::linear_cross_entropy"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TARGET_DTYPES = (torch.int64, torch.int32)
REDUCTIONS = ("mean", "sum", "none")
# A chunk's logits hold about as many elements as the input (Liger-Kernel's
# rule), and at least this many rows: fewer make the products inefficient
# (128 rows: 0.8x torch's speed at 4096 x 1024 x 32000 on 2 cores, 256: 1.0x).
MIN_CHUNK_ROWS = 256


def chunk_rows(rows: int, hidden: int, vocab: int) -> int:
    """Rows per chunk: logits of about the input's size (rows x hidden), a
    power of two, at least MIN_CHUNK_ROWS (all rows where fewer)."""
    target = max(1, rows * hidden // max(vocab, 1))
    return max(1, min(rows, max(MIN_CHUNK_ROWS, 1 << (target - 1).bit_length())))


def _check(input, weight, target, bias, ignore_index, reduction, label_smoothing, softcap):
    check_linear(OP, input, weight, bias, softcap)
    checks.tensor(OP, "target", target)
    checks.same_device(OP, input, target, names=("input", "target"))
    checks.dtype_in(OP, "target", target.dtype, TARGET_DTYPES)
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise checks.RefusedLikeTorch(
            f"{OP}: target.shape={tuple(target.shape)} must be input's leading shape "
            f"{tuple(input.shape[:-1])} (one class per row)")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{OP}: ignore_index must be an int, got {ignore_index!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{OP}: reduction={reduction!r} must be one of {', '.join(REDUCTIONS)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{OP}: label_smoothing={label_smoothing} must be in [0, 1]")


def check_linear(op, input, weight, bias, softcap):
    """The logits' arguments: input (..., H), weight (V, H), bias (V,), of
    one supported dtype and device, and the soft cap."""
    checks.tensor(op, "input", input)
    checks.tensor(op, "weight", weight)
    checks.dtype_in(op, "input", input.dtype, DTYPES)
    checks.same_dtype(op, input, weight, names=("input", "weight"))
    checks.same_device(op, input, weight, names=("input", "weight"))
    if input.dim() < 1 or weight.dim() != 2 or weight.shape[1] != input.shape[-1]:
        raise checks.RefusedLikeTorch(
            f"{op}: input (..., H) and weight (V, H) must share H; got input.shape="
            f"{tuple(input.shape)} and weight.shape={tuple(weight.shape)}")
    if bias is not None:
        checks.tensor(op, "bias", bias)
        checks.same_dtype(op, input, bias, names=("input", "bias"))
        checks.same_device(op, input, bias, names=("input", "bias"))
        if tuple(bias.shape) != (weight.shape[0],):
            raise checks.RefusedLikeTorch(
                f"{op}: bias.shape={tuple(bias.shape)} must be (V,) = ({weight.shape[0]},)")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{op}: softcap={softcap} must be None or > 0")


def kernel_targets(target: torch.Tensor, ignore_index: int, vocab: int,
                    op: str = OP) -> torch.Tensor:
    """The targets as the kernels take them: int32, -1 for an ignored row,
    after checking that every other one is a class (torch raises for the
    others too; so does this, naming the first)."""
    ignored = target == ignore_index
    if not compile_path.tracing_triton():  # values exist only when run
        bad = ~ignored & ((target < 0) | (target >= vocab))
        if bool(bad.any()):
            value = target[bad][0].item()
            raise IndexError(f"{op}: target holds {value}, not a class in [0, {vocab}) "
                             f"nor ignore_index={ignore_index}")
    return torch.where(ignored, -1, target).to(torch.int32)


def _row_scale(t32, reduction: str, grad_loss) -> torch.Tensor:
    """Each row's factor on its logits' gradient: the loss's gradient (per
    row for "none"), over the count of valid rows for "mean", and 0 where
    the row is ignored (also when every row is: torch's gradient is 0 then,
    though its "mean" loss is nan)."""
    valid = t32 >= 0
    grad = grad_loss.reshape(-1).float() if reduction == "none" else grad_loss.float()
    if reduction == "mean":
        grad = grad / valid.sum()
    return torch.where(valid, grad, 0.0)


def _empty(x):
    return x.new_empty((0,))


def _run_chunks(x, weight, t32, bias, params, *, lse=None, scale=None, grads=(False,) * 3):
    """Walks the rows in chunks: (loss rows, lse) when `lse` is None (the
    forward), and the gradients asked for in `grads` (d_input, d_weight,
    d_bias; empty where not asked) from `scale` (each row's factor)."""
    rows, hidden = x.shape
    step = chunk_rows(rows, hidden, weight.shape[0])
    forward = lse is None
    losses, lses = [], []
    sums = gradient_sums(x, weight, grads)
    for start in range(0, rows, step):
        size = min(step, rows - start)
        xc, tc = x.narrow(0, start, size), t32.narrow(0, start, size)
        z = chunk_logits(xc, weight, bias)
        if forward:
            loss_c, lse_c = launch.run("linear_cross_entropy", x.device, (z, tc), params)
            losses.append(loss_c)
            lses.append(lse_c)
        else:
            lse_c = lse.narrow(0, start, size)
        if not any(grads):
            continue
        dz = launch.run("linear_cross_entropy_backward", x.device,
                        (z, tc, lse_c, scale.narrow(0, start, size)), params)
        del z
        add_chunk_gradients(sums, dz, xc, weight, start, step)
    if forward:
        loss = torch.cat(losses) if losses else x.new_zeros((0,), dtype=torch.float32)
        lse = torch.cat(lses) if lses else x.new_zeros((0,), dtype=torch.float32)
    else:
        loss = None
    return (loss, lse, *finished_gradients(sums, x, weight))


# --- a chunk walk's pieces (token_log_probs walks its chunks with them too) ----

def chunk_logits(xc, weight, bias):
    """A chunk's logits in the input's dtype, as F.linear rounds them."""
    z = torch.ops.pallas.matmul(xc, weight.t())
    if bias is not None:
        z += bias
    return z


def gradient_sums(x, weight, grads):
    """Zeroed sums for the gradients asked for in `grads` (d_input in x's
    dtype, d_weight and d_bias in float32; None where not asked)."""
    vocab, hidden = weight.shape
    return [x.new_zeros(x.shape) if grads[0] else None,
            weight.new_zeros((vocab, hidden), dtype=torch.float32) if grads[1] else None,
            weight.new_zeros((vocab,), dtype=torch.float32) if grads[2] else None]


def add_chunk_gradients(sums, dz, xc, weight, start: int, step: int) -> None:
    """Adds a chunk's share (its logits' gradient dz, its rows xc from row
    `start`, chunks of `step` rows) into `sums`. Into narrowed views with
    add_ (a copy_ into a view cannot be traced on fake CUDA tensors by a
    CPU-only torch, which the compile path's test does); d_weight's share
    in slices of the vocabulary, each product half a chunk's logits (a
    whole (V, H) product per chunk would double d_weight's memory)."""
    d_input, d_weight, d_bias = sums
    vocab, hidden = weight.shape
    if d_input is not None:
        d_input.narrow(0, start, dz.shape[0]).add_(torch.ops.pallas.matmul(dz, weight))
    if d_weight is not None:
        slice_rows = max(MIN_CHUNK_ROWS, step * vocab // hidden // 2)
        for v in range(0, vocab, slice_rows):
            n = min(slice_rows, vocab - v)
            d_weight.narrow(0, v, n).add_(torch.ops.pallas.matmul(dz.narrow(1, v, n).t(), xc))
    if d_bias is not None:
        d_bias += dz.sum(0, dtype=torch.float32)


def finished_gradients(sums, x, weight) -> tuple:
    """The sums in their arguments' dtypes, empty where not asked."""
    d_input, d_weight, d_bias = sums
    return (_empty(x) if d_input is None else d_input,
            _empty(weight) if d_weight is None else d_weight.to(weight.dtype),
            _empty(weight) if d_bias is None else d_bias.to(weight.dtype))


def _params(label_smoothing, softcap) -> dict:
    return {"smoothing": float(label_smoothing), "softcap": float(softcap or 0.0)}


def _reduce(loss_rows, t32, reduction):
    if reduction == "none":
        return loss_rows
    total = loss_rows.sum()
    return total / (t32 >= 0).sum() if reduction == "mean" else total


# --- the forward op on rows --------------------------------------------------

def _written(grads, bias, reduction=None) -> tuple[bool, bool, bool]:
    """The gradients a call computes: those asked for, d_bias only with a
    bias, and none in the forward for "none" (they need the loss's gradient
    per row: the backward op computes them)."""
    if reduction == "none":
        return (False,) * 3
    return bool(grads[0]), bool(grads[1]), bool(grads[2]) and bias is not None


def _forward_fake(input, weight, target, bias, ignore_index, reduction, label_smoothing,
                  softcap, grads):
    grads = _written(grads, bias, reduction)
    rows = input.shape[0]
    loss_shape = (rows,) if reduction == "none" else ()
    return (input.new_empty(loss_shape, dtype=torch.float32),
            input.new_empty((rows,), dtype=torch.float32),
            input.new_empty(input.shape) if grads[0] else _empty(input),
            weight.new_empty(weight.shape) if grads[1] else _empty(weight),
            weight.new_empty((weight.shape[0],)) if grads[2] else _empty(weight))


def forward_implementation(input, weight, target, bias, ignore_index, reduction,
                           label_smoothing, softcap, grads):
    vocab = weight.shape[0]
    t32 = kernel_targets(target, ignore_index, vocab)
    grads = _written(grads, bias, reduction)
    scale = _row_scale(t32, reduction, input.new_ones((), dtype=torch.float32))
    loss_rows, lse, *found = _run_chunks(input, weight, t32, bias,
                                         _params(label_smoothing, softcap), scale=scale,
                                         grads=grads)
    return (_reduce(loss_rows, t32, reduction), lse, *found)


def _setup_context(ctx, inputs, output):
    input, weight, target, bias, ignore_index, reduction, smoothing, softcap, grads = inputs
    _, lse, *found = output
    ctx.mark_non_differentiable(lse, *found)
    ctx.computed = _written(grads, bias, reduction)
    ctx.arguments = (ignore_index, reduction, smoothing, softcap)
    ctx.save_for_backward(input, weight, target, bias, lse, *found)


def _backward(ctx, grad_loss, *_):
    input, weight, target, bias, lse, *found = ctx.saved_tensors
    wanted = tuple(ctx.needs_input_grad[i] for i in (0, 1, 3))
    if not any(wanted):
        return (None,) * 9
    if all(done or not want for done, want in zip(ctx.computed, wanted)):
        # Scaled in place: no second d_weight in memory. The saved tensors'
        # versions move, so a second backward through the graph
        # (retain_graph) raises torch's "modified by an inplace operation"
        # instead of scaling them twice.
        grads = [g.mul_(grad_loss) if w else None for g, w in zip(found, wanted)]
    else:
        grads = torch.ops.pallas.linear_cross_entropy_backward(
            grad_loss, input, weight, target, bias, lse, *ctx.arguments, list(wanted))
        grads = [g if w else None for g, w in zip(grads, wanted)]
    d_input, d_weight, d_bias = grads
    return d_input, d_weight, None, d_bias, None, None, None, None, None


registration.define(
    "pallas::linear_cross_entropy_forward", forward_implementation, fake=_forward_fake,
    schema="(Tensor input, Tensor weight, Tensor target, Tensor? bias, int ignore_index, "
           "str reduction, float label_smoothing, float? softcap, bool[] grads) "
           "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    backward=_backward, setup_context=_setup_context,
)


# --- the backward op (reduction "none") --------------------------------------

def _backward_fake(grad_loss, input, weight, target, bias, lse, ignore_index, reduction,
                   label_smoothing, softcap, grads):
    grads = _written(grads, bias)
    return (input.new_empty(input.shape) if grads[0] else _empty(input),
            weight.new_empty(weight.shape) if grads[1] else _empty(weight),
            weight.new_empty((weight.shape[0],)) if grads[2] else _empty(weight))


def backward_implementation(grad_loss, input, weight, target, bias, lse, ignore_index,
                            reduction, label_smoothing, softcap, grads):
    t32 = kernel_targets(target, ignore_index, weight.shape[0])
    scale = _row_scale(t32, reduction, grad_loss)
    _, _, *found = _run_chunks(input, weight, t32, bias, _params(label_smoothing, softcap),
                               lse=lse, scale=scale, grads=_written(grads, bias))
    return tuple(found)


registration.define(
    "pallas::linear_cross_entropy_backward", backward_implementation, fake=_backward_fake,
    schema="(Tensor grad_loss, Tensor input, Tensor weight, Tensor target, Tensor? bias, "
           "Tensor lse, int ignore_index, str reduction, float label_smoothing, float? softcap, "
           "bool[] grads) -> (Tensor, Tensor, Tensor)",
)


# --- the rows' log-sum-exp (the loss over a vocabulary-split weight) ---------

def _no_class(x: torch.Tensor, vocab: int) -> torch.Tensor:
    """Kernel targets that match no column and are not ignored: each row's
    loss is then its log-sum-exp, and its logits' gradient the softmax."""
    return torch.full((x.shape[0],), vocab, dtype=torch.int32, device=x.device)


def _check_rows(input, weight, bias, softcap):
    check_linear("pallas::linear_logsumexp", input, weight, bias, softcap)
    if input.dim() != 2:
        raise ValueError(f"pallas::linear_logsumexp: input must be rows (R, H), got "
                         f"input.shape={tuple(input.shape)}")


def _logsumexp_fake(input, weight, bias, softcap):
    _check_rows(input, weight, bias, softcap)
    return input.new_empty((input.shape[0],), dtype=torch.float32)


def logsumexp_implementation(input, weight, bias, softcap):
    _check_rows(input, weight, bias, softcap)
    _, lse, *_ = _run_chunks(input, weight, _no_class(input, weight.shape[0]), bias,
                             _params(0.0, softcap))
    return lse


def _logsumexp_setup_context(ctx, inputs, output):
    input, weight, bias, softcap = inputs
    ctx.softcap = softcap
    ctx.save_for_backward(input, weight, bias, output)


def _logsumexp_backward(ctx, grad):
    input, weight, bias, lse = ctx.saved_tensors
    wanted = [ctx.needs_input_grad[i] for i in (0, 1, 2)]
    if not any(wanted):
        return None, None, None, None
    grads = torch.ops.pallas.linear_logsumexp_backward(grad, input, weight, bias, lse,
                                                       ctx.softcap, wanted)
    return (*(g if w else None for g, w in zip(grads, wanted)), None)


def _logsumexp_backward_fake(grad, input, weight, bias, lse, softcap, grads):
    return _backward_fake(grad, input, weight, None, bias, lse, None, None, None, None, grads)


def logsumexp_backward_implementation(grad, input, weight, bias, lse, softcap, grads):
    _, _, *found = _run_chunks(input, weight, _no_class(input, weight.shape[0]), bias,
                               _params(0.0, softcap), lse=lse, scale=grad.float(),
                               grads=_written(grads, bias))
    return tuple(found)


registration.define(
    "pallas::linear_logsumexp", logsumexp_implementation, fake=_logsumexp_fake,
    schema="(Tensor input, Tensor weight, Tensor? bias, float? softcap) -> Tensor",
    backward=_logsumexp_backward, setup_context=_logsumexp_setup_context,
)
registration.define(
    "pallas::linear_logsumexp_backward", logsumexp_backward_implementation,
    fake=_logsumexp_backward_fake,
    schema="(Tensor grad, Tensor input, Tensor weight, Tensor? bias, Tensor lse, float? softcap, "
           "bool[] grads) -> (Tensor, Tensor, Tensor)",
)


def _vocabulary_split(input, weight, bias, label_smoothing, softcap) -> int | None:
    """The mesh dimension along which a DTensor weight is split on the
    vocabulary (Shard(0)) when the loss can be computed from each shard's
    log-sum-exp: the weight split along that one dimension and whole along
    the others, a DTensor input, and no label smoothing of soft-capped
    logits (the mean of every capped logit needs a pass of its own)."""
    if not (checks.is_dtensor(weight) and checks.is_dtensor(input)) or (
            label_smoothing and softcap is not None):
        return None
    from torch.distributed.tensor import Replicate, Shard

    split = [i for i, p in enumerate(weight.placements) if p != Replicate()]
    if len(split) != 1 or weight.placements[split[0]] != Shard(0):
        return None
    if bias is not None and (not checks.is_dtensor(bias)
                             or tuple(bias.placements) != tuple(weight.placements)):
        return None  # (a plain bias beside a DTensor weight: DTensor refuses it, as for torch's)
    return split[0]


def _vocabulary_parallel(input, weight, target, bias, ignore_index, reduction, label_smoothing,
                         softcap, dim: int):
    """The loss over a weight split on the vocabulary along mesh dimension
    `dim` (a ColwiseParallel LM head), as torch's `loss_parallel` computes
    cross_entropy over vocabulary-split logits, without gathering the
    weight or the logits: each rank computes on its shard (`local_map`)
    every row's log-sum-exp, its target's logit where the target is one of
    its classes, and with label smoothing the sum of its logits; DTensor
    then gathers the log-sum-exps (one float per row and rank) and sums the
    rest (one float per row). loss = logsumexp over the ranks' log-sum-exps
    - (1 - eps) z_target - eps mean(z). The input's gradient is Partial over
    the ranks, the weight's stays split."""
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
    t32 = kernel_targets(t.reshape(-1), ignore_index, vocab)
    start = min(mesh.get_coordinate()[dim] * -(-vocab // mesh.size(dim)), vocab)  # torch.chunk's

    def shard_terms(x, w, b):
        lse = torch.ops.pallas.linear_logsumexp(x, w, b, softcap)
        mine = (t32 >= start) & (t32 < start + w.shape[0])
        rows = torch.where(mine, t32 - start, 0)
        z = (x.float() * w[rows].float()).sum(-1).to(x.dtype)  # as F.linear rounds
        if b is not None:
            z = z + b[rows]
        z = z.float()
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        terms = torch.where(mine, z, 0.0) * (1.0 - label_smoothing)
        if label_smoothing:
            total = x.float() @ w.float().sum(0) + (0.0 if b is None else b.float().sum())
            terms = terms + total * (label_smoothing / vocab)
        return lse.unsqueeze(0), terms

    weights = (split, split) if bias is not None else (split, None)
    stacked, terms = local_map(
        shard_terms, out_placements=(split, summed),
        in_placements=(whole, *weights), in_grad_placements=(summed, *weights),
        device_mesh=mesh)(x, weight, bias)
    lse = torch.logsumexp(stacked.redistribute(placements=whole), dim=0)
    valid = DTensor.from_local(t32 >= 0, mesh, whole, run_check=False)
    rows = torch.where(valid, lse - terms.redistribute(placements=whole), 0.0)
    if reduction == "none":
        return rows.reshape(target.shape)
    total = rows.sum()
    return total / valid.sum() if reduction == "mean" else total


# --- the composite, the public signature --------------------------------------

def linear_cross_entropy_implementation(input, weight, target, bias=None, *, ignore_index=-100,
                                        reduction="mean", label_smoothing=0.0, softcap=None):
    _check(input, weight, target, bias, ignore_index, reduction, label_smoothing, softcap)
    split = _vocabulary_split(input, weight, bias, label_smoothing, softcap)
    if split is not None:
        return _vocabulary_parallel(input, weight, target, bias, ignore_index, reduction,
                                    label_smoothing, softcap, split)
    hidden = input.shape[-1]
    grads = [torch.is_grad_enabled() and t is not None and t.requires_grad
             for t in (input, weight, bias)]
    shape, target = target.shape, target.reshape(-1)
    split_mean = reduction == "mean" and checks.is_dtensor(input)
    loss, *_ = torch.ops.pallas.linear_cross_entropy_forward(
        input.reshape(-1, hidden), weight, target, bias, ignore_index,
        "sum" if split_mean else reduction, label_smoothing, softcap, grads)
    if split_mean:  # over every rank's tokens (torch_pallas/distributed/cross_entropy.py)
        return loss / (target != ignore_index).sum()
    return loss.reshape(shape) if reduction == "none" else loss


registration.define_composite(
    "pallas::linear_cross_entropy",
    "(Tensor input, Tensor weight, Tensor target, Tensor? bias=None, *, "
    "int ignore_index=-100, str reduction=\"mean\", float label_smoothing=0.0, "
    "float? softcap=None) -> Tensor",
    linear_cross_entropy_implementation,
)


def linear_cross_entropy(input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, *, ignore_index: int = -100,
                         reduction: str = "mean", label_smoothing: float = 0.0,
                         softcap: float | None = None) -> torch.Tensor:
    """`F.cross_entropy(F.linear(input, weight, bias).float(), target, ...)`
    (with `softcap * tanh(z / softcap)` on the logits when `softcap` is
    set) without materialising the logits: rows in chunks, the gradients
    written during the forward. input (..., H), weight (V, H), target (...)
    int64; the loss in float32. Differentiable in input, weight and bias."""
    return torch.ops.pallas.linear_cross_entropy(
        input, weight, target, bias, ignore_index=ignore_index, reduction=reduction,
        label_smoothing=label_smoothing, softcap=softcap)


def linear_cross_entropy_backward(grad_loss, input, weight, target, bias, lse,
                                  ignore_index=-100, reduction="none", label_smoothing=0.0,
                                  softcap=None, grads=(True, True, True)):
    """The backward op on rows: (d_input, d_weight, d_bias) for the loss's
    gradient `grad_loss` (one per row for "none"), from the forward's lse;
    `grads` says which to compute (the others are empty)."""
    return torch.ops.pallas.linear_cross_entropy_backward(
        grad_loss, input, weight, target, bias, lse, ignore_index, reduction, label_smoothing,
        softcap, list(grads))


# --- references and examples -------------------------------------------------

def loss_of_logits(z, target, *, ignore_index=-100, reduction="mean", label_smoothing=0.0,
                   softcap=None):
    """The op's loss from its logits z (..., V), in z's dtype (float32 or
    float64), as torch computes it."""
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return torch.nn.functional.cross_entropy(
        z.reshape(-1, z.shape[-1]), target.reshape(-1), ignore_index=ignore_index,
        reduction=reduction, label_smoothing=label_smoothing,
    ).reshape(target.shape if reduction == "none" else ())


def torch_linear_cross_entropy(input, weight, target, bias=None, **kwargs):
    """torch's composition, which the op replaces (it holds the logits)."""
    return loss_of_logits(torch.nn.functional.linear(input, weight, bias).float(), target,
                          **kwargs)


def reference(input, weight, target, bias=None, **kwargs) -> torch.Tensor:
    """torch's composition in float64, the logits rounded to the input's
    dtype first, as F.linear rounds them."""
    z = torch.nn.functional.linear(*(t.detach().cpu().double() if t is not None else None
                                     for t in (input, weight, bias)))
    return loss_of_logits(z.to(input.dtype).double(), target.cpu(), **kwargs)


def error_bound(input, weight, ref) -> torch.Tensor:
    """float32 reductions over V logits, each a product rounded to the
    input's dtype (which the reference rounds too, so only the products'
    accumulation order differs)."""
    vocab, hidden = weight.shape
    scale = float(input.detach().abs().max()) * float(weight.detach().abs().max()) * hidden
    return (dtypes.ROUNDING[input.dtype] * 2 * scale + 2.0**-24 * vocab * 4) * (
        ref.abs() + 1) + 1e-5


def example_inputs(device, shape, vocab: int, dtype, has_bias: bool, requires_grad=False):
    """(x, weight, bias or None, target) of an example call: x `shape`
    (..., H), random classes with the second token ignored (-100)."""
    x = (torch.randn(shape, device=device) * 0.5).to(dtype).requires_grad_(requires_grad)
    w = torch.randn(vocab, shape[-1], device=device).to(dtype).requires_grad_(requires_grad)
    b = (torch.randn(vocab, device=device).to(dtype).requires_grad_(requires_grad)
         if has_bias else None)
    target = torch.randint(0, vocab, shape[:-1], device=device)
    target.view(-1)[1] = -100
    return x, w, b, target


def examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """A ragged bfloat16 call with a bias, an ignored row and label smoothing
    ("mean"), and a float32 one with a soft cap ("none")."""
    found = []
    cases = (((2, 7, 24), 83, torch.bfloat16, True, {"label_smoothing": 0.1}),
             ((9, 16), 300, torch.float32, False, {"reduction": "none", "softcap": 3.0}))
    for shape, vocab, dtype, has_bias, kwargs in cases:
        x, w, b, target = example_inputs(device, shape, vocab, dtype, has_bias,
                                          requires_grad)
        ref = reference(x, w, target, b, **kwargs)
        found.append(registry.Example((x, w, target, b), kwargs, ref,
                                      error_bound(x, w, ref)))
    return found


registry.register(registry.OpInfo(
    name="linear_cross_entropy",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.linear_cross_entropy",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.linear_cross_entropy",
        "triton": "torch_pallas.kernels.triton.linear_cross_entropy",
    },
    function=linear_cross_entropy,
    torch_function=torch_linear_cross_entropy,
    examples=examples,
))


def reference_gradients(grad_loss, input, weight, target, bias, lse, ignore_index=-100,
                        reduction="none", label_smoothing=0.0, softcap=None,
                        grads=(True, True, True)):
    """(d_input, d_weight, d_bias) in float64 (d_bias empty without a bias)."""
    leaves = [t.detach().cpu().double().requires_grad_() if t is not None else None
              for t in (input, weight, bias)]
    loss = torch_linear_cross_entropy(*leaves[:2], target.cpu(), leaves[2],
                                      ignore_index=ignore_index, reduction=reduction,
                                      label_smoothing=label_smoothing, softcap=softcap)
    wanted = [t for t in leaves if t is not None]
    found = list(torch.autograd.grad(loss, wanted, grad_loss.cpu().double()))
    if bias is None:
        found.append(torch.zeros(0, dtype=torch.float64))
    return tuple(found)


def backward_examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """The backward ("none": a gradient per row) of a ragged float16 call
    with a bias and an ignored row, and of a float32 one with label
    smoothing and a soft cap."""
    found = []
    cases = ((11, 20, 70, torch.float16, True, 0.0, None),
             (6, 12, 45, torch.float32, False, 0.2, 2.0))
    for rows, hidden, vocab, dtype, has_bias, smoothing, softcap in cases:
        x, w, b, target = example_inputs(device, (rows, hidden), vocab, dtype, has_bias)
        _, lse, *_ = torch.ops.pallas.linear_cross_entropy_forward(
            x, w, target, b, -100, "none", smoothing, softcap, [False] * 3)
        grad_loss = torch.randn(rows, device=device)
        args = (grad_loss, x, w, target, b, lse, -100, "none", smoothing, softcap, [True] * 3)
        expected = reference_gradients(*args)
        bounds = tuple((e.abs() + 1) * dtypes.ROUNDING[dtype] * 8 * (hidden + rows) ** 0.5
                       for e in expected)
        found.append(registry.Example(args, {}, expected, bounds))
    return found


registry.register(registry.OpInfo(
    name="linear_cross_entropy_backward",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.linear_cross_entropy_backward",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.linear_cross_entropy_backward",
        "triton": "torch_pallas.kernels.triton.linear_cross_entropy_backward",
    },
    function=linear_cross_entropy_backward,
    torch_function=reference_gradients,
    examples=backward_examples,
))
