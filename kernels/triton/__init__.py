"""Triton kernels: the torch.compile path on CUDA (Inductor launches them
itself), the eager path on CUDA GPUs older than Hopper, and, under
TRITON_INTERPRET=1, a CPU path for testing.

These take and return torch tensors (no JAX). Each launcher takes `wrap`:
identity for an eager launch, `torch.library.wrap_triton` when the op is
being traced, so the launch is recorded as a Triton kernel in the graph.
TRITON_INTERPRET must be set before these modules are first imported:
`triton.jit` decides at decoration time whether to interpret.
"""


import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """The one knob of the one-program-per-block kernels (fill, iota, add)."""

    block: int = 1024  # elements per program

    @classmethod
    def default(cls, backend: str) -> "BlockConfig":
        return cls()  # the same on every GPU


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreter_safe_dtype(dtype):
    """The dtype a kernel writes a `dtype` result in.

    Triton's CPU interpreter (3.8) rounds float32 -> bfloat16 toward zero,
    converts int32 -> bfloat16 bitwise and computes bfloat16 `tl.dot`
    wrongly; under it, bfloat16 results are written in float32 and rounded
    by torch (`.to(torch.bfloat16)`, round to nearest even). Compiled
    kernels write bfloat16 directly.
    """
    import torch

    return torch.float32 if dtype == torch.bfloat16 and interpreting() else dtype


def direct(kernel):
    """An eager launch: the kernel itself."""
    return kernel
