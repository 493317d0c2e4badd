"""torch's private API, in one place.

torch_pallas uses a few private torch names where the public API costs
more than a small kernel or lacks a feature; nothing else in the package
touches `torch._C`, `torch._subclasses` or the
internals of autograd and SymInt. Each is probed once, when torch_pallas is
imported, and where it is missing (another torch) the public path takes its
place:

===================  =================================  ====================================
probe                private path                       public fallback
===================  =================================  ====================================
``autograd_kernel``  the op's own Autograd kernel      ``torch.library.register_autograd``
                     (dispatch key sets, below-views    (every call goes through autograd's
                     guard, forward-AD level): calls    wrapper; no forward-mode AD)
                     needing no gradient skip autograd
``autocast_kernel``  an Autocast kernel casting to the  ``torch.library.register_autocast``
                     dtype autocast has at run time     with the device's default autocast
                                                        dtype
``tracing_types``    FakeTensor, FunctionalTensor,      none: under torch.compile on CUDA the
                     FunctionalTensorMode (the          ops stay opaque calls
                     torch.compile path on CUDA)
``symint_hint``      ``SymInt.node.hint``: a symbolic   ``int(size)``: the size is
                     size's example value               specialised (the graph is guarded)
``eager_direct``     tensors' dispatch key sets, mode   none: every call goes through the
                     stacks, functorch, tracer and      dispatcher
                     profiler state: a plain eager
                     call runs the op's kernel straight
``fp32_precision``   the float32 precision settings'    ``torch.backends.cuda.matmul`` and
                     C getters (read by every eager     ``torch.backends`` attributes
                     matmul call's plan key)
``sharding_key``     DTensor's record of what an op's   none: the op gets no sharding rule
                     cached sharding decisions are      (DTensor refuses it by name) where
                     keyed on (``register_sharding``    its decisions need keys that
                     keys on int arguments only)        ``register_sharding`` leaves out
``device_dispatch``  PrivateUse1's name, and a          the name by parsing it as a device;
                     device's dispatch key set (a       no such kernel: fill and iota for
                     factory op's BackendSelect         torch_tpu's device are refused by
                     kernel, torch_pallas.torch_tpu)    their CPU kernels
===================  =================================  ====================================

`TORCH_PALLAS_PUBLIC_API` (probe names, comma-separated, or ``all``), set
before torch_pallas is imported, takes the public path for those probes:
tests/test_torch_compat.py runs every op that way, and a user who meets a
problem on a private path can step around it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.autograd import forward_ad

PROBES = ("autograd_kernel", "autocast_kernel", "tracing_types", "symint_hint", "eager_direct",
          "fp32_precision", "sharding_key", "device_dispatch")
ENV_VAR = "TORCH_PALLAS_PUBLIC_API"


def _public_only() -> set[str]:
    names = {n.strip() for n in os.environ.get(ENV_VAR, "").split(",") if n.strip()}
    return set(PROBES) if "all" in names else names


_PUBLIC_ONLY = _public_only()
_unknown = _PUBLIC_ONLY - set(PROBES)
if _unknown:
    raise ValueError(f"torch_pallas: {ENV_VAR} names unknown probes {sorted(_unknown)}; "
                     f"known: {', '.join(PROBES)}, all")


def _probe(name: str, find: Callable[[], Any]) -> Any:
    """`find()`, or None where it fails or the public path is asked for."""
    if name in _PUBLIC_ONLY:
        return None
    try:
        return find()
    except (AttributeError, ImportError, TypeError):
        return None


def available() -> dict[str, bool]:
    """Which private paths this torch offers (and are in use)."""
    return {"autograd_kernel": DISPATCH is not None,
            "autocast_kernel": AUTOCAST is not None,
            "tracing_types": _TRACING_TYPES is not None,
            "symint_hint": _SYMINT_HAS_NODE is not None,
            "eager_direct": EAGER is not None,
            "fp32_precision": cuda_matmul_fp32_precision is not _public_fp32_precision,
            "sharding_key": _probe("sharding_key", _sharding_schema_infos) is not None,
            "device_dispatch": _DEVICE_DISPATCH is not None}


# --- autograd_kernel --------------------------------------------------------

class Dispatch(NamedTuple):
    """The dispatcher internals behind an op's own Autograd kernel."""

    after_autograd: Any  # the DispatchKeySet below autograd
    has_kernel_for: Callable[[str, Any], bool]  # (op name, dispatch key)
    below_views: Callable[[], Any]  # AutoDispatchBelowADInplaceOrView guard
    any_requires_grad: Callable[..., bool]
    functorch_active: Callable[[], bool]
    device_only: dict[int, Any]  # key set raw repr -> CPU/CUDA dispatch key
    forward_ad_level: Callable[[], int]  # >= 0 inside a forward-AD level


