"""Which backend serves a call: the one module that branches on devices.

A backend is a kernel family plus a way to execute it:

==========================  ===========  ==========================================
backend                     kernels      runs where
==========================  ===========  ==========================================
``mosaic_gpu``              mosaic_gpu   CUDA, compute capability 9.0+ (Hopper on)
``triton``                  triton       CUDA; CPU only with ``TRITON_INTERPRET=1``
``interpret``               tpu          CPU, JAX's generic interpreter (default)
``mosaic_gpu_interpret``    mosaic_gpu   CPU, Mosaic GPU interpret mode
``tpu_interpret``           tpu          CPU, TPU interpret mode (2 TensorCores)
``tpu``                     tpu          CPU tensors, run on the TPU JAX sees
==========================  ===========  ==========================================

The default comes from the device (CPU: ``interpret``; CUDA: ``mosaic_gpu``
on Hopper and newer, ``triton`` before). ``TORCH_PALLAS_BACKEND=name`` or
``with torch_pallas.backend(name):`` choose one explicitly; an explicit
choice that cannot serve a call raises, it never falls back.

``tpu`` is chosen explicitly only: a CPU tensor's call then runs on the
machine's TPU (the kernels compiled by Mosaic for the chip), its operands
copied host -> TPU and its results TPU -> host on every call.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torch_pallas.base import jax_env
from torch_pallas.base.errors import BackendError
from torch_pallas.kernels import triton as triton_kernels  # no `import triton` here

ENV_VAR = "TORCH_PALLAS_BACKEND"


@dataclasses.dataclass(frozen=True)
class Backend:
    """A kernel family and the way this backend runs it."""

    name: str
    family: str  # the folder under kernels/ holding its kernels
    device_type: str  # the torch device type it serves
    simulated: bool  # runs hardware kernels in a CPU simulator (one at a time)
    # How far a float32 result may stray beyond the CPU's error bounds, as a
    # multiple of them: a TPU's float32 exp, log and reciprocal are a few
    # ulps to 1e-4 from correctly rounded (docs/tpu.md); v5e left swiglu's
    # bound by 1.5x and linear_cross_entropy_backward's by up to 6x.
    float32_allowance: float = 1.0

    def execution(self, *, device: torch.device, takes_inputs: bool,
                  detect_races: bool = False) -> dict[str, Any]:
        """The keywords that tell a kernel of this family how it runs here
        (kernels/spec.py): `interpret=` and the TensorCore count for the
        TPU kernels, `interpret=` for the Mosaic GPU ones, the device for
        Triton kernels that take no tensor."""
        if self.name == "interpret":
            jax_env.simulate_tpu_on_cpu()
            # One TensorCore: JAX's generic interpreter has no core axis to bind.
            return {"interpret": True, "num_cores": 1}
        if self.name == "tpu_interpret":
            jax_env.simulate_tpu_on_cpu()
            return {"interpret": jax_env.tpu_interpret_params(detect_races=detect_races),
                    "num_cores": jax_env.SIMULATED_TPU_CORES}
        if self.name == "mosaic_gpu_interpret":
            return {"interpret": jax_env.gpu_interpret_params(detect_races=detect_races)}
        if self.name == "tpu":  # the chip's TensorCores
            return {"interpret": None, "num_cores": getattr(_jax_tpu(), "num_cores", 1) or 1}
        if self.family == "triton":
            return {} if takes_inputs else {"device": device}
        return {"interpret": None}  # the hardware

    def compiles_for_calling_thread(self, device: torch.device) -> bool:
        """Whether small kernels are compiled for the synchronous JAX CPU
        client (jax_env.synchronous_cpu_device), which runs them on the
        calling thread instead of waking JAX's worker."""
        return self.name == "interpret" and device.type == "cpu"


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("interpret", "tpu", "cpu", simulated=False),
        Backend("mosaic_gpu_interpret", "mosaic_gpu", "cpu", simulated=True),
        Backend("tpu_interpret", "tpu", "cpu", simulated=True),
        Backend("mosaic_gpu", "mosaic_gpu", "cuda", simulated=False),
        Backend("triton", "triton", "cuda", simulated=False),
        Backend("tpu", "tpu", "cpu", simulated=False, float32_allowance=8.0),
    )
}

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "torch_pallas_backend", default=None
)


def get(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"torch_pallas: unknown backend {name!r}; choose one of "
            f"{', '.join(BACKENDS)}"
        ) from None


@contextlib.contextmanager
def backend(name: str | None) -> Iterator[Backend | None]:
    """Runs the calls inside the block on backend `name` (None: the default).

    >>> with torch_pallas.backend("tpu_interpret"):
    ...     torch.ops.pallas.add(x, y)
    """
    chosen = get(name) if name is not None else None
    token = _override.set(name)
    try:
        yield chosen
    finally:
        _override.reset(token)


def _environment_variable(name: str) -> Callable[[], str | None]:
    """`os.environ.get(name)` as a function, read per call as that is, in
    one dict lookup where it can be: os.environ keeps its values in a dict
    by encoded name (`_data`, which setting and deleting update), and
    `get`'s Python costs 1.4 us a call (5 inside a small op's call, 2-core
    CPU), which every op call paid for its backend. Where that dict is not
    there, os.environ.get itself."""
    environ = os.environ
    try:
        data, key, decode = environ._data, environ.encodekey(name), environ.decodevalue
        if not isinstance(data, dict):
            raise TypeError
    except (AttributeError, TypeError):
        return functools.partial(environ.get, name)

    def read() -> str | None:
        value = data.get(key)
        return None if value is None else decode(value)

    return read


_requested_by_environment = _environment_variable(ENV_VAR)


