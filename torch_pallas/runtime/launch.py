"""One op call on its backend: select, find the compiled kernel, cross to
JAX, run, cross back.

An op file (ops/*.py) checks its arguments, then calls `run` with the torch
tensors and the op's static parameters. `run` picks the backend
(torch_pallas.runtime.backends) and the op's kernel for its family
(torch_pallas.runtime.registry), fetches the compiled kernel from the cache
(building it on the first call: torch_pallas.runtime.compilation), hands the tensors
to JAX without copies (torch_pallas.runtime.bridge), runs the kernel (the simulators
one at a time: torch_pallas.runtime.simulators) and hands the result back.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from torch_pallas.base import dtypes, jax_env, torch_compat
from torch_pallas.base.errors import BackendError, add_note
from torch_pallas.kernels.spec import KernelSpec
from torch_pallas.runtime import (backends, bridge, compilation, compile_cache, compile_path,
                                  registry, simulators)
from torch_pallas.runtime.backends import Backend


def qualified_name(op: str) -> str:
    """The op's torch name: shipped ops live in the `pallas` namespace."""
    return op if "::" in op else f"{registry.NAMESPACE}::{op}"


def static_key(params: Mapping[str, Any]) -> tuple:
    """The op's static parameters as a cache key. Floats are keyed by their
    bits: -0.0 == 0.0 would share a kernel, and a NaN, unequal to itself,
    would never find its own. (Every call computes it: loops, not
    generators, and tuples of ints, the usual shapes, kept as they are.)"""
    key = []
    for item in params.items():
        if isinstance(item[1], (float, tuple)):
            item = (item[0], _static_value(item[1]))
        key.append(item)
    return tuple(key)


def _static_value(value):
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, tuple):
        for v in value:
            if isinstance(v, (float, tuple)):
                return tuple([_static_value(v) for v in value])
    return value


def user_interpret(device: torch.device, op: str):
    """What a user's function (custom_op) gets as `interpret` on the
    backend that would serve a call of `op` on `device`: what the shape
    evaluation passes, so it traces as the run does. True (JAX's generic
    interpreter) where no backend serves the device here (fake CUDA
    tensors on a machine without a GPU: the run would not happen)."""
    try:
        backend = backends.select(device, qualified_name(op))
    except BackendError:
        return True
    if backend.family == "triton":
        return True
    detect_races = backend.simulated and simulators.detecting_races()
    return backend.execution(device=device, takes_inputs=True, detect_races=detect_races)["interpret"]


def _shipped_kernel(op: str, backend: Backend, device: torch.device, avals, params):
    """(backend, kernel spec) for a shipped op: the backend's own kernel, or,
    for an automatic choice whose family lacks the op or cannot run this
    call, the fallback's."""
    info = registry.get(op)
    name = info.qualified_name
    if not info.serves(backend):
        if backends.requested() is not None:
            info.kernel(backend)  # raises, naming the families that implement it
        backend = backends.fall_back(device, name, backend, "has no kernel for the op")
    spec = info.kernel(backend)
    reason = spec.refusal(backend.name, avals, params)
    if reason is not None:
        backend = backends.fall_back(device, name, backend, reason)
        spec = info.kernel(backend)
    return backend, spec


def _entry(op: str, backend: Backend, device: torch.device, avals, params,
           detect_races: bool, user_function: Callable | None):
    """The kernel's function with everything but its inputs bound, its XLA
    options, and its FLOPs where the kernel knows them before a trace."""
    execution = backend.execution(device=device, takes_inputs=bool(avals),
                                  detect_races=detect_races)
    if user_function is not None:  # a user's JAX function (torch_pallas.custom_op)
        if backend.family == "triton":
            raise BackendError(
                f"{op}: backend 'triton' needs a Triton implementation of the op "
                "(custom_op(..., triton=...))"
            )
        takes = inspect.signature(user_function).parameters
        bound = {"interpret": execution["interpret"]} if "interpret" in takes else {}
        return functools.partial(user_function, **params, **bound), {}, None
    backend, spec = _shipped_kernel(op, backend, device, avals, params)
    target = None if backend.family == "triton" else backends.jax_device(device, backend)
    entry = shipped_entry(spec, backend, target, avals, params, execution)
    return entry, spec.options(backend.name, avals, params), spec.work(avals, params)


def shipped_entry(spec: KernelSpec, backend: Backend, target, avals, params: Mapping[str, Any],
                  execution: Mapping[str, Any]) -> Callable:
    """A shipped kernel as a function of its inputs alone: its config for
    these avals on `target` (the JAX device it is built for) and the
    backend's `execution` keywords bound. The one form both callers run:
    this module's torch calls and torch_pallas.jax's functions of JAX
    arrays."""
    config = spec.config(backend.name, avals, params, target)
    return functools.partial(spec.run, **params, config=config, **execution)


