"""torch.ops.pallas.rms_norm: `torch.nn.functional.rms_norm` on fused Pallas
kernels (and their Triton twins), forward and backward each one pass over
the rows.

Three ops, as attention's:
- `pallas::rms_norm(input, normalized_shape, weight=None, eps=None)`, F.rms_norm's
  signature and values: it checks its arguments, merges the normalized
  dimensions into one (nothing to do for the usual one) and calls the
  forward op; CompositeImplicitAutograd, so autograd, autocast,
  torch.compile and DTensor see the two ops below.
- `pallas::rms_norm_forward(x, weight, eps) -> (out, rstd)` on x (..., N):
  the forward kernel over its rows, keeping 1/rms per row (float32, shape
  (...)) for the backward. The leading dimensions stay as they are, so a
  DTensor sharded along any of them (the sequence, under torch's
  SequenceParallel) runs shard-local (torch_pallas/distributed).
- `pallas::rms_norm_backward(grad_out, x, rstd, weight) -> (dx, dw)`: one
  kernel for both gradients (dw empty without a weight).

As torch 2.13 computes it: x * rstd * weight in float32, rounded once to
the input's dtype, whatever the weight's (a float16 input with a float32
weight gives float16, a float32 input with a bfloat16 weight float32).
`eps` None is `torch.finfo(input.dtype).eps`.
"""

from __future__ import annotations

import math

import torch

from torch_pallas.base import dtypes
from torch_pallas.library import registration
from torch_pallas.ops import checks
from torch_pallas.runtime import launch, registry

OP = "pallas::rms_norm"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(input, normalized_shape, weight):
    checks.normalized(OP, input, normalized_shape, {"weight": weight}, DTYPES)


def rms_norm_implementation(input, normalized_shape, weight=None, eps=None):
    _check(input, normalized_shape, weight)
    eps = torch.finfo(input.dtype).eps if eps is None else float(eps)
    n = math.prod(normalized_shape)
    x = checks.merged_normalized(input, normalized_shape)
    out, _ = _forward(x, checks.flat(weight, n), eps)
    return checks.shaped(out, input.shape)


# --- the forward op, rows along the last dimension ---------------------------

def _forward_fake(x, weight, eps):
    return (x.new_empty(x.shape),
            x.new_empty(x.shape[:-1], dtype=torch.float32))


