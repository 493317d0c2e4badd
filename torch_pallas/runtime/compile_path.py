"""The torch.compile path on CUDA: ops decompose into their Triton kernels.

`torch.library.triton_op` is `custom_op` + `register_fake` +
`register_torch_dispatch(FunctionalTensorMode, decomposition)`. The ops here
are custom ops that run Pallas kernels eagerly, so they take the third call
alone: when AOTAutograd traces an op on CUDA tensors, its Python
implementation runs again under FunctionalTensorMode with kernels launched
through `torch.library.wrap_triton` (`tracing_triton()` is then true), and
the graph holds the Triton kernel (`triton_kernel_wrapper_functional`),
which Inductor compiles and schedules like its own code (no call into JAX,
CUDA graphs possible). On other devices the op stays one opaque call, which
runs the Pallas kernels.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch

from torch_pallas.base import torch_compat
from torch_pallas.runtime import backends

_tracing_triton: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "torch_pallas_tracing_triton", default=False
)


def tracing_triton() -> bool:
    """Whether an op is being traced into its Triton kernels now."""
    return _tracing_triton.get()


@contextlib.contextmanager
def _tracing() -> Iterator[None]:
    token = _tracing_triton.set(True)
    try:
        yield
    finally:
        _tracing_triton.reset(token)


def _device(args, kwargs) -> torch.device:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    device = kwargs.get("device")  # factory ops
    return torch.device(device) if device is not None else torch.get_default_device()


def decompose_to_triton(op, implementation: Callable, lib: torch.library.Library) -> bool:
    """Registers (in `lib`) `implementation`, the op's Python body, to be
    traced with Triton kernels whenever `op` (an OpOverload) is traced on a
    device whose compiled graphs hold Triton kernels. False (nothing
    registered, the op stays opaque under torch.compile) on a torch without
    the tensor subclasses this needs."""
    subclasses = torch_compat.tracing_tensor_types()
    if subclasses is None:
        return False
    known_types, functional_mode = subclasses

    def decomposition(mode, func, types, args, kwargs):
        if any(not issubclass(t, known_types) for t in types):
            return NotImplemented
        if not backends.traces_to_triton(_device(args, kwargs)):
            return mode.__torch_dispatch__(func, types, args, kwargs)
        with mode, _tracing():
            return implementation(*args, **kwargs)

    torch.library.register_torch_dispatch(op, functional_mode, decomposition, lib=lib)
    return True