@dataclasses.dataclass(frozen=True)
class UserKernelSupport:
    """What a call of a user's kernel (a JAX function standing in for a
    shipped op's kernels: torch_pallas.custom_op) needs beyond a shipped
    kernel, handed over by the layer that defines such ops
    (`support_user_kernels`), which this one does not import:

    - `as_run_on(function, backend_name)`: the function as that backend runs
      it (windowed pallas_calls on the Mosaic GPU simulator);
    - `explain(error, op, backend_name, user_function)`: the exception to
      raise instead of `error`, raised while building the kernel, or None;
    - `check(op, backend_name, function, avals)`: warns where the kernel
      will run slowly.
    """

    as_run_on: Callable[[Callable, str], Callable]
    explain: Callable[[BaseException, str, str, Callable], BaseException | None]
    check: Callable[[str, str, Callable, tuple], None]


_user_kernel_support: UserKernelSupport | None = None


def support_user_kernels(support: UserKernelSupport) -> None:
    """Calls with a `user_function` get `support` (see UserKernelSupport)."""
    global _user_kernel_support
    _user_kernel_support = support


def _user_kernels(op: str) -> UserKernelSupport:
    if _user_kernel_support is None:
        raise RuntimeError(f"{op}: a user's kernel runs through torch_pallas.custom_op, "
                           "whose module supports it; import torch_pallas first")
    return _user_kernel_support


def call_signature(op: str, device: torch.device, inputs: tuple[torch.Tensor, ...],
                   params: Mapping[str, Any], user_function: Callable | None = None) -> tuple:
    """Everything a call's backend and kernel follow from, as the call has
    it: the key under which a repeated call finds them again."""
    return (op, device, backends.requested(), simulators.detecting_races(), user_function,
            static_key(params), *[(t.shape, t.dtype) for t in inputs])


def compiled_kernel(
    op: str,
    device: torch.device,
    inputs: tuple[torch.Tensor, ...] = (),
    params: Mapping[str, Any] | None = None,
    user_function: Callable | None = None,
    signature: tuple | None = None,
):
    """(backend, kernel, cache key) for a call: the kernel compiled for these
    inputs' shapes and dtypes, built on first use. The kernel takes and
    returns JAX arrays (Triton kernels: torch tensors). `user_function` is a
    user's JAX function standing in for a shipped op's kernels; `signature`
    the call's `call_signature`, where the caller has it."""
    params = params or {}
    if signature is None:
        signature = call_signature(op, device, inputs, params, user_function)
    found = compile_cache.compiled.lookup_signature(signature)
    if found is not None:
        key, backend, kernel = found
        return backend, kernel, key
    static = signature[5]
    name = qualified_name(op)
    backend = backends.select(device, name)
    avals = tuple((tuple(t.shape), dtypes.jax_name(t.dtype)) for t in inputs)
    if user_function is None:
        backend, _ = _shipped_kernel(op, backend, device, avals, params)
    detect_races = backend.simulated and simulators.detecting_races()
    key = (op, backend.name, device, avals, static, detect_races)
    if user_function is not None:  # one op may run several (a custom op's forward and vjp)
        key += (user_function,)

    def build():
        entry, options, flops = _entry(op, backend, device, avals, params, detect_races,
                                       user_function)
        if backend.family == "triton":
            return entry  # launched on torch tensors as it is
        user = None if user_function is None else _user_kernels(name)
        if user is not None:
            entry = user.as_run_on(entry, backend.name)
        try:
            kernel = compilation.build(entry, avals, options, backend, device,
                                       identity=_persistent_identity(key, entry, options),
                                       flops=flops)
        except Exception as e:
            building = (f"{name}: building its {backend.name!r} kernel for inputs "
                        f"{list(avals)} and parameters {dict(params)}")
            add_note(e, building)
            advice = None if user is None else user.explain(e, name, backend.name, user_function)
            if advice is not None:  # what limit a user's kernel hit, and what to do
                add_note(advice, building)
                raise advice from e
            raise
        if user is not None:
            user.check(name, backend.name, entry, avals)
        return kernel

    kernel = compile_cache.compiled.get(key, build)
    if backends.choice_is_stable(backend, device):
        compile_cache.compiled.remember_signature(signature, key, backend)
    return backend, kernel, key


def _persistent_identity(key: tuple, entry, options) -> tuple | None:
    """What a shipped op's kernel on the `interpret` backend follows from,
    as values whose repr is the same in every process (the disk cache's key);
    None for kernels that are not kept on disk: users' (their source is not
    the package's), the simulators' (they call back into Python), GPUs'."""
    op, backend, device, avals, static, _ = key[:6]
    if len(key) > 6 or backend != "interpret" or device.type != "cpu":
        return None
    bound = sorted((k, repr(v)) for k, v in entry.keywords.items())
    return (op, backend, str(device), avals, repr(static), bound,
            sorted((k, repr(v)) for k, v in options.items()), entry.func.__module__,
            entry.func.__qualname__)


