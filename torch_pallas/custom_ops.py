"""`torch_pallas.custom_op`: any JAX function built on Pallas kernels as a
torch op. It builds the op's implementation, its fake function (from
`jax.eval_shape`: torch_pallas/shape_probing.py) and its autograd wiring from
the function and its annotations (torch_pallas/op_signature.py), and
registers them as the shipped ops are registered
(torch_pallas/registration.py).

    @torch_pallas.custom_op("mylib::scale")
    def scale(x: torch.Tensor, factor: float, interpret=None) -> torch.Tensor:
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * factor
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              interpret=interpret)(x)

    torch.ops.mylib.scale(torch.randn(8, 128), 2.0)

The function receives JAX arrays for its `torch.Tensor` parameters (shared
with torch through DLPack, no copy) and Python values for its int, float and
bool parameters, which are part of the compiled kernel's identity. A
parameter named `interpret` is not part of the op: it receives what the
backend needs (True for `interpret`, TPU or GPU interpret-mode parameters
for the simulators, None on a GPU), to pass on to `pl.pallas_call`,
`pl.kernel` or `plgpu.kernel`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from torch_pallas import backends, dtypes, launch, op_signature, registration, shape_probing


def custom_op(
    name: str,
    fn: Callable | None = None,
    /,
    *,
    backward: Callable | None = None,
    triton: Callable | None = None,
    flops: Callable | None = None,
):
    """Registers the JAX function `fn` (built on Pallas kernels) as the torch
    op `name` ("namespace::op") and returns it (its torch.ops packet, callable
    like the function).

    - Parameters annotated `torch.Tensor` take tensors (JAX arrays inside
      `fn`), `int`/`float`/`bool` ones take static values; the return is
      annotated `torch.Tensor` or `tuple[torch.Tensor, ...]`.
    - The fake function comes from `jax.eval_shape`, so torch.compile
      (fullgraph, dynamic shapes) and opcheck need nothing more.
    - `backward(*grad_outputs, *op_arguments)` returns one gradient (or None)
      per tensor parameter; it is typically another op registered here.
    - `triton(*op_arguments, wrap=...)`: a Triton implementation on torch
      tensors, used by the `triton` backend and traced by torch.compile on
      CUDA (launch kernels as `wrap(kernel)[grid](...)`).
    - `flops(*op_arguments, out_shape)`, with tensors given as their shapes:
      the FLOPs of a call, for `torch.utils.flop_counter.FlopCounterMode`.
    """
    if fn is None:
        return functools.partial(custom_op, name, backward=backward, triton=triton, flops=flops)
    sig = op_signature.Signature(name, fn)
    single = sig.outputs is None
    entry = op_signature.kernel_entry(sig, fn)

    def implementation(*args, **kwargs):
        tensors, statics = sig.split(args, kwargs)
        device = op_signature.check_tensors(name, sig, tensors)
        if triton is not None and _uses_triton(device):
            return triton(*args, **kwargs)
        if any(t.numel() == 0 for t in tensors):
            # Kernels rarely take empty blocks (a Pallas grid of 0 divides by
            # it); when every output is empty too there is nothing to run.
            avals = tuple((tuple(t.shape), dtypes.jax_name(t.dtype)) for t in tensors)
            types = shape_probing.output_types(name, entry, sig.outputs, avals, tuple(statics.items()))
            if all(math.prod(shape) == 0 for shape, _ in types):
                outs = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in types)
                return outs[0] if single else outs
        outs = launch.run(name, device, tuple(tensors), statics, user_function=entry)
        return outs if single or isinstance(outs, tuple) else (outs,)

    def fake(*args, **kwargs):
        tensors, statics = sig.split(args, kwargs)
        device = op_signature.check_tensors(name, sig, tensors)
        # An int torch.compile made symbolic is specialised (guarded): static
        # values are part of the kernel's identity.
        statics = {n: _concrete(v) for n, v in statics.items()}
        types = shape_probing.symbolic_output_shapes(name, entry, tensors, statics, sig.outputs)
        outs = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in types)
        return outs[0] if single else outs

    implementation.__signature__ = sig.op_signature()
    implementation.__name__ = fn.__name__
    schema = torch.library.infer_schema(implementation, mutates_args=())

    autograd = {}
    if backward is not None:
        autograd = dict(backward=_backward_for(sig, backward), setup_context=_save_inputs(sig))
    triton_traced = False
    if triton is not None:
        triton_traced = functools.partial(triton, wrap=torch.library.wrap_triton)

    return registration.define(name, implementation, fake=fake, schema=schema,
                               triton_traced=triton_traced, flops=flops, **autograd)


def _concrete(value):
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.SymFloat):
        return float(value)
    if isinstance(value, torch.SymBool):
        return bool(value)
    return value


def _uses_triton(device: torch.device) -> bool:
    return backends.select(device, "custom op").family == "triton"


def _save_inputs(sig: op_signature.Signature):
    def setup_context(ctx, inputs, output, keyword_only_inputs=None):
        # Every argument, defaults included (a call may omit them), in order.
        bound = sig.op_signature().bind(*inputs, **(keyword_only_inputs or {}))
        bound.apply_defaults()
        ctx.arguments = list(bound.arguments.values())
        ctx.save_for_backward(*[a for a in ctx.arguments if isinstance(a, torch.Tensor)])

    return setup_context


def _backward_for(sig: op_signature.Signature, backward: Callable):
    def op_backward(ctx, *grads):
        saved = iter(ctx.saved_tensors)
        arguments = [next(saved) if isinstance(a, torch.Tensor) else a for a in ctx.arguments]
        result = backward(*grads, *arguments)
        result = result if isinstance(result, (tuple, list)) else (result,)
        if len(result) != len(sig.tensors):
            raise TypeError(
                f"{sig.name}: the backward must return {len(sig.tensors)} gradients "
                f"(one per tensor parameter), got {len(result)}"
            )
        grads_by_name = dict(zip(sig.tensors, result))
        # One gradient per argument the dispatcher passed (it drops trailing
        # arguments equal to their defaults).
        names = list(sig.op_signature().parameters)[: len(ctx.needs_input_grad)]
        return tuple(
            grads_by_name.get(n) if ctx.needs_input_grad[i] else None
            for i, n in enumerate(names)
        )

    return op_backward
