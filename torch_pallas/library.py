"""Registering ops: the one mechanism behind every `torch.ops.pallas.*` op
and behind the public `torch_pallas.custom_op`, which turns any JAX function
built on Pallas kernels into a torch op.

`define` is the plumbing: a torch.library schema + implementation + fake
function + autograd + the torch.compile path on CUDA (the op's Triton
implementation traced into the graph). The shipped ops call it with their own
implementations; `custom_op` builds the implementation, the fake function
(from `jax.eval_shape`) and the autograd wiring from a JAX function.

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
import inspect
import math
import typing
from collections.abc import Callable, Sequence
from typing import Any, get_args, get_origin

import torch
from torch.autograd import forward_ad

from torch_pallas import dtypes, flop_counting, jax_env
from torch_pallas.compile_path import decompose_to_triton_on_cuda
from torch_pallas.launch import add_note, launch

STATIC_TYPES = (int, float, bool)


def define(
    name: str,
    implementation: Callable,
    *,
    fake: Callable,
    schema: str | None = None,
    backward: Callable | None = None,
    setup_context: Callable | None = None,
    jvp: Callable | None = None,
    compile_path: Callable | None = None,
    flops: Callable | None = None,
):
    """Registers op `name` ("namespace::op") and returns it (its
    torch.ops packet): the schema (inferred from `implementation`'s
    annotations unless given), `implementation` for every device, `fake` for
    tracing, the autograd formula (`backward`, `setup_context` as for
    `torch.library.register_autograd`; `jvp(inputs, tangents)` for
    forward-mode AD) and `compile_path`: what AOTAutograd
    traces on CUDA tensors, where kernels launch through
    `torch.library.wrap_triton` (None: the op stays one opaque call there too)
    and `flops(*input_shapes, out_shape)`, the FLOPs a call does, for
    FlopCounterMode (see flop_counting).

    This is what `torch.library.custom_op` registers, minus its per-call
    wrappers (a second autograd wrapper on calls that need no gradient,
    output checks for tagged in-place/out ops): those cost more than a small
    kernel, and every op here returns fresh tensors.
    """
    namespace, opname = name.split("::")
    if schema is None:
        schema = torch.library.infer_schema(implementation, mutates_args=())
    lib = _library(namespace)
    lib.define(opname + schema, tags=(torch.Tag.pt2_compliant_tag,))
    packet = getattr(getattr(torch.ops, namespace), opname)
    torch.library.register_fake(name, fake, lib=lib)
    # Dynamo must not trace into the kernel when an eager call happens inside
    # a compiled region (after a graph break): it is JAX code.
    kernel = torch._disable_dynamo(implementation)
    lib.impl(opname, kernel, "CompositeExplicitAutograd")
    lib.impl(opname, _autograd_kernel(packet.default, kernel, backward, setup_context, jvp),
             "Autograd", with_keyset=True)
    if compile_path is not None:
        decompose_to_triton_on_cuda(packet.default, compile_path, lib)
    if flops is not None:
        flop_counting.register(packet, flops)
    return packet


_libraries: dict[str, torch.library.Library] = {}


def _library(namespace: str) -> torch.library.Library:
    """The Library holding this package's registrations in `namespace`
    (kept alive: registrations end when their Library is collected)."""
    if namespace not in _libraries:
        _libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return _libraries[namespace]


# Dispatch key sets below autograd with nothing between autograd and a
# device's kernel (no subclass or mode, no functionalization), by device key.
_DEVICE_ONLY = {
    torch._C.DispatchKeySet(key).raw_repr(): key
    for key in (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)
}


def _autograd_kernel(op: torch._ops.OpOverload, device_kernel: Callable,
                     backward: Callable | None, setup_context: Callable | None,
                     jvp: Callable | None = None) -> Callable:
    """The op's Autograd kernel. A call that needs no gradient goes straight
    below autograd: to `device_kernel` (the op's CompositeExplicitAutograd
    kernel) when the dispatcher would go nowhere else (no mode, subclass or
    kernel registered for the device itself), saving a trip through it; one
    that needs a gradient, or has a forward-mode tangent, runs through an
    autograd.Function calling `setup_context` and `backward` as
    torch.library.register_autograd does (same ctx, same needs_input_grad),
    and `jvp(inputs, tangents)` for forward-mode AD (the tangent of the
    output; without it a tangent raises).

    Below autograd the op runs under AutoDispatchBelowADInplaceOrView, as
    torch's own autograd kernels do: a view an implementation returns (a
    reshape of the kernel's result) is a fresh output to autograd, which
    in-place ops may modify."""
    after_autograd = torch._C._after_autograd_keyset
    has_kernel_for = torch._C._dispatch_has_kernel_for_dispatch_key
    below_views = torch._C._AutoDispatchBelowADInplaceOrView
    name = op.name()

    def below_autograd(keyset, args, kwargs):
        with below_views():
            return op.redispatch(keyset & after_autograd, *args, **kwargs)

    def forward(ctx, *args_and_dispatch):
        *args, (keyset, kwargs) = args_and_dispatch
        result = below_autograd(keyset, args, kwargs)
        if setup_context is not None:
            # The dispatcher passes keyword-only arguments as kwargs.
            extra = {"keyword_only_inputs": kwargs} if kwargs else {}
            setup_context(ctx=ctx, inputs=tuple(args), output=result, **extra)
        if forward_ad._current_level >= 0:  # jvp may follow (at once): it needs the inputs
            ctx.primals = args
        return result

    def jvp_(ctx, *tangents):
        primals = ctx.primals
        del ctx.primals
        if jvp is None:
            raise RuntimeError(f"{name}: forward-mode AD (a tangent on an input) is not "
                               "implemented for this op")
        return jvp(tuple(primals), tangents[:-1])

    def backward_(ctx, *grads):
        if backward is None:
            raise RuntimeError(f"{op._name} has no backward: it cannot be differentiated")
        needs_input_grad = ctx.needs_input_grad
        ctx.needs_input_grad = needs_input_grad[:-1]  # the op's arguments only
        try:
            result = backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs_input_grad
        return (*result, None) if isinstance(result, tuple) else (result, None)

    function = type(f"Backward_{op._name.replace('::', '_')}", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward_),
                     "jvp": staticmethod(jvp_)})

    def kernel(keyset, *args, **kwargs):
        if ((torch.is_grad_enabled() and torch._C._any_requires_grad(*args))
                or (forward_ad._current_level >= 0 and _any_tangent(args))):
            if torch._C._are_functorch_transforms_active():
                # torch's own message names an autograd.Function the user never wrote.
                raise RuntimeError(
                    f"{name}: torch.func transforms (grad, vjp, jvp, jacrev, jacfwd, "
                    "vmap of a gradient) cannot differentiate this op; use "
                    "torch.autograd (backward, torch.autograd.grad, forward_ad) instead"
                )
            return function.apply(*args, (keyset, kwargs))
        device_key = _DEVICE_ONLY.get((keyset & after_autograd).raw_repr())
        if device_key is not None and not has_kernel_for(name, device_key):
            with below_views():
                return device_kernel(*args, **kwargs)
        return below_autograd(keyset, args, kwargs)

    return kernel


def _any_tangent(args) -> bool:
    return any(isinstance(a, torch.Tensor) and forward_ad.unpack_dual(a).tangent is not None
               for a in args)


class _Signature:
    """What an op's JAX function takes: tensors, static scalars, interpret."""

    def __init__(self, name: str, fn: Callable):
        self.name = name
        # Annotations resolved (they are strings under `from __future__ import annotations`).
        hints = typing.get_type_hints(fn)
        signature = inspect.signature(fn)
        self.signature = signature.replace(
            parameters=[p.replace(annotation=hints.get(p.name, p.annotation))
                        for p in signature.parameters.values()],
            return_annotation=hints.get("return", signature.return_annotation),
        )
        self.tensors: list[str] = []
        self.statics: list[str] = []
        self.takes_interpret = False
        for p in self.signature.parameters.values():
            if p.name == "interpret":
                self.takes_interpret = True
            elif p.annotation is torch.Tensor and p.kind is p.KEYWORD_ONLY:
                raise TypeError(
                    f"custom_op {name}: tensor parameter {p.name!r} is keyword-only; "
                    "make it positional"
                )
            elif p.annotation is torch.Tensor and p.default is not p.empty:
                raise TypeError(
                    f"custom_op {name}: tensor parameter {p.name!r} has a default "
                    f"({p.default!r}); tensor parameters take tensors only"
                )
            elif p.annotation is torch.Tensor:
                self.tensors.append(p.name)
            elif p.annotation in STATIC_TYPES:
                self.statics.append(p.name)
            else:
                raise TypeError(
                    f"custom_op {name}: parameter {p.name!r} must be annotated "
                    f"torch.Tensor, int, float or bool, got {p.annotation!r}"
                )
        if not self.tensors:
            raise TypeError(f"custom_op {name}: the function takes no torch.Tensor parameter")
        returns = self.signature.return_annotation
        if returns is torch.Tensor:
            self.outputs = None  # a single tensor
        elif get_origin(returns) in (tuple, Sequence) and all(
            a is torch.Tensor for a in get_args(returns)
        ):
            self.outputs = len(get_args(returns))
        else:
            raise TypeError(
                f"custom_op {name}: annotate the return as torch.Tensor or "
                f"tuple[torch.Tensor, ...], got {returns!r}"
            )

    def op_signature(self) -> inspect.Signature:
        """The torch op's signature: the function's, without `interpret`."""
        return self.signature.replace(
            parameters=[p for p in self.signature.parameters.values() if p.name != "interpret"]
        )

    def split(self, args, kwargs) -> tuple[list[torch.Tensor], dict[str, Any]]:
        bound = self.op_signature().bind(*args, **kwargs)
        bound.apply_defaults()
        tensors = [bound.arguments[n] for n in self.tensors]
        statics = {n: bound.arguments[n] for n in self.statics}
        return tensors, statics