def _dispatch() -> Dispatch:
    C = torch._C
    device_only = {C.DispatchKeySet(key).raw_repr(): key
                   for key in (C.DispatchKey.CPU, C.DispatchKey.CUDA)}
    forward_ad._current_level  # noqa: B018 (probed)
    return Dispatch(
        after_autograd=C._after_autograd_keyset,
        has_kernel_for=_kernel_registrations(),
        below_views=C._AutoDispatchBelowADInplaceOrView,
        # torch 2.8 on; before it, the same test in Python.
        any_requires_grad=getattr(C, "_any_requires_grad", _any_requires_grad),
        functorch_active=C._are_functorch_transforms_active,
        device_only=device_only,
        forward_ad_level=lambda: forward_ad._current_level,
    )


@functools.cache  # one answer cache for both probes that use it
def _kernel_registrations() -> Callable[[str, Any], bool]:
    """`torch._C._dispatch_has_kernel_for_dispatch_key(op name, key)`, asked
    again only when a registration may have changed its answer. The
    dispatcher's lookup by name costs 1.5 us (about 6 inside a small op's
    call, 2-core CPU), which a plain call would pay on every run. What can
    change it: a torch.library registration (`Library.impl`,
    `torch.library.impl`, `register_kernel`), which torch.library records
    as "namespace/op/Key" in its `_impls` set and removes when its Library
    is destroyed, and a C++ library loaded by `torch.ops.load_library`
    (`torch.ops.loaded_libraries`). The answer is kept with both and asked
    again when either moves. Probed on a throwaway op: a registration must
    show in `_impls` and leave it when destroyed."""
    C = torch._C
    ask, impls, loaded = C._dispatch_has_kernel_for_dispatch_key, torch.library._impls, \
        torch.ops.loaded_libraries
    if not isinstance(impls, set) or not isinstance(loaded, set):
        raise TypeError("torch.library._impls / torch.ops.loaded_libraries are not sets")
    probe = torch.library.Library("torch_pallas_probe", "FRAGMENT")
    try:
        probe.define("registered(Tensor x) -> Tensor")
        probe.impl("registered", lambda x: x, "CPU")
        shown = "torch_pallas_probe/registered/CPU" in impls
    finally:
        probe._destroy()
    if not shown or "torch_pallas_probe/registered/CPU" in impls:
        raise TypeError("torch.library._impls does not record registrations as 'ns/op/Key'")
    known: dict[tuple, tuple] = {}  # (name, key) -> (its _impls entry, in _impls, libraries, answer)

    def has_kernel_for(name: str, key) -> bool:
        found = known.get((name, key))
        if found is None:
            entry = f"{name.replace('::', '/')}/{key.name}"
        else:
            entry, registered, libraries, answer = found
            if (entry in impls) == registered and len(loaded) == libraries:
                return answer
        answer = ask(name, key)
        known[(name, key)] = (entry, entry in impls, len(loaded), answer)
        return answer

    return has_kernel_for


