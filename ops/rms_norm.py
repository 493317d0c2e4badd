"""torch.ops.pallas.rms_norm: `torch.nn.functional.rms_norm` on fused Pallas
kernels (and their Triton twins), forward and backward each one pass over
the rows.

Three ops, as attention's:
- `pallas::rms_norm(input, normalized_shape, weight=None, eps=None,
  casting_mode="none")`, F.rms_norm's signature and values (and the
  models' roundings): it checks its arguments, merges the normalized
  dimensions into one (nothing to do for the usual one) and calls the
  forward op; CompositeImplicitAutograd, so autograd, autocast,
  torch.compile and DTensor see the two ops below.
- `pallas::rms_norm_forward(x, weight, eps, casting_mode="none") -> (out,
  rstd)` on x (..., N): the forward kernel over its rows, keeping 1/rms
  per row (float32, shape (...)) for the backward. The leading dimensions
  stay as they are, so a DTensor sharded along any of them (the sequence,
  under torch's SequenceParallel) runs shard-local
  (torch_pallas/distributed).
- `pallas::rms_norm_backward(grad_out, x, rstd, weight, casting_mode="none")
  -> (dx, dw)`: one kernel for both gradients (dw empty without a weight).

`casting_mode` says where the result is rounded, inside the kernels (the
casting modes of Liger-Kernel; kernels/rms_norm_casting.py), with
n = x * rstd in float32:
- "none", torch 2.13's F.rms_norm: n * weight in float32, rounded once to
  the input's dtype, whatever the weight's (a float16 input with a float32
  weight gives float16, a float32 input with a bfloat16 weight float32);
- "llama", transformers' LlamaRMSNorm (and the many modules copied from
  it): `weight * n.to(input.dtype)`, n rounded to the input's dtype, then
  the product in promote_types(input, weight) (a bfloat16 input with a
  float32 weight gives float32); without a weight, n.to(input.dtype);
- "gemma", GemmaRMSNorm (Gemma, Gemma 2, Gemma 3): `(n * (1 + weight.float()))`
  rounded once to the input's dtype; a weight is required.
The backward takes the roundings as the identity, as autograd does (in
"llama", dw sums dy times the rounded n). `eps` None is
`torch.finfo(input.dtype).eps`.
"""

from __future__ import annotations

import math

import torch

from torch_pallas.base import dtypes
from torch_pallas.kernels.rms_norm_casting import Casting
from torch_pallas.library import registration
from torch_pallas.ops import checks
from torch_pallas.runtime import launch, registry

OP = "pallas::rms_norm"
FORWARD_OP = "pallas::rms_norm_forward"
BACKWARD_OP = "pallas::rms_norm_backward"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CASTINGS = {casting.value: casting for casting in Casting}  # casting_mode -> the kernels' enum


def casting_of(op: str, casting_mode, weight) -> Casting:
    """The kernels' Casting for an op's `casting_mode` (the one place the
    string is read), refusing any other value and GEMMA without a weight."""
    casting = CASTINGS.get(casting_mode) if isinstance(casting_mode, str) else None
    if casting is None:
        raise ValueError(f"{op}: casting_mode={casting_mode!r} is not a casting mode; "
                         f"choose one of {', '.join(map(repr, CASTINGS))}")
    if casting.offsets_weight and weight is None:
        raise ValueError(f"{op}: casting_mode={casting_mode!r} multiplies by (1 + weight) "
                         "and needs a weight; got weight=None")
    return casting


def _check(input, normalized_shape, weight, casting_mode):
    checks.normalized(OP, input, normalized_shape, {"weight": weight}, DTYPES)
    casting_of(OP, casting_mode, weight)


def rms_norm_implementation(input, normalized_shape, weight=None, eps=None, casting_mode="none"):
    _check(input, normalized_shape, weight, casting_mode)
    eps = torch.finfo(input.dtype).eps if eps is None else float(eps)
    n = math.prod(normalized_shape)
    x = checks.merged_normalized(input, normalized_shape)
    out, _ = _forward(x, checks.flat(weight, n), eps, casting_mode)
    return checks.shaped(out, input.shape)


# --- the forward op, rows along the last dimension ---------------------------

def _output_dtype(x, weight, casting: Casting) -> torch.dtype:
    return casting.output_dtype(x.dtype, None if weight is None else weight.dtype,
                                torch.promote_types)


def _forward_fake(x, weight, eps, casting_mode="none"):
    casting = casting_of(FORWARD_OP, casting_mode, weight)
    return (x.new_empty(x.shape, dtype=_output_dtype(x, weight, casting)),
            x.new_empty(x.shape[:-1], dtype=torch.float32))


def forward_implementation(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                           casting_mode: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    casting = casting_of(FORWARD_OP, casting_mode, weight)
    if x.numel() == 0:
        return _forward_fake(x, weight, eps, casting_mode)
    inputs = (x,) if weight is None else (x, weight)  # the kernels read x's rows themselves
    return launch.run("rms_norm", x.device, inputs, {"eps": float(eps), "casting": casting})


def _setup_context(ctx, inputs, output):
    # The dispatcher passes the arguments given: casting_mode may be absent.
    x, weight, _, casting_mode = (*inputs, *("none",)[len(inputs) - 3:])
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)
    ctx.params = (casting_mode, len(inputs))