def run(
    op: str,
    device: torch.device,
    inputs: tuple[torch.Tensor, ...] = (),
    params: Mapping[str, Any] | None = None,
    user_function: Callable | None = None,
    x64: bool = False,
):
    """Runs op `op`'s kernel on `inputs`; returns what the kernel returns, as
    torch tensors. `params` are the op's static parameters (hashable); they
    are part of the compiled kernel's identity. `x64`: the kernel is traced,
    compiled and run with JAX's 64-bit mode on (a user's function taking
    64-bit tensors)."""
    if x64:
        with jax_env.x64_scope():
            return run(op, device, inputs, params, user_function)
    if compile_path.tracing_triton():
        triton = backends.get("triton")
        spec = registry.get(op).kernel(triton)
        execution = triton.execution(device=device, takes_inputs=bool(inputs))
        return spec.run(*inputs, **(params or {}), config=spec.default_config(triton.name),
                        wrap=torch_compat.wrap_triton, **execution)
    signature = call_signature(op, device, inputs, params or {}, user_function)
    if user_function is None:  # a shipped op's repeated call: straight to its kernel
        ready = compile_cache.compiled.ready(signature)
        if ready is not None:
            return ready(*inputs)
    backend, kernel, key = compiled_kernel(op, device, inputs, params, user_function, signature)
    if backend.family == "triton":
        return kernel(*inputs)
    if backend.name == "tpu":  # CPU tensors, to the chip and back
        return _to_torch(kernel(*[bridge.to_kernel_argument(t) for t in inputs]),
                         bridge.device_to_torch)
    if not backend.simulated:
        if device.type != "cpu":
            return _run_compiled(kernel, *inputs)
        call = _cpu_call(kernel, inputs)
        if user_function is None and backends.choice_is_stable(backend, device):
            compile_cache.compiled.set_ready(key, call)
        return call(*inputs)
    arrays = [bridge.to_kernel_argument(t) for t in inputs]
    _, _, _, avals, _, detect_races = key[:6]
    out = simulators.run(
        backend, kernel, arrays, detect_races=detect_races,
        describe=lambda: f"{qualified_name(op)} (inputs {list(avals)}, parameters {params})",
    )
    return _to_torch(out)


def bound(op: str, device: torch.device, inputs: tuple[torch.Tensor, ...],
          params: Mapping[str, Any] | None = None) -> Callable | None:
    """`run` of a shipped op with `params` for tensors shaped as `inputs`,
    with its kernel found once: a function of the tensors, for a caller
    that repeats one call many times (a matmul's plan: a decode loop), or
    None where each call must find its kernel (a simulator, Triton, while
    torch.compile traces). It saves `run`'s search, ~35 us of a call on
    the 2-core CPU, and is valid while `binding_state()` is unchanged."""
    kernel = _found_kernel(op, device, inputs, params)
    if kernel is None:
        return None
    if device.type != "cpu":
        return functools.partial(_run_compiled, kernel)
    return _cpu_call(kernel, inputs)


def _cpu_call(kernel, inputs: tuple[torch.Tensor, ...]) -> Callable:
    """What _run_compiled does for CPU tensors shaped as `inputs`, with each
    input's conversion chosen for its dtype and the result's device known."""
    makers = tuple(bridge.kernel_argument_maker(t.dtype) for t in inputs)
    export = bridge.cpu_to_torch()
    if len(makers) == 2:  # most ops: no generator, no zip
        (make_a, make_b) = makers
        return lambda a, b: _to_torch(kernel(make_a(a), make_b(b)), export)

    def call(*tensors):
        return _to_torch(kernel(*[make(t) for make, t in zip(makers, tensors)]), export)

    return call


def cpu_kernel(op: str, inputs: tuple[torch.Tensor, ...],
               params: Mapping[str, Any] | None = None) -> Callable | None:
    """What `bound` calls on CPU tensors shaped as `inputs`, without the
    conversions: the compiled kernel, a function of the tensors' NumPy
    views (bridge.kernel_argument_maker) returning JAX arrays, which
    bridge.cpu_to_torch() hands back. For a caller that reads its tensors
    its own way (matmul's linear plans); None where `bound` is; valid while
    `binding_state()` is unchanged."""
    return _found_kernel(op, torch.device("cpu"), inputs, params)


def _found_kernel(op, device, inputs, params):
    """The compiled JAX kernel of a call, or None where each call must find
    its own (see `bound`)."""
    if compile_path.tracing_triton():
        return None
    backend, kernel, _ = compiled_kernel(op, device, inputs, params)
    if backend.family == "triton" or backend.simulated or backend.name == "tpu":
        return None
    return kernel


def binding_state() -> tuple:
    """What a `bound` call's kernel follows from besides its shapes and
    parameters: the requested backend, race detection, and the compile
    cache's generation (cleared: rebuilt)."""
    return backends.requested(), simulators.detecting_races(), compile_cache.compiled.generation


def _run_compiled(kernel, *tensors, export=bridge.to_torch):
    """A compiled JAX kernel run on torch tensors (shared, not copied), its
    result handed back to torch by `export`."""
    return _to_torch(kernel(*[bridge.to_kernel_argument(t) for t in tensors]), export)


def _to_torch(out, export=bridge.to_torch):
    if isinstance(out, (tuple, list)):
        return tuple(export(a) for a in out)
    return export(out)