def _check_tensors(name: str, sig: _Signature, tensors) -> torch.device:
    device = None
    for arg, t in zip(sig.tensors, tensors):
        if not isinstance(t, torch.Tensor):  # the dispatcher lets None through
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {t!r}")
        if t.layout != torch.strided:
            raise TypeError(f"{name}: {arg} must be a dense (strided) tensor, got layout {t.layout}")
        if t.dtype not in dtypes.JAX_NAMES:
            raise TypeError(
                f"{name}: {arg} has dtype {t.dtype}, which the JAX function cannot "
                f"receive exactly; supported: {dtypes.names(dtypes.JAX_NAMES)}"
            )
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(
                f"{name}: all tensors must be on one device, got {sig.tensors[0]} on "
                f"{device} and {arg} on {t.device}"
            )
    return device


@functools.lru_cache(maxsize=256)
def _output_types(name: str, fn: Callable, outputs, avals: tuple, statics: tuple):
    """[(shape, torch dtype)] of the outputs of `fn` (an op's `_kernel_entry`),
    by jax.eval_shape."""
    jax = jax_env.jax()
    jax_env.simulate_tpu_on_cpu()
    kwargs = dict(statics)
    if "interpret" in inspect.signature(fn).parameters:
        kwargs["interpret"] = True
    structs = [jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype)) for shape, dtype in avals]
    try:
        result = jax.eval_shape(functools.partial(fn, **kwargs), *structs)
    except Exception as e:
        add_note(e, f"{name}: tracing the JAX function for inputs {list(avals)} "
                    f"and parameters {dict(statics)}")
        raise
    return [(tuple(leaf.shape), _TORCH_DTYPES[str(leaf.dtype)])
            for leaf in ([result] if outputs is None else result)]


