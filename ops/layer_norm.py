"""torch.ops.pallas.layer_norm: `torch.nn.functional.layer_norm` on fused
Pallas kernels (and their Triton twins), forward and backward each one
kernel over the rows.

As rms_norm's three ops:
- `pallas::layer_norm(input, normalized_shape, weight=None, bias=None,
  eps=1e-5)`, F.layer_norm's signature and values: checks, the normalized
  dimensions merged into one, a missing weight as ones and a missing bias
  as zeros (exact, and without gradients), then the forward op;
  CompositeImplicitAutograd.
- `pallas::layer_norm_forward(x, weight, bias, eps) -> (out, mean, rstd)` on
  x (..., N), keeping the row statistics (float32, shape (...)) for the
  backward; the leading dimensions as they are (see rms_norm.py).
- `pallas::layer_norm_backward(grad_out, x, mean, rstd, weight) -> (dx, dw,
  db)`: one kernel for all three gradients (dw and db float32, cast to the
  parameters' dtypes by the autograd formula).

Statistics and the affine map in float32, the output rounded once to the
input's dtype, as torch computes it; the variance is that of the centred
row, as torch's.
"""

from __future__ import annotations

import math

import torch

from torch_pallas.base import dtypes
from torch_pallas.library import registration
from torch_pallas.ops import checks
from torch_pallas.runtime import launch, registry

OP = "pallas::layer_norm"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(input, normalized_shape, weight, bias):
    checks.normalized(OP, input, normalized_shape, {"weight": weight, "bias": bias}, DTYPES)


