"""One op call on its backend: select, compile once, cross to JAX, run.

An op file (ops/*.py) checks its arguments, then calls `launch` with the
torch tensors and the op's static parameters. `launch` picks the backend
(torch_pallas.backends), fetches the compiled kernel from the cache (building
it on the first call: the kernel module's entry point, its config for this
backend, the backend's `interpret=` and core count), hands the tensors to JAX
without copies (CPU tensors as NumPy views, CUDA ones through DLPack), runs
the kernel and hands the result back through DLPack.
Small kernels on the `interpret` backend are compiled for a synchronous CPU
client (`_runs_synchronously`), so a call never waits for a thread to wake.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import inspect
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from torch_pallas import backends, bridge, compile_cache, dtypes, jax_env

_detect_races: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "torch_pallas_detect_races", default=False
)

# Set while AOTAutograd traces an op on CUDA tensors: kernels are then the
# Triton ones, launched through torch.library.wrap_triton so the graph holds
# the Triton kernel itself (see torch_pallas/compile_path.py).
_tracing_triton: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "torch_pallas_tracing_triton", default=False
)

# The simulators keep global state (simulated memories, clocks): one
# simulated kernel at a time in a process.
_simulator_lock = threading.Lock()


class RaceDetectedError(RuntimeError):
    """A simulation backend's race detector flagged a kernel."""


@contextlib.contextmanager
def race_detection(enabled: bool = True) -> Iterator[None]:
    """Runs the simulation backends (`tpu_interpret`, `mosaic_gpu_interpret`)
    with their data-race detectors on; a flagged kernel raises
    RaceDetectedError."""
    token = _detect_races.set(enabled)
    try:
        yield
    finally:
        _detect_races.reset(token)


def qualified_name(op: str) -> str:
    """The op's torch name: shipped ops live in the `pallas` namespace."""
    return op if "::" in op else f"pallas::{op}"


@functools.cache
def kernel_module(family: str, op: str):
    return importlib.import_module(f"torch_pallas.kernels.{family}.{op}")


def _execution_kwargs(backend: backends.Backend, detect_races: bool) -> dict[str, Any]:
    """The arguments that say how a kernel family runs on this backend."""
    if backend.name == "interpret":
        jax_env.simulate_tpu_on_cpu()
        # One TensorCore: JAX's generic interpreter has no core axis to bind.
        return {"interpret": True, "num_cores": 1}
    if backend.name == "tpu_interpret":
        jax_env.simulate_tpu_on_cpu()
        return {
            "interpret": jax_env.tpu_interpret_params(detect_races=detect_races),
            "num_cores": jax_env.SIMULATED_TPU_CORES,
        }
    if backend.name == "mosaic_gpu_interpret":
        return {"interpret": jax_env.gpu_interpret_params(detect_races=detect_races)}
    return {"interpret": None}  # the hardware


@functools.cache
def jax_device(device: torch.device):
    jax = jax_env.jax()
    if device.type == "cpu":
        return jax.devices("cpu")[0]
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as e:
        raise backends.BackendError(
            f"torch_pallas: JAX has no GPU backend for {device} (install a CUDA "
            f"build of jaxlib, e.g. pip install 'jax[cuda12]'): {e}"
        ) from None
    return gpus[device.index or 0]


@contextlib.contextmanager
def tracing_triton() -> Iterator[None]:
    token = _tracing_triton.set(True)
    try:
        yield
    finally:
        _tracing_triton.reset(token)


def _triton_entry(op, device, params, has_inputs, **kwargs):
    """A Triton launcher (torch tensors in, out); a kernel without inputs is
    told its device."""
    module = kernel_module("triton", op)
    if not has_inputs:
        kwargs["device"] = device
    return functools.partial(
        getattr(module, op), **params, config=module.default_config("triton"), **kwargs
    )