def _checked_outputs(name: str, outputs, result) -> list:
    """The JAX function's output arrays (or abstract arrays), after checking
    that there are as many as the op declares and each can cross to torch."""
    leaves = [result] if outputs is None else result
    if outputs is not None and (not isinstance(result, (tuple, list)) or len(result) != outputs):
        raise TypeError(f"{name}: the JAX function must return {outputs} arrays, got {result!r}")
    for i, leaf in enumerate(leaves):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(
                f"{name}: output {i} of the JAX function is {leaf!r}, not an array"
            )
        if str(leaf.dtype) not in _TORCH_DTYPES:
            raise TypeError(
                f"{name}: output {i} of the JAX function has dtype {leaf.dtype}, which "
                f"cannot cross to torch exactly; supported: {dtypes.names(dtypes.JAX_NAMES)}"
            )
    return leaves


def _kernel_entry(sig: _Signature, fn: Callable) -> Callable:
    """`fn` as launch and eval_shape call it: its tensor parameters (JAX
    arrays) by position, in the signature's order, everything else by name,
    wherever the function declares them; its outputs checked while it is
    traced (once per compiled kernel, not per call)."""
    @functools.wraps(fn)  # keeps the signature: `interpret` stays visible
    def entry(*arrays, **kwargs):
        result = fn(**dict(zip(sig.tensors, arrays)), **kwargs)
        _checked_outputs(sig.name, sig.outputs, result)
        return result

    return entry


