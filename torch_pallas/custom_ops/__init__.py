"""`torch_pallas.custom_op`: any JAX function built on Pallas kernels as a
torch op, differentiable through JAX's own autodiff of the function.

    @torch_pallas.custom_op("mylib::scale")
    def scale(x: torch.Tensor, factor: float, interpret=None) -> torch.Tensor:
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * factor
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              interpret=interpret)(x)

    torch.ops.mylib.scale(torch.randn(8, 128), 2.0)

It builds the op's implementation, its fake function (from `jax.eval_shape`:
torch_pallas/custom_ops/shape_probing.py) and its autograd from the function and its
annotations (torch_pallas/custom_ops/op_signature.py says which annotations map to
what), and registers them as the shipped ops are registered
(torch_pallas/library/registration.py).

The function receives JAX arrays for its tensor parameters (shared with
torch through DLPack, no copy) and Python values for the rest, which are
part of the compiled kernel's identity. A parameter named `interpret` is
not part of the op: it receives what the backend needs (True for
`interpret`, TPU or GPU interpret-mode parameters for the simulators, None
on a GPU), to pass on to `pl.pallas_call`, `pl.kernel` or `plgpu.kernel`;
kernels called without `interpret=` (JAX's TPU flash attention) run under
JAX's interpret-mode context for the backend all the same.

The subpackage, on the runtime (`launch` runs the kernels; this module
hands it what a user's kernel needs beyond a shipped one: `_as_run_on`,
`_explain`) and on `library` (`registration.define`): `op_signature` maps
the function's annotations to a schema, `shape_probing` its output shapes,
`jax_autodiff` its gradients, `mosaic_gpu_pallas_call` simulates windowed
pallas_calls on the Mosaic GPU simulator, `kernel_advice` explains the
limits a user's kernel hits, `jaxpr_walk` walks traced functions for both.

Imports: `base`, `runtime` and `library`; neither the shipped ops nor the
integrations.

Gradients: without `backward=`, the op is `{op}`, which calls
`{op}__forward` (the function's outputs and, when a gradient is needed, the
residuals JAX's vjp keeps) and, in the backward, `{op}__backward` (the
inputs' cotangents from those residuals, the forward not run again):
torch_pallas/custom_ops/jax_autodiff.py.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from torch_pallas.base import dtypes, jax_env, torch_compat
from torch_pallas.base.errors import add_note
from torch_pallas.runtime import backends, launch
from torch_pallas.library import registration
from torch_pallas.custom_ops import (jax_autodiff, kernel_advice, mosaic_gpu_pallas_call,
                                     op_signature, shape_probing)

RESIDUALS = "jax_residuals"  # the forward op's flag: also return the vjp's residuals


def _as_run_on(function: Callable, backend: str) -> Callable:
    if backend == "mosaic_gpu_interpret":
        # Windowed pallas_calls run as Mosaic GPU runs them on a GPU.
        return mosaic_gpu_pallas_call.simulated(function)
    if backend == "mosaic_gpu" and not jax_env.pallas_call_lowers_for_mosaic_gpu():
        # JAX 0.11 on lowers only plgpu.kernel to Mosaic GPU: a pallas_call
        # written for it becomes the kernel JAX 0.10 lowered it to.
        return mosaic_gpu_pallas_call.for_hardware(function)
    return function


def _explain(error: BaseException, op: str, backend: str, user_function: Callable):
    takes = getattr(user_function, "takes_interpret", True)  # op_signature.Signature.entry
    return kernel_advice.explain(error, op=op, backend=backend, takes_interpret=takes)


launch.support_user_kernels(launch.UserKernelSupport(
    as_run_on=_as_run_on, explain=_explain, check=kernel_advice.check_grid))


def custom_op(
    name: str,
    fn: Callable | None = None,
    /,
    *,
    backward: Callable | None = None,
    differentiable: bool = True,
    triton: Callable | None = None,
    flops: Callable | None = None,
):
    """Registers the JAX function `fn` (built on Pallas kernels) as the torch
    op `name` ("namespace::op") and returns it, callable like the function
    (it passes static objects such as a config dataclass and nests tuple
    outputs as `fn` does; `torch.ops.namespace.op` takes the same
    arguments, returns the outputs flat).

    - Parameters: tensors (`torch.Tensor`, optionally `| None`), static
      values (int, float, bool, str, tuples of int/float/bool, torch.dtype,
      any hashable class), see torch_pallas/custom_ops/op_signature.py; the return is
      annotated `torch.Tensor` or a tuple of them (nested tuples allowed).
    - Gradients come from JAX's autodiff of `fn` (`jax.vjp`, which uses the
      kernels' `custom_vjp` rules; the residuals it keeps are saved, the
      forward is not run again); floating tensor inputs get gradients,
      integer and boolean ones none. A function JAX cannot differentiate
      raises when the backward runs. `differentiable=False`: no gradient
      (a backward raises at once; the forward traces nothing extra).
    - `backward(*grad_outputs, *op_arguments)`, when given, replaces JAX's
      autodiff: one gradient (or None) per tensor parameter; typically
      another op registered here. Its signature is checked now.
    - The fake function comes from `jax.eval_shape`, so torch.compile
      (fullgraph, dynamic shapes) and opcheck need nothing more.
    - `triton(*op_arguments, wrap=...)`: a Triton implementation on torch
      tensors, used by the `triton` backend and traced by torch.compile on
      CUDA (launch kernels as `wrap(kernel)[grid](...)`).
    - `flops(*op_arguments, out_shape)`, with tensors given as their shapes:
      the FLOPs of a call, for `torch.utils.flop_counter.FlopCounterMode`.
    """
    if fn is None:
        return functools.partial(custom_op, name, backward=backward, differentiable=differentiable,
                                 triton=triton, flops=flops)
    sig = op_signature.Signature(name, fn)
    if backward is not None:
        _check_backward(sig, backward)
        packet = _define_op(name, sig, fn, backward=backward, triton=triton, flops=flops)
    elif not differentiable:
        packet = _define_op(name, sig, fn, triton=triton, flops=flops)
    else:
        packet = _define_differentiable(name, sig, fn, triton=triton, flops=flops)
    return CustomOp(packet, sig)


class CustomOp:
    """What custom_op returns: the op, called with the function's own
    argument types (static objects and tuples as they are), its outputs
    nested as the function nests them. Everything else (`.default`,
    overloads) is the torch.ops packet's."""

    def __init__(self, packet, sig: op_signature.Signature):
        self._packet = packet
        self._sig = sig
        self.__signature__ = sig.op_signature()
        functools.update_wrapper(self, sig.signature, assigned=(), updated=())

    def __call__(self, *args, **kwargs):
        args, kwargs = self._sig.to_op(args, kwargs)
        return self._sig.nest(self._packet(*args, **kwargs))

    def __getattr__(self, name):
        return getattr(self._packet, name)

    def __repr__(self):
        return f"torch_pallas.custom_op({self._sig.name!r})"