def _build(op, backend, device, avals, params, detect_races, entry):
    options = {}
    if entry is not None:  # a user's JAX function (torch_pallas.custom_op)
        if backend.family == "triton":
            raise backends.BackendError(
                f"{op}: backend 'triton' needs a Triton implementation of the op "
                "(custom_op(..., triton=...))"
            )
        kwargs = {}
        if "interpret" in inspect.signature(entry).parameters:
            kwargs["interpret"] = _execution_kwargs(backend, detect_races)["interpret"]
        entry = functools.partial(entry, **params, **kwargs)
    elif backend.family == "triton":
        return _triton_entry(op, device, params, has_inputs=bool(avals))
    else:
        module = kernel_module(backend.family, op)
        if hasattr(module, "select_config"):  # a config per shape
            config = module.select_config(backend.name, avals, params)
        else:
            config = module.default_config(backend.name)
        entry = functools.partial(
            getattr(module, op), **params, config=config, **_execution_kwargs(backend, detect_races),
        )
        if hasattr(module, "compiler_options"):  # XLA options per shape
            options = module.compiler_options(backend.name, avals, params)
    # Small CPU kernels run on the synchronous client: lowered for it first,
    # so that they are lowered once (a lowering costs as much as the compile).
    if backend.name == "interpret" and device.type == "cpu":
        synchronous = jax_env.synchronous_cpu_device()
        try:
            if synchronous is not None:
                lowered = _lower(entry, avals, synchronous)
                if _runs_synchronously(lowered):
                    return _compile(lowered, options)
        except Exception:  # a JAX that cannot build for a second client
            pass
    try:
        lowered = _lower(entry, avals, jax_device(device))
    except Exception as e:
        add_note(e, f"{qualified_name(op)}: building its {backend.name!r} kernel for inputs "
                    f"{list(avals)} and parameters {dict(params)}")
        raise
    return _compile(lowered, options)