def _backward(ctx, grad_out, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    casting_mode, num_inputs = ctx.params
    unused = (None,) * (num_inputs - 2)  # eps, casting_mode
    if not any(ctx.needs_input_grad[:2]):
        return (None, None) + unused
    dx, dw = torch.ops.pallas.rms_norm_backward(grad_out, x, rstd, weight, casting_mode)
    return (dx if ctx.needs_input_grad[0] else None,
            dw if ctx.needs_input_grad[1] else None) + unused


registration.define(
    FORWARD_OP, forward_implementation, fake=_forward_fake,
    backward=_backward, setup_context=_setup_context,
)
# torch.ops.pallas.rms_norm_forward, skipping the dispatcher on plain eager calls.
_forward = registration.direct_caller(torch.ops.pallas.rms_norm_forward.default)


# --- the backward op ---------------------------------------------------------

def _backward_fake(grad_out, x, rstd, weight, casting_mode="none"):
    casting_of(BACKWARD_OP, casting_mode, weight)
    dw = (weight.new_empty(weight.shape) if weight is not None
          else x.new_empty((0,), dtype=torch.float32))
    return x.new_empty(x.shape), dw


def backward_implementation(grad_out: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor,
                            weight: torch.Tensor | None, casting_mode: str = "none"
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    casting = casting_of(BACKWARD_OP, casting_mode, weight)
    if x.numel() == 0:
        dx, dw = _backward_fake(grad_out, x, rstd, weight, casting_mode)
        return dx, dw.zero_()
    inputs = (checks.as_rows(grad_out), checks.as_rows(x), rstd.reshape(-1))
    inputs += () if weight is None else (weight,)
    dx, dw = launch.run("rms_norm_backward", x.device, inputs, {"casting": casting})
    return dx.view(x.shape), dw


registration.define(
    BACKWARD_OP, backward_implementation, fake=_backward_fake,
)

# --- the composite, F.rms_norm's signature -----------------------------------

registration.define_composite(
    OP,
    "(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None, "
    "str casting_mode=\"none\") -> Tensor",
    rms_norm_implementation,
)


# torch.ops.pallas.rms_norm, its implementation run straight on plain eager calls.
_call = registration.direct_caller(torch.ops.pallas.rms_norm.default)


def rms_norm(input: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
             eps: float | None = None, *, casting_mode: str = "none") -> torch.Tensor:
    """`torch.nn.functional.rms_norm` on the Pallas kernels: same arguments,
    same values (float32 statistics), differentiable in input and weight.

    `casting_mode` rounds as a model's module does, inside the kernels:
    "none" (F.rms_norm: `x * rstd * weight` in float32, rounded once to the
    input's dtype), "llama" (LlamaRMSNorm: `weight * normed.to(input.dtype)`,
    in promote_types(input, weight)) or "gemma" (GemmaRMSNorm:
    `(normed * (1 + weight.float())).to(input.dtype)`; a weight is
    required), normed being `x * rstd` in float32."""
    if isinstance(normalized_shape, (int, torch.SymInt)):
        normalized_shape = (normalized_shape,)
    return _call(input, list(normalized_shape), weight, eps, casting_mode)


def rms_norm_backward(grad_out, x, rstd, weight=None, casting_mode="none"):
    """The backward op, rows along the last dimension: (dx, dw) from the
    forward's rstd (dw empty without a weight)."""
    return torch.ops.pallas.rms_norm_backward(grad_out, x, rstd, weight, casting_mode)


# --- references and examples -------------------------------------------------

def formula(x, normalized_shape, weight, eps, casting_mode="none", rounding_dtype=None):
    """The casting mode's formula in x's precision (float64 for the
    references): F.rms_norm, `weight * n` ("llama") or `n * (1 + weight)`
    ("gemma"), n normalized. With `rounding_dtype`, "llama"'s n is rounded to
    it in the value and not in the gradient, as autograd takes
    `n.to(input_dtype)` (dw then sums dy times the rounded n)."""
    casting = casting_of(OP, casting_mode, weight)
    if casting is Casting.NONE:
        return torch.nn.functional.rms_norm(x, normalized_shape, weight, eps)
    n = torch.nn.functional.rms_norm(x, normalized_shape, None, eps)
    if casting.rounds_normalized and rounding_dtype is not None:
        n = n + (n.to(rounding_dtype).to(n.dtype) - n).detach()
    if weight is None:
        return n
    return n * (1 + weight if casting.offsets_weight else weight)


def reference(input, normalized_shape, weight=None, eps=None, casting_mode="none") -> torch.Tensor:
    """The op in float64 (no rounding of n), with the eps the input's dtype
    implies."""
    eps = torch.finfo(input.dtype).eps if eps is None else eps
    return formula(input.double(), normalized_shape, None if weight is None else weight.double(),
                   eps, casting_mode)


def error_bound(input, ref) -> torch.Tensor:
    """Elementwise bound on |pallas - ref|: float32 statistics over N
    elements, one rounding to the input's dtype ("llama": n's to the
    input's, then the product's to a dtype as precise or more)."""
    n = ref.shape[-1] if ref.dim() else 1
    return (n * 2.0**-24 * 4 + dtypes.ROUNDING[input.dtype] * 2) * ref.abs() + 1e-6


def _example_weight(shape, dtype, casting_mode, device) -> torch.Tensor | None:
    """Random, about 1 (about 0 in "gemma", whose weight is an offset from
    one); None for no dtype."""
    if dtype is None:
        return None
    offset = -0.5 if casting_mode == "gemma" else 0.5
    return (torch.rand(shape, device=device) + offset).to(dtype)


def examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """Ragged rows and widths: a bfloat16 input with its weight over two
    normalized dimensions, a float32 one without a weight, and the models'
    casting modes: a float16 input with a bfloat16 weight in "llama" (a
    float32 output) and a bfloat16 one in "gemma" (its weight about 0)."""
    found = []
    cases = (((3, 5, 2, 37), (2, 37), torch.bfloat16, torch.bfloat16, "none"),
             ((7, 45), (45,), torch.float32, None, "none"),
             ((5, 33), (33,), torch.float16, torch.bfloat16, "llama"),
             ((2, 3, 19), (19,), torch.bfloat16, torch.bfloat16, "gemma"))
    for shape, normalized, dtype, weight_dtype, casting_mode in cases:
        x = torch.randn(shape, device=device).to(dtype).requires_grad_(requires_grad)
        w = _example_weight(normalized, weight_dtype, casting_mode, device)
        if w is not None:
            w.requires_grad_(requires_grad)
        ref = reference(x.detach().cpu(), normalized, None if w is None else w.detach().cpu(),
                        None, casting_mode)
        bound = error_bound(x.detach().cpu(), ref)
        kwargs = {} if casting_mode == "none" else {"casting_mode": casting_mode}
        found.append(registry.Example((x, list(normalized), w), kwargs, ref, bound))
    return found


registry.register(registry.OpInfo(
    name="rms_norm",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.rms_norm",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.rms_norm",
        "triton": "torch_pallas.kernels.triton.rms_norm",
    },
    function=rms_norm,
    torch_function=torch.nn.functional.rms_norm,
    examples=examples,
))


def backward_examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """The backward of a ragged float16 call with a weight, of a float32 one
    without, of a bfloat16 one with a float32 weight in "llama" (dy float32,
    as its output) and of a float16 one in "gemma"."""
    found = []
    cases = ((11, 70, torch.float16, torch.float16, "none"), (4, 9, torch.float32, None, "none"),
             (9, 40, torch.bfloat16, torch.float32, "llama"),
             (6, 21, torch.float16, torch.float16, "gemma"))
    for rows, n, dtype, weight_dtype, casting_mode in cases:
        x = torch.randn(rows, n, device=device).to(dtype)
        w = _example_weight(n, weight_dtype, casting_mode, device)
        eps = torch.finfo(dtype).eps
        out, rstd = torch.ops.pallas.rms_norm_forward(x, w, eps, casting_mode)
        dy = torch.randn(out.shape, device=device).to(out.dtype)
        dx, dw = _reference_gradients(x, w, dy, eps, casting_mode)
        bound_dx = (dx.abs() + 1) * 8 * dtypes.ROUNDING[dtype] * math.sqrt(n)
        if w is None:
            expected, bounds = (dx, torch.zeros(0, dtype=torch.float64)), (bound_dx, 0.0)
        else:
            expected = (dx, dw)
            rounding = max(dtypes.ROUNDING[dtype], dtypes.ROUNDING[w.dtype])
            bounds = (bound_dx, (dw.abs() + 1) * 8 * rounding * math.sqrt(rows))
        kwargs = {} if casting_mode == "none" else {"casting_mode": casting_mode}
        found.append(registry.Example((dy, x, rstd, w), kwargs, expected, bounds))
    return found


def _reference_gradients(x, w, dy, eps, casting_mode="none"):
    """(dx, dw) of the casting mode's formula in float64 (dw None without a
    weight), the roundings the identity as autograd's."""
    x64 = x.detach().cpu().double().requires_grad_()
    w64 = None if w is None else w.detach().cpu().double().requires_grad_()
    out = formula(x64, (x.shape[-1],), w64, eps, casting_mode, rounding_dtype=x.dtype)
    wanted = (x64,) if w64 is None else (x64, w64)
    grads = torch.autograd.grad(out, wanted, dy.cpu().double())
    return grads if w64 is not None else (grads[0], None)


registry.register(registry.OpInfo(
    name="rms_norm_backward",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.rms_norm_backward",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.rms_norm_backward",
        "triton": "torch_pallas.kernels.triton.rms_norm_backward",
    },
    function=rms_norm_backward,
    torch_function=_reference_gradients,
    examples=backward_examples,
))