def _any_requires_grad(*args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


DISPATCH: Dispatch | None = _probe("autograd_kernel", _dispatch)


# --- autocast_kernel --------------------------------------------------------

class Autocast(NamedTuple):
    key: Callable[[str], str]  # device type -> its Autocast dispatch key's name
    excluded: Callable[[str], Any]  # key name -> guard excluding that key


def _autocast() -> Autocast:
    C = torch._C
    return Autocast(
        key=lambda device_type: "Autocast" + C._dispatch_key_for_device(device_type),
        excluded=lambda key: C._ExcludeDispatchKeyGuard(
            C.DispatchKeySet(getattr(C.DispatchKey, key))
        ),
    )


AUTOCAST: Autocast | None = _probe("autocast_kernel", _autocast)


# --- tracing_types ----------------------------------------------------------

def _tracing_types():
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    return (torch.Tensor, FunctionalTensor, FakeTensor), FunctionalTensorMode


_TRACING_TYPES = _probe("tracing_types", _tracing_types)


def tracing_tensor_types():
    """((tensor types a decomposition may see), FunctionalTensorMode), or
    None on a torch without them."""
    return _TRACING_TYPES


# --- symint_hint ------------------------------------------------------------

_SYMINT_HAS_NODE = _probe(
    "symint_hint", lambda: "node" in torch.SymInt.__init__.__code__.co_varnames or None
)


def size_hint(size) -> int:
    """The example value of a (possibly symbolic) size, without guarding on
    it where this torch lets us read the hint; else the size itself, which
    specialises the compiled graph on it."""
    if isinstance(size, torch.SymInt) and _SYMINT_HAS_NODE is not None:
        hint = getattr(getattr(size, "node", None), "hint", None)
        if hint is not None:
            return int(hint)
    return int(size)


# --- eager_direct -----------------------------------------------------------

class Eager(NamedTuple):
    """What tells a plain eager call, one the dispatcher would hand straight
    to an op's own kernel (registration.direct_caller)."""

    plain_cpu_key_sets: frozenset  # raw key sets of a plain strided CPU tensor (and an inference one)
    key_set: Callable[[torch.Tensor], int]  # a tensor's key set, raw
    unintercepted: Callable[[], bool]  # nothing sits between a call and the dispatcher's kernel
    below_views: Callable[[], Any]  # AutoDispatchBelowADInplaceOrView guard
    has_cpu_kernel: Callable[[str], bool]  # op name: a kernel registered for the CPU key itself
    any_requires_grad: Callable[..., bool]  # of tensors
    default_device: Callable[[], torch.device]  # torch.get_default_device(), read fast
    argument_kinds: Callable[[Any], tuple]  # OpOverload -> ((name, keyword-only, kind), ...)
    frames_unwatched: Callable[[], bool]  # no Dynamo frame callback set: nothing can trace a call


def _eager() -> Eager:
    C = torch._C
    with torch.inference_mode():
        inference = torch.empty(0, device="cpu")
    plain = frozenset(C._dispatch_keys(t).raw_repr() for t in (torch.empty(0, device="cpu"), inference))
    function_modes, dispatch_modes = C._is_torch_function_mode_enabled, C._len_torch_dispatch_stack
    transforms, autocast = C._are_functorch_transforms_active, C._is_any_autocast_enabled
    tracer, profiler = C._get_tracing_state, C._autograd._profiler_enabled
    forward_ad._current_level  # noqa: B018 (probed)

    def unintercepted() -> bool:
        """No TorchFunctionMode or TorchDispatchMode (FakeTensorMode,
        FlopCounterMode, a default device...), functorch transform, autocast,
        JIT trace, profiler or forward-AD level."""
        return not (function_modes() or dispatch_modes() or transforms() or autocast()
                    or tracer() is not None or profiler() or forward_ad._current_level >= 0)

    has_kernel, cpu = _kernel_registrations(), C.DispatchKey.CPU
    get_default_device, cpu_device = torch.get_default_device, torch.device("cpu")

    def default_device() -> torch.device:
        """torch.get_default_device() (12 us on the 2-core CPU): a default
        device other than the CPU is a TorchFunctionMode (set_default_device,
        `with torch.device(...)`), so without one it is the CPU."""
        return get_default_device() if function_modes() else cpu_device

    # Dynamo's frame callback, set while torch.compile runs (and in the
    # eager code between its graphs); its C module loads without Dynamo.
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as eval_frame_callback

    if function_modes() or get_default_device() != cpu_device:  # what the rule rests on
        raise TypeError("a default device without a function mode")
    return Eager(plain_cpu_key_sets=plain, key_set=lambda t: C._dispatch_keys(t).raw_repr(),
                 unintercepted=unintercepted, below_views=C._AutoDispatchBelowADInplaceOrView,
                 has_cpu_kernel=lambda name: has_kernel(name, cpu),
                 any_requires_grad=getattr(C, "_any_requires_grad", _any_requires_grad),
                 default_device=default_device,
                 argument_kinds=_argument_kinds,
                 frames_unwatched=lambda: eval_frame_callback() is None)


def _argument_kinds(op) -> tuple:
    """An OpOverload's arguments as (name, keyword-only, kind): the schema
    type's kind ("TensorType", "ScalarTypeType"...), an optional's or a
    list's with its element's ("OptionalType/TensorType",
    "ListType/SymIntType")."""
    def kind(t) -> str:
        name = t.kind()
        return f"{name}/{kind(t.getElementType())}" if name in ("OptionalType", "ListType") else name

    return tuple((a.name, a.kwarg_only, kind(a.real_type)) for a in op._schema.arguments)


EAGER: Eager | None = _probe("eager_direct", _eager)
default_device: Callable[[], torch.device] = (torch.get_default_device if EAGER is None
                                              else EAGER.default_device)


# --- fp32_precision -------------------------------------------------------

def _public_fp32_precision() -> str | None:
    """torch.backends.cuda.matmul.fp32_precision as it applies ("tf32",
    "ieee", or "none": torch's default), through the global setting where
    the matmul one inherits it; None on a torch before these settings."""
    setting = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if setting == "none":  # inherits the global setting
        setting = getattr(torch.backends, "fp32_precision", "none")
    return setting


def _fp32_precision() -> Callable[[], str | None]:
    getter = torch._C._get_fp32_precision_getter

    def read() -> str:  # the settings' own getters, without their modules' __getattr__
        setting = getter("cuda", "matmul")
        return getter("generic", "all") if setting == "none" else setting

    if read() != _public_fp32_precision():
        raise TypeError("the fp32 precision getters disagree with torch.backends")
    return read


# What the plans of eager matmul calls read per call (ops/matmul.py).
cuda_matmul_fp32_precision: Callable[[], str | None] = (
    _probe("fp32_precision", _fp32_precision) or _public_fp32_precision)


# --- sharding_key ---------------------------------------------------------
# Probed when a sharding rule is registered (torch_pallas.distributed), not
# when torch_pallas is imported: that would import DTensor.

def _sharding_schema_infos() -> dict:
    from torch.distributed.tensor import DTensor

    infos = DTensor._op_dispatcher.sharding_propagator.op_to_schema_info
    if not isinstance(infos, dict):
        raise TypeError("DTensor's schema infos are not a dict")
    return infos


def register_sharding_keyed(op, rule: Callable, static_argnum: int) -> bool:
    """`torch.distributed.tensor.experimental.register_sharding(op)(rule)`,
    with DTensor's cached decisions for `op` keyed on its arguments from
    `static_argnum` on (register_sharding keys them on the first int
    argument on: an op whose non-tensor arguments decide its results'
    shapes would get another call's shapes). Where torch's record of those
    keys is missing, nothing is registered and False returned."""
    from torch.distributed.tensor.experimental import register_sharding

    infos = _probe("sharding_key", _sharding_schema_infos)
    if infos is None:
        return False
    register_sharding(op)(rule)
    info = infos.get(op)
    if info is None or not hasattr(info, "static_argnum"):
        return False  # registered by another route: the rule stays off
    infos[op] = dataclasses.replace(info, static_argnum=static_argnum)
    return True


# --- device_dispatch ----------------------------------------------------------

class DeviceDispatch(NamedTuple):
    privateuse1_name: Callable[[], str]
    key_set: Callable[[str], Any]  # a device type's DispatchKeySet


def _device_dispatch() -> DeviceDispatch:
    C = torch._C
    return DeviceDispatch(
        privateuse1_name=C._get_privateuse1_backend_name,
        key_set=lambda device_type: C.DispatchKeySet(
            getattr(C.DispatchKey, C._dispatch_key_for_device(device_type))))


_DEVICE_DISPATCH = _probe("device_dispatch", _device_dispatch)


def privateuse1_name(renamed_to: str) -> str:
    """PrivateUse1's device name: `renamed_to` where a backend renamed it so
    (torch_tpu: "tpu" where it found a chip), else "privateuseone"."""
    if _DEVICE_DISPATCH is not None:
        return _DEVICE_DISPATCH.privateuse1_name()
    try:
        torch.device(renamed_to)
    except RuntimeError:
        return "privateuseone"
    return renamed_to


def device_key_set(device_type: str):
    """The DispatchKeySet of a device type's backend, for a factory op's
    BackendSelect kernel to redispatch to; None on the public path (no such
    kernel: the factory stays on its CPU kernel, which refuses the device)."""
    return None if _DEVICE_DISPATCH is None else _DEVICE_DISPATCH.key_set(device_type)


# --- wrap_triton (public on every torch; its reach differs) ------------------

def _interpreted(kernel) -> bool:
    """Whether `kernel` is Triton's interpreter's (TRITON_INTERPRET=1:
    `triton.jit` makes an InterpretedFunction), directly or under
    `triton.autotune` / `triton.heuristics`."""
    try:
        from triton.runtime.autotuner import Autotuner, Heuristics
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    seen = set()
    while isinstance(kernel, (Autotuner, Heuristics)) and id(kernel) not in seen:
        seen.add(id(kernel))
        kernel = kernel.fn
    return isinstance(kernel, InterpretedFunction)


def wrap_triton(kernel):
    """`torch.library.wrap_triton(kernel)`, the launch torch's tracers
    record, for every kernel torch_pallas launches: the interpreter's
    kernels (no GPU, TRITON_INTERPRET=1) are launched as they are, as torch
    2.13 on does itself (they lack the JIT metadata a traced launch needs,
    and torch 2.11 refuses them: "wrap_triton only works on functions
    annotated with triton.jit")."""
    if _interpreted(kernel):
        return kernel
    return torch.library.wrap_triton(kernel)
