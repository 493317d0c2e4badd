"""torch.ops.pallas.swiglu(gate, up): the SwiGLU gate of a gated MLP,
`F.silu(gate) * up`, fused (one pass forward, one backward, nothing saved
but the inputs), in float32, rounded once to the inputs' dtype.

`pallas::swiglu_backward(grad_out, gate, up) -> (d_gate, d_up)` recomputes
the sigmoid. gate and up must have one shape and one dtype, as a gated
MLP's two projections have (torch's composition would broadcast and
promote; this refuses instead, naming both).
"""

from __future__ import annotations

import torch

from torch_pallas.base import dtypes
from torch_pallas.library import registration
from torch_pallas.ops import checks
from torch_pallas.runtime import launch, registry

OP = "pallas::swiglu"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(gate, up):
    checks.tensor(OP, "gate", gate)
    checks.tensor(OP, "up", up)
    checks.dtype_in(OP, "gate", gate.dtype, DTYPES)
    checks.same_dtype(OP, gate, up, names=("gate", "up"))
    checks.same_device(OP, gate, up, names=("gate", "up"))
    if gate.shape != up.shape:
        raise ValueError(f"{OP}: gate.shape={tuple(gate.shape)} and up.shape={tuple(up.shape)} "
                         "must be equal (the two halves of a gated MLP's projection)")


def swiglu_implementation(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    _check(gate, up)
    if gate.numel() == 0:
        return gate.new_empty(gate.shape)
    return launch.run("swiglu", gate.device, (gate, up), {})


def swiglu_fake(gate, up):
    _check(gate, up)
    return gate.new_empty(gate.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad_out):
    gate, up = ctx.saved_tensors
    d_gate, d_up = torch.ops.pallas.swiglu_backward(grad_out, gate, up)
    return (d_gate if ctx.needs_input_grad[0] else None,
            d_up if ctx.needs_input_grad[1] else None)


registration.define(OP, swiglu_implementation, fake=swiglu_fake, backward=_backward,
                    setup_context=_setup_context)


def backward_implementation(grad_out: torch.Tensor, gate: torch.Tensor,
                            up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(gate, up)
    if gate.numel() == 0:
        return gate.new_zeros(gate.shape), up.new_zeros(up.shape)
    if grad_out.shape != gate.shape or grad_out.dtype != gate.dtype:
        raise ValueError(f"pallas::swiglu_backward: grad_out ({tuple(grad_out.shape)}, "
                         f"{grad_out.dtype}) must have gate's shape and dtype "
                         f"({tuple(gate.shape)}, {gate.dtype})")
    return launch.run("swiglu_backward", gate.device, (grad_out, gate, up), {})


def _backward_fake(grad_out, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


registration.define("pallas::swiglu_backward", backward_implementation, fake=_backward_fake)


# torch.ops.pallas.swiglu, skipping the dispatcher on plain eager calls.
_call = registration.direct_caller(torch.ops.pallas.swiglu.default)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up`, fused: float32 inside, rounded once;
    differentiable in both."""
    return _call(gate, up)


def swiglu_backward(grad_out, gate, up):
    """(d_gate, d_up) of swiglu, from its inputs."""
    return torch.ops.pallas.swiglu_backward(grad_out, gate, up)


def torch_swiglu(gate, up):
    """torch's own composition, which the op replaces."""
    return torch.nn.functional.silu(gate) * up


def reference(gate, up) -> torch.Tensor:
    return torch_swiglu(gate.double(), up.double())


def error_bound(gate, ref) -> torch.Tensor:
    """float32 arithmetic, then one rounding to the inputs' dtype."""
    return (dtypes.ROUNDING[gate.dtype] + 16 * 2.0**-24) * ref.abs() + 1e-7


def examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """A ragged bfloat16 call (an MLP's gate of 3 x 5 tokens, width 37) and a
    float32 one with large negative and positive gates."""
    found = []
    for shape, dtype, scale in (((3, 5, 37), torch.bfloat16, 1.0), ((129,), torch.float32, 20.0)):
        gate = (torch.randn(shape, device=device) * scale).to(dtype).requires_grad_(requires_grad)
        up = torch.randn(shape, device=device).to(dtype).requires_grad_(requires_grad)
        ref = reference(gate.detach().cpu(), up.detach().cpu())
        found.append(registry.Example((gate, up), {}, ref, error_bound(gate, ref)))
    return found


registry.register(registry.OpInfo(
    name="swiglu",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.swiglu",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.swiglu",
        "triton": "torch_pallas.kernels.triton.swiglu",
    },
    function=swiglu,
    torch_function=torch_swiglu,
    examples=examples,
))


def reference_gradients(grad_out, gate, up):
    """(d_gate, d_up) in float64."""
    gate64, up64 = (t.detach().cpu().double().requires_grad_() for t in (gate, up))
    return torch.autograd.grad(reference(gate64, up64), (gate64, up64), grad_out.cpu().double())


def backward_examples(device: torch.device, requires_grad: bool) -> list[registry.Example]:
    """The backward of a ragged float16 call and of a float32 one."""
    found = []
    for shape, dtype in (((7, 33), torch.float16), ((2, 3, 19), torch.float32)):
        gate, up, dy = (torch.randn(shape, device=device).to(dtype) for _ in range(3))
        d_gate, d_up = reference_gradients(dy, gate, up)
        found.append(registry.Example((dy, gate, up), {}, (d_gate, d_up),
                                      (error_bound(gate, d_gate) * 4, error_bound(gate, d_up) * 4)))
    return found


registry.register(registry.OpInfo(
    name="swiglu_backward",
    kernels={
        "tpu": "torch_pallas.kernels.tpu.swiglu_backward",
        "mosaic_gpu": "torch_pallas.kernels.mosaic_gpu.swiglu_backward",
        "triton": "torch_pallas.kernels.triton.swiglu_backward",
    },
    function=swiglu_backward,
    torch_function=reference_gradients,
    examples=backward_examples,
))