def forward_implementation(x: torch.Tensor, weight: torch.Tensor | None,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if x.numel() == 0:
        return _forward_fake(x, weight, eps)
    inputs = (x,) if weight is None else (x, weight)  # the kernels read x's rows themselves
    return launch.run("rms_norm", x.device, inputs, {"eps": float(eps)})


def _setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    _, rstd = output
    ctx.mark_non_differentiable(rstd)
    ctx.save_for_backward(x, weight, rstd)


def _backward(ctx, grad_out, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    if not any(ctx.needs_input_grad[:2]):
        return None, None, None
    dx, dw = torch.ops.pallas.rms_norm_backward(grad_out, x, rstd, weight)
    return (dx if ctx.needs_input_grad[0] else None,
            dw if ctx.needs_input_grad[1] else None, None)


registration.define(
    "pallas::rms_norm_forward", forward_implementation, fake=_forward_fake,
    backward=_backward, setup_context=_setup_context,
)
# torch.ops.pallas.rms_norm_forward, skipping the dispatcher on plain eager calls.
_forward = registration.direct_caller(torch.ops.pallas.rms_norm_forward.default)


# --- the backward op ---------------------------------------------------------

def _backward_fake(grad_out, x, rstd, weight):
    dw = (weight.new_empty(weight.shape) if weight is not None
          else x.new_empty((0,), dtype=torch.float32))
    return x.new_empty(x.shape), dw


def backward_implementation(grad_out: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor,
                            weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if x.numel() == 0:
        dx, dw = _backward_fake(grad_out, x, rstd, weight)
        return dx, dw.zero_()
    inputs = (checks.as_rows(grad_out), checks.as_rows(x), rstd.reshape(-1))
    inputs += () if weight is None else (weight,)
    dx, dw = launch.run("rms_norm_backward", x.device, inputs, {})
    return dx.view(x.shape), dw


registration.define(
    "pallas::rms_norm_backward", backward_implementation, fake=_backward_fake,
)

# --- the composite, F.rms_norm's signature -----------------------------------

registration.define_composite(
    "pallas::rms_norm",
    "(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, float? eps=None) "
    "-> Tensor",
    rms_norm_implementation,
)


# torch.ops.pallas.rms_norm, its implementation run straight on plain eager calls.
_call = registration.direct_caller(torch.ops.pallas.rms_norm.default)


def rms_norm(input: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
             eps: float | None = None) -> torch.Tensor:
    """`torch.nn.functional.rms_norm` on the Pallas kernels: same arguments,
    same values (float32 statistics), differentiable in input and weight."""
    if isinstance(normalized_shape, (int, torch.SymInt)):
        normalized_shape = (normalized_shape,)
    return _call(input, list(normalized_shape), weight, eps)


def rms_norm_backward(grad_out, x, rstd, weight=None):
    """The backward op, rows along the last dimension: (dx, dw) from the
    forward's rstd (dw empty without a weight)."""
    return torch.ops.pallas.rms_norm_backward(grad_out, x, rstd, weight)


# --- references and examples -------------------------------------------------

def reference(input, normalized_shape, weight=None, eps=None) -> torch.Tensor:
    """F.rms_norm in float64, with the eps the input's dtype implies."""
    eps = torch.finfo(input.dtype).eps if eps is None else eps
    return torch.nn.functional.rms_norm(
        input.double(), normalized_shape, None if weight is None else weight.double(), eps)


def error_bound(input, ref) -> torch.Tensor:
    """Elementwise bound on |pallas - ref|: float32 statistics over N
    elements, one rounding to the input's dtype."""
    n = ref.shape[-1] if ref.dim() else 1
    return (n * 2.0**-24 * 4 + dtypes.ROUNDING[input.dtype] * 2) * ref.abs() + 1e-6


def examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """Ragged rows and widths: a bfloat16 input with its weight over two
    normalized dimensions, and a float32 one without a weight."""
    found = []
    cases = (((3, 5, 2, 37), (2, 37), torch.bfloat16, True),
             ((7, 45), (45,), torch.float32, False))
    for shape, normalized, dtype, has_weight in cases:
        x = torch.randn(shape, device=device).to(dtype).requires_grad_(requires_grad)
        w = None
        if has_weight:
            w = (torch.rand(normalized, device=device) + 0.5).to(dtype)
            w.requires_grad_(requires_grad)
        ref = reference(x.detach().cpu(), normalized, None if w is None else w.detach().cpu())
        bound = error_bound(x.detach().cpu(), ref)
        found.append(registry.Example((x, list(normalized), w), {}, ref, bound))
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
    """The backward of a ragged float16 call with a weight, and of a float32
    one without."""
    found = []
    for rows, n, dtype, has_weight in ((11, 70, torch.float16, True), (4, 9, torch.float32, False)):
        x = torch.randn(rows, n, device=device).to(dtype)
        w = (torch.rand(n, device=device) + 0.5).to(dtype) if has_weight else None
        eps = torch.finfo(dtype).eps
        out, rstd = torch.ops.pallas.rms_norm_forward(x, w, eps)
        dy = torch.randn(out.shape, device=device).to(out.dtype)
        dx, dw = _reference_gradients(x, w, dy, eps)
        bound_dx = (dx.abs() + 1) * 8 * dtypes.ROUNDING[dtype] * math.sqrt(n)
        if w is None:
            expected, bounds = (dx, torch.zeros(0, dtype=torch.float64)), (bound_dx, 0.0)
        else:
            expected = (dx, dw)
            bounds = (bound_dx, (dw.abs() + 1) * 8 * dtypes.ROUNDING[dtype] * math.sqrt(rows))
        found.append(registry.Example((dy, x, rstd, w), {}, expected, bounds))
    return found


def _reference_gradients(x, w, dy, eps):
    x64 = x.detach().cpu().double().requires_grad_()
    w64 = None if w is None else w.detach().cpu().double().requires_grad_()
    out = torch.nn.functional.rms_norm(x64, (x.shape[-1],), w64, eps)
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
