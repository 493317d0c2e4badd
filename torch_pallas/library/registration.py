"""Registering a torch op: the one mechanism behind every `torch.ops.pallas.*`
op and behind `torch_pallas.custom_op` (torch_pallas/custom_ops/__init__.py).

`define` registers a torch.library schema, the implementation for every
device, the fake function, autograd (its own Autograd kernel, below), the
torch.compile path on CUDA (the op's body traced with its Triton kernels:
torch_pallas/runtime/compile_path.py) and, optionally, a FLOP formula.
`register_autocast` casts an op's inputs as torch.autocast casts
torch.matmul's.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import torch
from torch.autograd import forward_ad

from torch_pallas.base import torch_compat
from torch_pallas.runtime import compile_path
from torch_pallas.library import flop_counting


def define(
    name: str,
    implementation: Callable,
    *,
    fake: Callable,
    schema: str | None = None,
    backward: Callable | None = None,
    setup_context: Callable | None = None,
    jvp: Callable | None = None,
    triton_traced: Callable | bool = True,
    flops: Callable | None = None,
):
    """Registers op `name` ("namespace::op") and returns it (its torch.ops
    packet).

    - `schema`: inferred from `implementation`'s annotations unless given;
    - `implementation`: the op for every device; `fake`: for tracing;
    - `backward`, `setup_context`: as for `torch.library.register_autograd`;
      `jvp(inputs, tangents)`: the output's tangent, for forward-mode AD;
    - `triton_traced`: what AOTAutograd traces on CUDA tensors, with kernels
      launched through `torch.library.wrap_triton`: True (the shipped ops)
      for the implementation itself, whose kernels are the Triton ones
      while it is traced; a function of the op's arguments (a custom op's
      Triton implementation); False: the op stays one opaque call there too;
    - `flops(*input_shapes, out_shape)`: the FLOPs of a call, for
      FlopCounterMode (see flop_counting).

    This is what `torch.library.custom_op` registers, minus its per-call
    wrappers (a second autograd wrapper on calls that need no gradient,
    output checks for tagged in-place/out ops): those cost more than a small
    kernel, and every op here returns fresh tensors.
    """
    namespace, opname = name.split("::")
    if schema is None:
        schema = torch.library.infer_schema(implementation, mutates_args=())
    lib = library(namespace)
    lib.define(opname + schema, tags=(torch.Tag.pt2_compliant_tag,))
    packet = getattr(getattr(torch.ops, namespace), opname)
    torch.library.register_fake(name, fake, lib=lib)
    # Dynamo must not trace into the kernel when an eager call happens inside
    # a compiled region (after a graph break): it is JAX code.
    kernel = _dynamo_kept_out(implementation)
    _kernels[name] = kernel
    if torch_compat.DISPATCH is not None:
        lib.impl(opname, kernel, "CompositeExplicitAutograd")
        lib.impl(opname, _autograd_kernel(packet.default, kernel, backward, setup_context, jvp),
                 "Autograd", with_keyset=True)
    else:  # the public path
        if backward is not None:
            torch.library.register_autograd(name, backward, setup_context=setup_context, lib=lib)
        # Its autograd wrapper drops a forward-mode tangent on an input that
        # does not require grad: refuse such calls rather than lose it.
        lib.impl(opname, _refusing_tangents(name, kernel), "CompositeExplicitAutograd")
    if triton_traced is not False:
        traced = implementation if triton_traced is True else triton_traced
        compile_path.decompose_to_triton(packet.default, traced, lib)
    if flops is not None:
        flop_counting.register(packet, flops)
    return packet


def _dynamo_kept_out(fn: Callable) -> Callable:
    """`fn`, which Dynamo must not trace (it is JAX code), called eagerly
    when a compiled region reaches it (torch.compiler.disable). Until
    something imports Dynamo no compiled region can exist, and `fn` runs as
    it is: wrapping it at once imported Dynamo at a process's first op call
    (1.4 s on the 2-core CPU). Nor while Dynamo's frame callback is unset
    (torch_compat.EAGER.frames_unwatched: no compiled function is running),
    where the wrapper would cost a small call 3 us (a process that imported
    transformers has imported Dynamo)."""
    disabled = None
    eager = torch_compat.EAGER
    unwatched = eager.frames_unwatched if eager is not None else lambda: False

    def call(*args, **kwargs):
        nonlocal disabled
        if "torch._dynamo" not in sys.modules or unwatched():
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    return functools.wraps(fn)(call)


_libraries: dict[str, torch.library.Library] = {}
_kernels: dict[str, Callable] = {}  # op name -> its kernel for every device
_composites: dict[str, Callable] = {}  # composite op name -> its implementation


def direct_caller(op) -> Callable:
    """A function calling `op` (a `define`d or `define_composite`d op's
    OpOverload) as `op(*args, **kwargs)` does, its tensors positional
    (keyword arguments are never tensors: a factory's dtype and device),
    which runs the op's kernel straight where `runs_directly(op)` allows
    it: a composite's implementation as the dispatcher would run it (above
    autograd), a defined op's kernel below autograd. Every other call goes
    through `op`; without torch's internals (torch_compat's eager_direct
    probe) this is `op` itself.

    It skips the dispatcher's boxing and the op's Autograd kernel: 8-10 us
    of a small call on the 2-core CPU (the checks cost ~2), which a decode
    step pays once per linear layer; 12 us more for a composite (a norm,
    attention) over its forward op, each call of a decode step."""
    direct = runs_directly(op)
    if direct is None:
        return op
    if op.name() in _composites:
        implementation = _composites[op.name()]

        def call_composite(*args, **kwargs):
            if not direct(*args, **kwargs):
                return op(*args, **kwargs)
            return implementation(*args, **kwargs)

        return call_composite
    kernel = _kernels[op.name()]
    below_views = torch_compat.EAGER.below_views

    def call(*args, **kwargs):
        if not direct(*args, **kwargs):  # Dynamo traces this branch alone (False while compiling)
            return op(*args, **kwargs)
        with below_views():
            return kernel(*args, **kwargs)

    return call


def runs_directly(op) -> Callable[..., bool] | None:
    """For a `define`d or `define_composite`d op's OpOverload, a predicate on
    a call's arguments: whether the dispatcher would hand `op(*args,
    **kwargs)` to nothing but the op's kernel, and hand it the arguments as
    they are, which a caller may then run straight (under
    torch_compat.EAGER.below_views, as the dispatcher would). That is a
    plain eager call needing no gradient, on
    CPU tensors (of type torch.Tensor or nn.Parameter, strided, with no
    conjugate or other extra dispatch key; inference tensors too) and
    values of the types the schema names (_DIRECT_KINDS: a factory's size,
    value, dtype and device, a CPU one), with nothing intercepting it (no
    Dynamo trace, and torch_compat.EAGER.unintercepted: no mode, functorch
    transform, autocast, JIT trace, profiler or forward-AD level) and no
    kernel registered for the CPU key itself. For a composite
    (`define_composite`) a call needing gradients is one too: the
    dispatcher runs its implementation above autograd either way. None
    without torch's internals (torch_compat's eager_direct probe): every
    call must go through `op`."""
    eager = torch_compat.EAGER
    name = op.name()
    if eager is None or name not in _kernels and name not in _composites:
        return None
    differentiates = name in _composites  # autograd records the implementation's ops
    plain, key_set = eager.plain_cpu_key_sets, eager.key_set
    unintercepted, has_cpu_kernel = eager.unintercepted, eager.has_cpu_kernel
    slots = _direct_slots(eager.argument_kinds(op))
    if slots is None:
        return None
    positional, keywords = slots
    plain_types, sequences = (torch.Tensor, torch.nn.Parameter), (tuple, list, torch.Size)
    compiling, grad_enabled, any_requires_grad = (torch.compiler.is_compiling, torch.is_grad_enabled,
                                                  eager.any_requires_grad)

    def direct(*args, **kwargs) -> bool:
        if compiling():  # first: what Dynamo traces is this branch alone
            return False
        if len(args) > len(positional):
            return False
        for a, taken in zip(args, positional):
            kind = type(a)
            if kind in plain_types:
                if TENSOR not in taken or key_set(a) not in plain:
                    return False
            elif kind not in taken and not (
                    INTS in taken and kind in sequences and all(type(s) is int for s in a)):
                return False
        for keyword, value in kwargs.items():
            if type(value) not in keywords.get(keyword, ()):
                return False
            if type(value) is torch.device and value.type != "cpu":
                return False  # a factory for another device: its kernel there, if any
        if not differentiates and grad_enabled() and any_requires_grad(*args):
            return False
        return unintercepted() and not has_cpu_kernel(name)

    return direct


# What a direct call may hand an op's kernel as it is, by schema kind, the
# dispatcher's conversions being no-ops on it: the Python types taken.
# Anything else (a number for a Tensor, a float for an int, a string for a
# Device) goes through the dispatcher, which converts or refuses it as it
# always has. TENSOR stands for a plain CPU tensor (the key set checked).
TENSOR = object()
_DIRECT_KINDS = {
    "TensorType": {TENSOR}, "IntType": {int}, "SymIntType": {int}, "FloatType": {float},
    "BoolType": {bool}, "NumberType": {int, float, bool}, "ScalarTypeType": {torch.dtype},
    "DeviceObjType": {torch.device}, "StringType": {str},
}
INTS = object()  # a tuple, list or torch.Size of ints


def _direct_slots(kinds) -> tuple[tuple, dict] | None:
    """(for each positional argument, for each keyword-only one by name)
    the types a direct call takes there (_DIRECT_KINDS), or None where an
    argument's kind is none of those."""
    positional, keywords = [], {}
    for name, keyword_only, kind in kinds:
        optional = kind.startswith("OptionalType/")
        kind = kind.removeprefix("OptionalType/")
        if kind in ("ListType/IntType", "ListType/SymIntType"):
            taken = {INTS}
        elif kind in _DIRECT_KINDS:
            taken = set(_DIRECT_KINDS[kind])
        else:
            return None
        if optional:
            taken.add(type(None))
        (keywords.__setitem__(name, frozenset(taken)) if keyword_only
         else positional.append(frozenset(taken)))
    return tuple(positional), keywords


def define_composite(name: str, schema: str, implementation: Callable):
    """Registers op `name` ("namespace::op", with `schema`, its arguments and
    results) as a composite of other ops: CompositeImplicitAutograd, so
    autograd, autocast and torch.compile see the ops `implementation` calls
    (the public signatures of attention and the training ops, over their
    forward and backward ops). Returns its torch.ops packet."""
    namespace, opname = name.split("::")
    lib = library(namespace)
    lib.define(opname + schema, tags=(torch.Tag.pt2_compliant_tag,))
    lib.impl(opname, implementation, "CompositeImplicitAutograd")
    _composites[name] = implementation
    return getattr(getattr(torch.ops, namespace), opname)


def library(namespace: str) -> torch.library.Library:
    """The Library holding this package's registrations in `namespace`
    (kept alive: registrations end when their Library is collected)."""
    if namespace not in _libraries:
        _libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return _libraries[namespace]


def _autograd_kernel(op, device_kernel: Callable, backward: Callable | None,
                     setup_context: Callable | None, jvp: Callable | None = None) -> Callable:
    """The Autograd kernel of `op` (an OpOverload). A call that needs no
    gradient goes straight below autograd: to `device_kernel` (the op's
    CompositeExplicitAutograd kernel) when the dispatcher would go nowhere
    else (no mode, subclass or kernel registered for the device itself),
    saving a trip through it; one that needs a gradient, or has a
    forward-mode tangent, runs through an autograd.Function calling
    `setup_context` and `backward` as torch.library.register_autograd does
    (same ctx, same needs_input_grad), and `jvp(inputs, tangents)` for
    forward-mode AD (the tangent of the output; without it a tangent
    raises).

    Below autograd the op runs under AutoDispatchBelowADInplaceOrView, as
    torch's own autograd kernels do: a view an implementation returns (a
    reshape of the kernel's result) is a fresh output to autograd, which
    in-place ops may modify."""
    dispatch = torch_compat.DISPATCH
    after_autograd = dispatch.after_autograd
    below_views = dispatch.below_views
    forward_ad_level = dispatch.forward_ad_level
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
        if forward_ad_level() >= 0:  # jvp may follow (at once): it needs the inputs
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
            raise RuntimeError(f"{name} has no backward: it cannot be differentiated")
        needs_input_grad = ctx.needs_input_grad
        ctx.needs_input_grad = needs_input_grad[:-1]  # the op's arguments only
        try:
            result = backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs_input_grad
        return (*result, None) if isinstance(result, tuple) else (result, None)

    function = type(f"Backward_{name.replace('::', '_')}", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(backward_),
                     "jvp": staticmethod(jvp_)})

    def kernel(keyset, *args, **kwargs):
        if ((torch.is_grad_enabled() and dispatch.any_requires_grad(*args))
                or (forward_ad_level() >= 0 and any_tangent(args))):
            if dispatch.functorch_active():
                # torch's own message names an autograd.Function the user never wrote.
                raise RuntimeError(
                    f"{name}: torch.func transforms (grad, vjp, jvp, jacrev, jacfwd, "
                    "vmap of a gradient) cannot differentiate this op; use "
                    "torch.autograd (backward, torch.autograd.grad, forward_ad) instead"
                )
            return function.apply(*args, (keyset, kwargs))
        device_key = dispatch.device_only.get((keyset & after_autograd).raw_repr())
        if device_key is not None and not dispatch.has_kernel_for(name, device_key):
            with below_views():
                return device_kernel(*args, **kwargs)
        return below_autograd(keyset, args, kwargs)

    return kernel


def _refusing_tangents(name: str, kernel: Callable) -> Callable:
    def refusing(*args, **kwargs):
        if any_tangent(args):
            raise RuntimeError(
                f"{name}: forward-mode AD needs torch's dispatcher internals, which this "
                f"torch lacks or {torch_compat.ENV_VAR} turned off (torch_compat 'autograd_kernel')"
            )
        return kernel(*args, **kwargs)

    return refusing


def any_tangent(args) -> bool:
    """Whether any of `args` carries a forward-mode AD tangent."""
    return any(isinstance(a, torch.Tensor) and forward_ad.unpack_dual(a).tangent is not None
               for a in args)


def register_autocast(name: str, cast_call: Callable, device_types=("cpu", "cuda")) -> None:
    """Under torch.autocast, op `name` ("namespace::op") runs
    `cast_call(device_type, *args)`, which casts the inputs as torch casts
    its own op, to the dtype autocast has at run time, and calls the op
    (autocast is off for that call). Where this torch has no way to register
    that, floating inputs are cast to the device's default autocast dtype
    (`torch.library.register_autocast`)."""
    namespace, opname = name.split("::")
    autocast = torch_compat.AUTOCAST
    for device_type in device_types:
        if autocast is None:
            torch.library.register_autocast(
                name, device_type, torch.get_autocast_dtype(device_type), lib=library(namespace)
            )
            continue
        key = autocast.key(device_type)

        def kernel(*args, _device_type=device_type, _key=key):
            with autocast.excluded(_key):
                return cast_call(_device_type, *args)

        library(namespace).impl(opname, kernel, key)