_TORCH_DTYPES = {name: dtype for dtype, name in dtypes.JAX_NAMES.items()}


# The sizes a symbol takes in the probes of `_symbolic_output_shapes`, from
# its hint and a factor of its own: the first probe must trace; the others,
# which catch sizes rounded up (n + 1, small) or clamped (small, large), are
# skipped where the function refuses them (a kernel taking only multiples of
# its block refuses such sizes at run time too).
PROBE_SIZES = (
    lambda hint, factor: hint * factor,
    lambda hint, factor: hint * factor + 1,
    lambda hint, factor: factor,
    lambda hint, factor: hint * (factor + 1000),
)


def _symbolic_output_shapes(name, fn, tensors, statics, outputs):
    """Output shapes for (possibly symbolic) fake inputs. JAX cannot trace a
    Pallas kernel at symbolic sizes, so the function is probed: its output
    shapes are evaluated at the size hints and again at other sizes for every
    symbol (PROBE_SIZES). An output dimension that equals one symbol at every
    probe is that symbol; one that never moves is a constant. Any other size
    (2n, n - 1, rounded up, clamped), or a first probe that does not trace,
    specialises the sizes: the graph is guarded on them."""
    def concrete(d):
        if isinstance(d, torch.SymInt):
            hint = d.node.hint
            return int(hint) if hint is not None else int(d)
        return int(d)

    statics_key = tuple(statics.items())
    dtypes_ = [dtypes.jax_name(t.dtype) for t in tensors]
    hints = [tuple(concrete(d) for d in t.shape) for t in tensors]
    base = _output_types(name, fn, outputs, tuple(zip(hints, dtypes_)), statics_key)
    symbols: dict[str, tuple[torch.SymInt, int, int]] = {}  # expr -> (sym, hint, factor)
    for t in tensors:
        for d in t.shape:
            if isinstance(d, torch.SymInt) and str(d.node.expr) not in symbols:
                symbols[str(d.node.expr)] = (d, concrete(d), len(symbols) + 2)
    if not symbols:
        return base

    def specialised():
        for sym, _, _ in symbols.values():
            int(sym)  # guards the compiled graph on this size
        return base

    def probe(size):
        shapes = [
            tuple(size(*symbols[str(d.node.expr)][1:]) if isinstance(d, torch.SymInt) else h
                  for d, h in zip(t.shape, hint))
            for t, hint in zip(tensors, hints)
        ]
        return _output_types(name, fn, outputs, tuple(zip(shapes, dtypes_)), statics_key)

    sizes, outs = [], []  # the probes that traced, and their output types
    for i, size in enumerate(PROBE_SIZES):
        try:
            outs.append(probe(size))
            sizes.append(size)
        except Exception:  # sizes the function refuses
            if i == 0:
                return specialised()
    ranks = [len(shape) for shape, _ in base]
    if any([len(shape) for shape, _ in out] != ranks for out in outs):
        return specialised()
    # Each symbol's hint and the sizes it took in those probes.
    taken = [(sym, hint, [size(hint, factor) for size in sizes])
             for sym, hint, factor in symbols.values()]
    result = []
    for i, (shape, dtype) in enumerate(base):
        dims = []
        for j, d in enumerate(shape):
            moved = [out[i][0][j] for out in outs]
            follows = [sym for sym, hint, values in taken if d == hint and moved == values]
            if follows:
                dims.append(follows[0])
            elif all(m == d for m in moved):
                dims.append(d)
            else:
                return specialised()
        result.append((tuple(dims), dtype))
    return result


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
    sig = _Signature(name, fn)
    single = sig.outputs is None
    entry = _kernel_entry(sig, fn)

    def implementation(*args, **kwargs):
        tensors, statics = sig.split(args, kwargs)
        device = _check_tensors(name, sig, tensors)
        if triton is not None and _uses_triton(device):
            return triton(*args, **kwargs)
        if any(t.numel() == 0 for t in tensors):
            # Kernels rarely take empty blocks (a Pallas grid of 0 divides by
            # it); when every output is empty too there is nothing to run.
            avals = tuple((tuple(t.shape), dtypes.jax_name(t.dtype)) for t in tensors)
            types = _output_types(name, entry, sig.outputs, avals, tuple(statics.items()))
            if all(math.prod(shape) == 0 for shape, _ in types):
                outs = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in types)
                return outs[0] if single else outs
        outs = launch(name, device, tuple(tensors), statics, entry=entry)
        return outs if single or isinstance(outs, tuple) else (outs,)

    def fake(*args, **kwargs):
        tensors, statics = sig.split(args, kwargs)
        device = _check_tensors(name, sig, tensors)
        # An int torch.compile made symbolic is specialised (guarded): static
        # values are part of the kernel's identity.
        statics = {n: _concrete(v) for n, v in statics.items()}
        types = _symbolic_output_shapes(name, entry, tensors, statics, sig.outputs)
        outs = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in types)
        return outs[0] if single else outs

    implementation.__signature__ = sig.op_signature()
    implementation.__name__ = fn.__name__
    schema = torch.library.infer_schema(implementation, mutates_args=())

    autograd = {}
    if backward is not None:
        autograd = dict(backward=_backward_for(sig, backward), setup_context=_save_inputs(sig))
    compile_path = None
    if triton is not None:
        def compile_path(*args, **kwargs):
            return triton(*args, wrap=torch.library.wrap_triton, **kwargs)

    return define(name, implementation, fake=fake, schema=schema, compile_path=compile_path,
                  flops=flops, **autograd)


def _concrete(value):
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.SymFloat):
        return float(value)
    if isinstance(value, torch.SymBool):
        return bool(value)
    return value


def _uses_triton(device: torch.device) -> bool:
    from torch_pallas import backends

    return backends.select(device, "custom op").family == "triton"


def _save_inputs(sig: _Signature):
    def setup_context(ctx, inputs, output, keyword_only_inputs=None):
        # Every argument, defaults included (a call may omit them), in order.
        bound = sig.op_signature().bind(*inputs, **(keyword_only_inputs or {}))
        bound.apply_defaults()
        ctx.arguments = list(bound.arguments.values())
        ctx.save_for_backward(*[a for a in ctx.arguments if isinstance(a, torch.Tensor)])

    return setup_context


def _backward_for(sig: _Signature, backward: Callable):
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
