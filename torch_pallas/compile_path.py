"""The torch.compile path on CUDA: ops decompose into their Triton kernels.

`torch.library.triton_op` is `custom_op` + `register_fake` +
`register_torch_dispatch(FunctionalTensorMode, decomposition)`. The ops here
are custom ops that run Pallas kernels eagerly, so they take the third call
alone: when AOTAutograd traces an op on CUDA tensors, its Python
implementation runs again under FunctionalTensorMode with kernels launched
through `torch.library.wrap_triton`, and the graph holds the Triton kernel
(`triton_kernel_wrapper_functional`), which Inductor compiles and schedules
like its own code (no call into JAX, CUDA graphs possible). On other devices
the op stays one opaque call, which runs the Pallas kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torch_pallas import launch


def _on_cuda(args, kwargs) -> bool:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type == "cuda"
    device = kwargs.get("device")  # factory ops
    device = torch.device(device) if device is not None else torch.get_default_device()
    return device.type == "cuda"


def decompose_to_triton_on_cuda(op: torch._ops.OpOverload, implementation: Callable,
                                lib: torch.library.Library) -> None:
    """Registers (in `lib`) `implementation`, the op's Python body, to be
    traced with Triton kernels whenever `op` is traced on CUDA tensors."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    known_types = (torch.Tensor, FunctionalTensor, FakeTensor)

    def decomposition(mode, func, types, args, kwargs):
        if any(not issubclass(t, known_types) for t in types):
            return NotImplemented
        if not _on_cuda(args, kwargs):
            return mode.__torch_dispatch__(func, types, args, kwargs)
        with mode, launch.tracing_triton():
            return implementation(*args, **kwargs)

    torch.library.register_torch_dispatch(op, FunctionalTensorMode, decomposition, lib=lib)