class Call(NamedTuple):
    """One call's pieces, as the kernels take them."""

    device: torch.device
    present: tuple[str, ...]  # the tensor parameters given (optional ones may be None)
    inputs: tuple[torch.Tensor, ...]  # their tensors
    statics: dict[str, Any]  # as the function receives them
    x64: bool  # JAX's 64-bit mode for this kernel


def _call(name: str, sig: op_signature.Signature, args, kwargs) -> Call:
    tensors, statics = sig.split(args, kwargs)
    device = op_signature.check_tensors(name, sig, tensors)
    present = tuple(n for n, t in zip(sig.tensors, tensors) if t is not None)
    inputs = tuple(t for t in tensors if t is not None)
    x64 = dtypes.needs_x64(t.dtype for t in inputs) or any(
        isinstance(v, np.dtype) and v.itemsize == 8 and v.kind in "fiu" for v in statics.values()
    )
    return Call(device, present, inputs, statics, x64)


def _run(name: str, entry: Callable, call: Call, extra: dict | None = None) -> tuple:
    """The outputs (a tuple of tensors) of `entry` on the call's backend."""
    statics = {**call.statics, **(extra or {})}
    if any(t.numel() == 0 for t in call.inputs):
        # Kernels rarely take empty blocks (a Pallas grid of 0 divides by
        # it); when every output is empty too there is nothing to run.
        types = _output_types(name, entry, call, statics, call.inputs)
        if all(math.prod(shape) == 0 for shape, _ in types):
            return tuple(torch.empty(shape, dtype=dtype, device=call.device) for shape, dtype in types)
    return launch.run(name, call.device, call.inputs, statics, user_function=entry, x64=call.x64)