def requested() -> str | None:
    """The explicitly requested backend name, if any (context, then env)."""
    return _override.get() or _requested_by_environment() or None


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _jax_tpu_or_error():
    """(the first TPU device JAX sees, None) or (None, why there is none)."""
    try:
        return jax_env.jax().devices("tpu")[0], None
    except RuntimeError as e:
        return None, str(e).splitlines()[0] if str(e) else type(e).__name__


def _jax_tpu():
    return _jax_tpu_or_error()[0]


def has_tpu() -> bool:
    """Whether JAX sees a TPU here (initialising JAX's TPU backend, which
    holds the chip for this process)."""
    return _jax_tpu() is not None


@functools.cache
def _jax_has_gpu() -> bool:
    try:
        return bool(jax_env.jax().devices("gpu"))
    except RuntimeError:
        return False


def default_for(device: torch.device) -> Backend:
    """The device's backend when none is requested: on CUDA, mosaic_gpu on
    Hopper and newer when JAX has a GPU backend, else triton (an automatic
    choice falls back; an explicit one never does)."""
    if device.type == "cuda":
        major, _ = _cuda_capability(_cuda_index(device))
        return BACKENDS["mosaic_gpu" if major >= 9 and _jax_has_gpu() else "triton"]
    return BACKENDS["interpret"]


def available(device_type: str, *, chips: bool = True) -> list[Backend]:
    """The backends that can run on this machine's `device_type` tensors
    (the benchmarks time each): on CUDA the device's own, on CPU the
    interpreter and both simulators (and Triton's interpreter when it is
    on), and with `chips` the TPU where JAX sees one (`tpu`: asking
    initialises JAX's TPU backend, which holds the chip)."""
    if device_type == "cuda":
        major, _ = _cuda_capability(torch.cuda.current_device())
        return [BACKENDS[n] for n in (["mosaic_gpu"] if major >= 9 else []) + ["triton"]]
    names = ["interpret", "tpu_interpret", "mosaic_gpu_interpret"]
    names += ["triton"] if triton_kernels.interpreting() else []
    return [BACKENDS[n] for n in names + (["tpu"] if chips and has_tpu() else [])]


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def check_serves(b: Backend, device: torch.device, op: str) -> None:
    """Raises BackendError unless backend `b` can run `op` on `device`."""
    if b.family == "triton" and not _triton_installed():
        raise BackendError(
            f"{op}: backend 'triton' needs the triton package (pip install triton, or "
            "torch_pallas[triton]; CUDA builds of torch bring it)"
        )
    if b.name == "triton" and device.type == "cpu":
        if triton_kernels.interpreting():
            return
        raise BackendError(
            f"{op}: backend 'triton' runs CPU tensors only under "
            "TRITON_INTERPRET=1 (got a tensor on cpu)"
        )
    if b.name == "tpu" and device.type == "cpu" and _jax_tpu() is None:
        raise BackendError(
            f"{op}: backend 'tpu' runs on the TPU JAX sees, and JAX sees none here "
            f"(jax.devices('tpu'): {_jax_tpu_or_error()[1]}); on a TPU machine install "
            "jax[tpu]"
        )
    if device.type != b.device_type:
        raise BackendError(
            f"{op}: backend {b.name!r} runs on {b.device_type} tensors, "
            f"got a tensor on {device}"
        )
    if b.name == "mosaic_gpu":
        major, minor = _cuda_capability(_cuda_index(device))
        if major < 9:
            raise BackendError(
                f"{op}: backend 'mosaic_gpu' needs compute capability 9.0+ "
                f"(Hopper or newer); {device} has {major}.{minor}"
            )


def fall_back(device: torch.device, op: str, backend: Backend, reason: str) -> Backend:
    """The backend for a call `backend` cannot run (`reason`, a sentence
    after the backend's name): an automatic choice falls back to triton; an
    explicit request raises."""
    if requested() is not None:
        raise BackendError(f"{op}: backend {backend.name!r} {reason}")
    fallback = BACKENDS["triton"]
    check_serves(fallback, device, op)
    return fallback


def select(device: torch.device, op: str) -> Backend:
    """The backend for a call of `op` on `device`: requested, else default."""
    name = requested()
    b = get(name) if name is not None else default_for(device)
    check_serves(b, device, op)
    return b


def choice_is_stable(backend: Backend, device: torch.device) -> bool:
    """Whether a call's backend, once chosen, may be remembered for the same
    call signature: not Triton on CPU tensors, allowed only while
    TRITON_INTERPRET is set (read per call)."""
    return not (backend.family == "triton" and device.type == "cpu")


def default_device() -> torch.device:
    """The device whose backends this machine runs best: a GPU if torch has
    one, else the CPU (the health report and the benchmarks use it)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def traces_to_triton(device: torch.device) -> bool:
    """Whether torch.compile traces calls on `device` into the ops' Triton
    kernels (torch_pallas/runtime/compile_path.py): on CUDA; elsewhere an op stays
    one opaque call."""
    return device.type == "cuda"


def jax_device(device: torch.device, backend: Backend | None = None):
    """The JAX device that runs `backend`'s kernels for torch `device`: the
    TPU for the `tpu` backend, else the device's own."""
    if backend is not None and backend.name == "tpu":
        return _jax_tpu()
    return _jax_device(device)


@functools.cache
def _jax_device(device: torch.device):
    jax = jax_env.jax()
    if device.type == "cpu":
        return jax.devices("cpu")[0]
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as e:
        raise BackendError(
            f"torch_pallas: JAX has no GPU backend for {device} (install a CUDA "
            f"build of jaxlib, e.g. pip install 'jax[cuda12]'): {e}"
        ) from None
    return gpus[device.index or 0]