def add_note(error: BaseException, note: str) -> None:
    """Adds `note` to `error`'s notes, which tracebacks print after its
    message (Python 3.10, which has no add_note, keeps them unprinted)."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", []), note]


def _lower(entry, avals, jax_device):
    jax = jax_env.jax()
    sharding = jax.sharding.SingleDeviceSharding(jax_device)
    shapes = [jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype), sharding=sharding)
              for shape, dtype in avals]
    return jax.jit(entry, out_shardings=sharding).lower(*shapes)


# CPU kernels under both limits run on the calling thread
# (jax_env.synchronous_cpu_device). Measured on 2 cores, whole op calls,
# JAX's client -> synchronous: add 2^20 float32 (12 MiB moved) 510-565 ->
# 430 us, fill 2^20 (4 MiB) 210-230 -> 195-205 us, matmul 384^3 (1.1e8
# FLOPs) 705-745 -> 620 us, matmul 512^3 (2.7e8) even; past them JAX's
# worker threads win: fill 2^22 (16 MiB) 500-550 -> 880-1265 us, add 2^22
# (48 MiB) 1230-1350 -> 1220-1810 us.
SYNCHRONOUS_MAX_FLOPS = 2e8  # XLA's estimate
SYNCHRONOUS_MAX_BYTES = 16 * 2**20  # operands and results


def _runs_synchronously(lowered) -> bool:
    jax = jax_env.jax()
    moved = sum(math.prod(a.shape) * jax.numpy.dtype(a.dtype).itemsize
                for a in jax.tree.leaves((lowered.in_avals, lowered.out_info)))
    try:
        cost = lowered.cost_analysis() or {}
    except Exception:  # no estimate: JAX's default
        return False
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per computation
        cost = cost[0] if cost else {}
    return cost.get("flops", math.inf) < SYNCHRONOUS_MAX_FLOPS and moved < SYNCHRONOUS_MAX_BYTES


def input_device(kernel):
    """The JAX device a compiled kernel takes its inputs on (None: no inputs)."""
    shardings, _ = kernel.input_shardings
    return next(iter(shardings[0].device_set)) if shardings else None


def _compile(lowered, options: Mapping[str, Any]):
    """`lowered` compiled with the kernel's XLA `options`, or without them on
    an XLA that does not know them (they choose speed, never results)."""
    if options:
        try:
            return lowered.compile(dict(options))
        except RuntimeError as e:
            if "INVALID_ARGUMENT" not in str(e) or "option" not in str(e):
                raise
    return lowered.compile()


def static_key(params: Mapping[str, Any]) -> tuple:
    """The op's static parameters as a cache key. Floats are keyed by their
    bits: -0.0 == 0.0 would share a kernel, and a NaN, unequal to itself,
    would never find its own."""
    return tuple((name, value.hex() if isinstance(value, float) else value)
                 for name, value in params.items())


def compiled_kernel(
    op: str,
    device: torch.device,
    inputs: tuple[torch.Tensor, ...] = (),
    params: Mapping[str, Any] | None = None,
    entry: Callable | None = None,
):
    """(backend, kernel, cache key) for a call: the kernel compiled for these
    inputs' shapes and dtypes, built on first use. The kernel takes and
    returns JAX arrays (Triton kernels: torch tensors). `entry` is a user's
    JAX function standing in for kernels/<family>/<op>.py."""
    params = params or {}
    # Everything the backend and the kernel follow from, as the call has it.
    static = static_key(params)
    signature = (op, device, backends.requested(), _detect_races.get(), entry, static,
                 *[(t.shape, t.dtype) for t in inputs])
    found = compile_cache.kernels.recall(signature)
    if found is not None:
        key, backend, kernel = found
        return backend, kernel, key
    name = qualified_name(op)
    backend = backends.select(device, name)
    avals = tuple((tuple(t.shape), dtypes.jax_name(t.dtype)) for t in inputs)
    if entry is None and backend.family != "triton":
        module = kernel_module(backend.family, op)
        # A kernel that cannot run this call as asked (e.g. at this precision).
        reason = module.unsupported(backend.name, avals, params) if hasattr(module, "unsupported") else None
        if reason is not None:
            backend = backends.fall_back(device, name, backend, reason)
    detect_races = backend.simulated and _detect_races.get()
    key = (op, backend.name, device, avals, static, detect_races)
    kernel = compile_cache.kernels.get(
        key, lambda: _build(op, backend, device, avals, params, detect_races, entry)
    )
    # Triton on CPU tensors is chosen again per call: it is allowed only
    # while TRITON_INTERPRET is set.
    if not (backend.family == "triton" and device.type == "cpu"):
        compile_cache.kernels.remember(signature, key, backend)
    return backend, kernel, key


def launch(
    op: str,
    device: torch.device,
    inputs: tuple[torch.Tensor, ...] = (),
    params: Mapping[str, Any] | None = None,
    entry: Callable | None = None,
):
    """Runs kernel `op` (kernels/<family>/<op>.py) on `inputs`; returns what
    the kernel returns, as torch tensors.

    `params` are the op's static parameters (hashable); they are part of the
    compiled kernel's identity.
    """
    if _tracing_triton.get():
        launcher = _triton_entry(op, device, params or {}, bool(inputs), wrap=torch.library.wrap_triton)
        return launcher(*inputs)
    backend, kernel, key = compiled_kernel(op, device, inputs, params, entry)
    if backend.family == "triton":
        return kernel(*inputs)
    arrays = [bridge.to_kernel_argument(t) for t in inputs]
    if not backend.simulated:
        return _to_torch(kernel(*arrays))
    with _simulator_lock:
        try:
            out = kernel(*arrays)
            jax_env.jax().block_until_ready(out)
        except Exception:
            jax_env.reset_simulator(backend.family)
            raise
        _, _, _, avals, _, detect_races = key
        if detect_races and jax_env.races_found(backend.family):
            raise RaceDetectedError(
                f"{qualified_name(op)}: backend {backend.name!r} detected a data race "
                f"in the kernel (inputs {avals}, parameters {params})"
            )
    return _to_torch(out)


def _to_torch(out):
    if isinstance(out, (tuple, list)):
        return tuple(bridge.to_torch(a) for a in out)
    return bridge.to_torch(out)