def _output_types(name, entry, call: Call, statics, tensors, symbolic=False):
    """[(shape, dtype)] of the outputs, traced with the `interpret` the run
    would pass."""
    statics = {**statics, op_signature.INTERPRET: launch.user_interpret(call.device, name)}
    with jax_env.x64_scope(call.x64):
        if symbolic:
            return shape_probing.symbolic_output_shapes(name, entry, tensors, statics)
        avals = tuple((tuple(t.shape), dtypes.jax_name(t.dtype)) for t in tensors)
        return shape_probing.output_types(name, entry, avals, tuple(statics.items()))


def _fake(name, entry, call: Call, extra: dict | None = None) -> list[torch.Tensor]:
    types = _output_types(name, entry, call, {**call.statics, **(extra or {})}, call.inputs,
                          symbolic=True)
    return [torch.empty(shape, dtype=dtype, device=call.device) for shape, dtype in types]


def _uses_triton(device: torch.device) -> bool:
    return backends.select(device, "custom op").family == "triton"


# -- an op with its own backward (or none) ----------------------------------

def _define_op(name, sig, fn, *, backward=None, triton=None, flops=None):
    def implementation(*args, **kwargs):
        call = _call(name, sig, args, kwargs)
        if triton is not None and _uses_triton(call.device):
            return _as_promised(triton(*args, **kwargs))
        outs = _run(name, sig.entry(fn, call.present), call)
        return outs[0] if sig.single else outs

    def fake(*args, **kwargs):
        call = _call(name, sig, args, kwargs)
        outs = _fake(name, sig.entry(fn, call.present), call)
        return outs[0] if sig.single else tuple(outs)

    autograd = {}
    if backward is not None:
        autograd = dict(backward=_backward_for(sig, backward), setup_context=_save_inputs(sig))
    return registration.define(
        name, _named(implementation, fn), fake=fake,
        schema=sig.schema_arguments() + " -> " + sig.return_schema(),
        triton_traced=_triton_traced(triton), flops=flops, **autograd,
    )


def _as_promised(outs):
    """A user's Triton implementation's outputs in the layout the op's fake
    promises, which is what its JAX function's outputs have: row-major
    (a compiled graph checks the strides a fake promised)."""
    if isinstance(outs, (tuple, list)):
        return type(outs)(o.contiguous() for o in outs)
    return outs.contiguous()


def _named(implementation, fn):
    implementation.__name__ = fn.__name__
    implementation.__qualname__ = fn.__qualname__
    return implementation


def _triton_traced(triton):
    return False if triton is None else functools.partial(triton, wrap=torch_compat.wrap_triton)


def _check_backward(sig: op_signature.Signature, backward: Callable) -> None:
    """A backward that cannot take (*grad_outputs, *op_arguments) fails now,
    not when a gradient is first asked for."""
    count = sig.outputs + len(sig.params)
    schema = getattr(getattr(backward, "default", None), "_schema", None)
    if schema is not None:  # a torch op
        arguments = [a for a in schema.arguments if not a.kwarg_only]
        required = sum(1 for a in arguments if not a.has_default_value())
        fits = required <= count <= len(arguments)
        described = str(schema)
    else:
        try:
            target = inspect.signature(backward)
        except (TypeError, ValueError):  # a builtin without a signature: trust it
            return
        try:
            target.bind(*range(count))
            fits = True
        except TypeError:
            fits = False
        described = f"{getattr(backward, '__name__', backward)}{target}"
    if not fits:
        names = ", ".join(p.name for p in sig.params)
        raise TypeError(
            f"custom_op {sig.name}: backward must take {sig.outputs} output gradient(s), then "
            f"the op's {len(sig.params)} arguments ({names}); it is {described}"
        )


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
        return _per_argument(sig, ctx.needs_input_grad, dict(zip(sig.tensors, result)))

    return op_backward


def _per_argument(sig, needs_input_grad, grads_by_name):
    """One gradient per argument the dispatcher passed (it drops trailing
    arguments equal to their defaults)."""
    names = list(sig.op_signature().parameters)[: len(needs_input_grad)]
    return tuple(grads_by_name.get(n) if needs_input_grad[i] else None
                 for i, n in enumerate(names))


# -- an op differentiated by JAX ---------------------------------------------