def layer_norm_implementation(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    _check(input, normalized_shape, weight, bias)
    n = math.prod(normalized_shape)
    x = checks.merged_normalized(input, normalized_shape)
    weight = input.new_ones(n) if weight is None else checks.flat(weight, n)
    bias = input.new_zeros(n) if bias is None else checks.flat(bias, n)
    out, _, _ = _forward(x, weight, bias, float(eps))
    return checks.shaped(out, input.shape)


# --- the forward op, rows along the last dimension ---------------------------

def _forward_fake(x, weight, bias, eps):
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return x.new_empty(x.shape), stats, stats.new_empty(stats.shape)


def forward_implementation(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if x.numel() == 0:
        return _forward_fake(x, weight, bias, eps)
    # the kernels read x's rows themselves
    return launch.run("layer_norm", x.device, (x, weight, bias), {"eps": float(eps)})


def _setup_context(ctx, inputs, output):
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.bias_dtype = bias.dtype


def _backward(ctx, grad_out, _grad_mean, _grad_rstd):
    x, weight, mean, rstd = ctx.saved_tensors
    if not any(ctx.needs_input_grad[:3]):
        return None, None, None, None
    dx, dw, db = torch.ops.pallas.layer_norm_backward(grad_out, x, mean, rstd, weight)
    return (dx if ctx.needs_input_grad[0] else None,
            dw.to(weight.dtype) if ctx.needs_input_grad[1] else None,
            db.to(ctx.bias_dtype) if ctx.needs_input_grad[2] else None, None)


registration.define(
    "pallas::layer_norm_forward", forward_implementation, fake=_forward_fake,
    backward=_backward, setup_context=_setup_context,
)
# torch.ops.pallas.layer_norm_forward, skipping the dispatcher on plain eager calls.
_forward = registration.direct_caller(torch.ops.pallas.layer_norm_forward.default)


# --- the backward op ---------------------------------------------------------

def _backward_fake(grad_out, x, mean, rstd, weight):
    return (x.new_empty(x.shape), x.new_empty(weight.shape, dtype=torch.float32),
            x.new_empty(weight.shape, dtype=torch.float32))


def backward_implementation(grad_out: torch.Tensor, x: torch.Tensor, mean: torch.Tensor,
                            rstd: torch.Tensor, weight: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if x.numel() == 0:
        dx, dw, db = _backward_fake(grad_out, x, mean, rstd, weight)
        return dx, dw.zero_(), db.zero_()
    dx, dw, db = launch.run("layer_norm_backward", x.device,
                            (checks.as_rows(grad_out), checks.as_rows(x), mean.reshape(-1),
                             rstd.reshape(-1), weight), {})
    return dx.view(x.shape), dw, db


registration.define(
    "pallas::layer_norm_backward", backward_implementation, fake=_backward_fake,
)

# --- the composite, F.layer_norm's signature ---------------------------------

registration.define_composite(
    "pallas::layer_norm",
    "(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, "
    "Tensor? bias=None, float eps=1e-05) -> Tensor",
    layer_norm_implementation,
)


# torch.ops.pallas.layer_norm, its implementation run straight on plain eager calls.
_call = registration.direct_caller(torch.ops.pallas.layer_norm.default)


def layer_norm(input: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """`torch.nn.functional.layer_norm` on the Pallas kernels: same
    arguments, same values (float32 statistics), differentiable in input,
    weight and bias."""
    if isinstance(normalized_shape, (int, torch.SymInt)):
        normalized_shape = (normalized_shape,)
    return _call(input, list(normalized_shape), weight, bias, eps)


def layer_norm_backward(grad_out, x, mean, rstd, weight):
    """The backward op, rows along the last dimension: (dx, dw, db), dw and
    db in float32."""
    return torch.ops.pallas.layer_norm_backward(grad_out, x, mean, rstd, weight)


# --- references and examples -------------------------------------------------

def reference(input, normalized_shape, weight=None, bias=None, eps=1e-5) -> torch.Tensor:
    """F.layer_norm in float64."""
    return torch.nn.functional.layer_norm(
        input.double(), normalized_shape, None if weight is None else weight.double(),
        None if bias is None else bias.double(), eps)


def error_bound(input, ref, n: int) -> torch.Tensor:
    """Elementwise bound on |pallas - ref|: float32 statistics over n
    elements, one rounding to the input's dtype."""
    return (n * 2.0**-24 * 8 + dtypes.ROUNDING[input.dtype] * 2) * (ref.abs() + 1) + 1e-6


def examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """Ragged rows and widths: a bfloat16 input, offset far from zero, with
    weight and bias over two normalized dimensions, and a float32 one with a
    bias alone."""
    found = []
    cases = (((3, 5, 2, 37), (2, 37), torch.bfloat16, True, 20.0),
             ((7, 45), (45,), torch.float32, False, 0.0))
    for shape, normalized, dtype, has_weight, offset in cases:
        x = (torch.randn(shape, device=device) + offset).to(dtype).requires_grad_(requires_grad)
        w = None
        if has_weight:
            w = (torch.rand(normalized, device=device) + 0.5).to(dtype)
            w.requires_grad_(requires_grad)
        b = torch.randn(normalized, device=device).to(dtype).requires_grad_(requires_grad)
        ref = reference(x.detach().cpu(), normalized, None if w is None else w.detach().cpu(),
                        b.detach().cpu())
        bound = error_bound(x.detach().cpu(), ref, math.prod(normalized))
        found.append(registry.Example((x, list(normalized), w, b), {}, ref, bound))
    return found


registry.register(registry.OpInfo(
    name="layer_norm",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.layer_norm",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.layer_norm",
        "triton": "torch_pallas.kernels.triton.layer_norm",
    },
    function=layer_norm,
    torch_function=torch.nn.functional.layer_norm,
    examples=examples,
))


def reference_gradients(grad_out, x, weight, bias, eps):
    """(dx, dw, db) of F.layer_norm on rows, in float64."""
    x64, w64, b64 = (t.detach().cpu().double().requires_grad_() for t in (x, weight, bias))
    out = torch.nn.functional.layer_norm(x64, (x.shape[-1],), w64, b64, eps)
    return torch.autograd.grad(out, (x64, w64, b64), grad_out.cpu().double())


def backward_examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """The backward of a ragged float16 call and of a float32 one."""
    found = []
    for rows, n, dtype in ((11, 70, torch.float16), (4, 9, torch.float32)):
        x = torch.randn(rows, n, device=device).to(dtype)
        w = (torch.rand(n, device=device) + 0.5).to(dtype)
        b = torch.randn(n, device=device).to(dtype)
        _, mean, rstd = torch.ops.pallas.layer_norm_forward(x, w, b, 1e-5)
        dy = torch.randn(rows, n, device=device).to(dtype)
        expected = reference_gradients(dy, x, w, b, 1e-5)
        scale = 8 * dtypes.ROUNDING[dtype]
        bounds = ((expected[0].abs() + 1) * scale * math.sqrt(n),
                  (expected[1].abs() + 1) * scale * math.sqrt(rows),
                  (expected[2].abs() + 1) * scale * math.sqrt(rows))
        found.append(registry.Example((dy, x, mean, rstd, w), {}, expected, bounds))
    return found


registry.register(registry.OpInfo(
    name="layer_norm_backward",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.layer_norm_backward",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.layer_norm_backward",
        "triton": "torch_pallas.kernels.triton.layer_norm_backward",
    },
    function=layer_norm_backward,
    torch_function=reference_gradients,
    examples=backward_examples,
))