def _define_differentiable(name, sig, fn, *, triton=None, flops=None):
    """`name` (CompositeImplicitAutograd) on `name__forward` and
    `name__backward`, with the autograd of `_JaxGradient`."""
    forward_name, backward_name = f"{name}__forward", f"{name}__backward"
    if RESIDUALS in sig.signature.parameters:
        raise TypeError(f"custom_op {name}: parameter name {RESIDUALS!r} is reserved")
    failures: dict = {}  # calls whose vjp JAX could not trace: why

    def forward(*args, jax_residuals=False, **kwargs):
        call = _call(name, sig, args, kwargs)
        if triton is not None and _uses_triton(call.device):
            if jax_residuals:
                raise NotImplementedError(
                    f"{name}: on the triton backend the op runs its Triton implementation, "
                    "which JAX cannot differentiate; give custom_op a backward="
                )
            outs = _as_promised(triton(*args, **kwargs))
            return list(outs) if isinstance(outs, (tuple, list)) else [outs]
        entry = sig.entry(fn, call.present)
        if jax_residuals:
            key = _key(sig, args, kwargs)
            if key not in failures:
                try:
                    return list(_run(name, jax_autodiff.forward_entry(entry), call))
                except Exception as e:  # JAX cannot linearize it: the backward will say so
                    outs = list(_run(name, entry, call))  # raises if the function itself fails
                    failures[key] = f"{type(e).__name__}: {e}"
                    return outs
        return list(_run(name, entry, call))

    def forward_fake(*args, jax_residuals=False, **kwargs):
        call = _call(name, sig, args, kwargs)
        entry = sig.entry(fn, call.present)
        if jax_residuals:
            try:
                return _fake(name, jax_autodiff.forward_entry(entry), call)
            except Exception:  # as the forward: outputs only
                pass
        return _fake(name, entry, call)

    def backward(*args, outputs, residuals, cotangents, wanted, **kwargs):
        call = _call(name, sig, args, kwargs)
        entry = sig.entry(fn, call.present)
        grads = [t for t, w in zip(_differentiable(call.inputs), wanted) if w]
        if any(t.numel() == 0 for t in grads) and all(t.numel() == 0 for t in grads):
            return [torch.zeros_like(t) for t in grads]
        backward_entry = jax_autodiff.backward_entry(entry, len(call.inputs), sig.outputs)
        saved = Call(call.device, call.present, (*call.inputs, *outputs, *residuals, *cotangents),
                     call.statics, call.x64)
        try:
            return list(_run(name, backward_entry, saved,
                             {"n_residuals": len(residuals), "wanted": tuple(wanted)}))
        except Exception as e:
            add_note(e, f"{name}: computing its gradient by JAX's autodiff of the function "
                        "(jax.vjp); a kernel JAX cannot differentiate needs a jax.custom_vjp, or "
                        "custom_op(..., backward=...)")
            raise

    def backward_fake(*args, outputs, residuals, cotangents, wanted, **kwargs):
        call = _call(name, sig, args, kwargs)
        # Contiguous, as the kernel's outputs are (empty_like would keep an input's strides).
        return [torch.empty(t.shape, dtype=t.dtype, device=t.device)
                for t, w in zip(_differentiable(call.inputs), wanted) if w]

    extra = [f"bool {RESIDUALS}=False"]
    forward_packet = registration.define(
        forward_name, _named(forward, fn), fake=forward_fake,
        schema=sig.schema_arguments(extra_keyword=extra) + " -> Tensor[]",
        triton_traced=False if triton is None else _listed(_triton_traced(triton)),
        flops=_first_outputs(sig, flops),
    )
    backward_packet = registration.define(
        backward_name, backward, fake=backward_fake,
        schema=sig.schema_arguments(extra_keyword=[
            "Tensor[] outputs", "Tensor[] residuals", "Tensor[] cotangents", "bool[] wanted",
        ]) + " -> Tensor[]",
        triton_traced=False,
    )
    gradient = _jax_gradient(name, sig, forward_packet, backward_packet, failures)

    def implementation(*args, **kwargs):
        tensors = [t for t in sig.split(args, kwargs, tensors_only=True) if t is not None]
        if registration.any_tangent(tensors):
            raise RuntimeError(f"{name}: forward-mode AD (a tangent on an input) is not "
                               "implemented for ops differentiated by JAX; use reverse mode "
                               "(backward, torch.autograd.grad)")
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            outs = gradient(args, kwargs)
        else:
            outs = forward_packet(*args, **kwargs)
        return outs[0] if sig.single else tuple(outs[: sig.outputs])

    namespace, opname = name.split("::")
    lib = registration.library(namespace)
    lib.define(opname + sig.schema_arguments() + " -> " + sig.return_schema(),
               tags=(torch.Tag.pt2_compliant_tag,))
    lib.impl(opname, _named(implementation, fn), "CompositeImplicitAutograd")
    return getattr(getattr(torch.ops, namespace), opname)


def _listed(triton):
    """A Triton implementation as the forward op returns its outputs: a list
    (no residuals: the backward of a Triton implementation is not JAX's)."""
    def traced(*args, jax_residuals=False, **kwargs):
        outs = triton(*args, **kwargs)
        return list(outs) if isinstance(outs, (tuple, list)) else [outs]

    return traced


def _first_outputs(sig, flops):
    """The user's FLOP formula for the forward op, which also takes the
    residual flag and returns the residuals after the outputs."""
    if flops is None:
        return None

    def formula(*args, out_shape, jax_residuals=False, **kwargs):
        shape = out_shape[0] if sig.single else tuple(out_shape[: sig.outputs])
        return flops(*args, out_shape=shape, **kwargs)

    return formula


def _differentiable(inputs):
    return [t for t in inputs if t.dtype.is_floating_point]


def _jax_gradient(name, sig, forward_packet, backward_packet, failures):
    """Runs the forward op with residuals under an autograd.Function whose
    backward is the backward op."""
    outputs = sig.outputs

    class JaxGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, arguments, *tensors):
            args, kwargs = sig.call_parts(sig.with_tensors(arguments, tensors))
            result = forward_packet(*args, **kwargs, jax_residuals=True)
            outs, residuals = result[:outputs], result[outputs:]
            ctx.arguments = arguments  # without its tensors: those are saved
            ctx.counts = (len(tensors), len(outs))
            ctx.failed = bool(failures) and not residuals and _failure(failures, sig, args, kwargs)
            ctx.save_for_backward(*tensors, *outs, *residuals)
            ctx.mark_non_differentiable(*[o for o in outs if not o.dtype.is_floating_point])
            return tuple(outs)

        @staticmethod
        def backward(ctx, *grads):
            n_tensors, n_outs = ctx.counts
            saved = ctx.saved_tensors
            tensors = saved[:n_tensors]
            outs, residuals = saved[n_tensors:n_tensors + n_outs], saved[n_tensors + n_outs:]
            if ctx.failed:
                raise RuntimeError(
                    f"{name}: JAX cannot differentiate the function ({ctx.failed}); give the "
                    "kernel a jax.custom_vjp, or custom_op(..., backward=...)"
                )
            floating = [i for i, t in enumerate(tensors) if t.dtype.is_floating_point]
            wanted = [ctx.needs_input_grad[1 + i] for i in floating]
            result = [None] * n_tensors
            if any(wanted):
                cotangents = [g if g is not None else torch.zeros_like(o)
                              for g, o in zip(grads, outs) if o.dtype.is_floating_point]
                args, kwargs = sig.call_parts(sig.with_tensors(ctx.arguments, tensors))
                computed = iter(backward_packet(*args, **kwargs, outputs=list(outs),
                                                residuals=list(residuals),
                                                cotangents=cotangents, wanted=wanted))
                for i, w in zip(floating, wanted):
                    if w:
                        result[i] = next(computed)
            return (None, *result)

    def apply(args, kwargs):
        # The tensors as the Function's own inputs (autograd tracks them),
        # the rest by name.
        arguments = sig.bind(args, kwargs)
        tensors = [arguments[n] for n in sig.tensors if arguments[n] is not None]
        return JaxGradient.apply(sig.with_tensors(arguments, None), *tensors)

    return apply


def _failure(failures, sig, args, kwargs):
    """Why JAX could not linearize this call, if it could not (False)."""
    try:
        return failures.get(_key(sig, args, kwargs), False)
    except TypeError:  # symbolic sizes (a traced call): the backward op reports it
        return False


def _key(sig, args, kwargs):
    """A call's identity for the record of vjps JAX could not trace."""
    tensors, statics = sig.split(args, kwargs)
    return (tuple(n for n, t in zip(sig.tensors, tensors) if t is not None),
            launch.static_key(statics),
            tuple((t.shape, t.dtype) for t in tensors if t is not None))
