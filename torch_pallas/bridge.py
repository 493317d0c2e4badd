"""Tensors across the torch/JAX border through DLPack, without copies.

A contiguous tensor crosses as a view of the same memory in both directions
(`jax.dlpack.from_dlpack(tensor)`, `torch.from_dlpack(array)`); on CUDA the
DLPack protocol's stream argument orders the two libraries' streams. What
DLPack cannot take directly is made acceptable first, never reinterpreted:

- a tensor that requires grad is detached (torch refuses to export it);
- an expanded (stride 0), transposed or otherwise strided tensor is made
  contiguous (one copy; JAX rejects stride-0 and reorders the rest anyway);
- a contiguous tensor whose size-1 dimensions carry unusual strides is
  re-viewed with row-major strides (no copy), since JAX would otherwise
  import it with a non-default layout that compiled kernels refuse;
- 64-bit dtypes are refused: JAX without x64 narrows them to 32 bits silently.
"""

from __future__ import annotations

import torch

from torch_pallas import jax_env

NARROWED_BY_JAX = frozenset({torch.float64, torch.int64, torch.complex128})


def to_jax(tensor: torch.Tensor):
    """A JAX array over the same memory as `tensor` (a copy only when the
    layout or requires_grad forbids sharing)."""
    if tensor.dtype in NARROWED_BY_JAX:
        raise TypeError(
            f"torch_pallas: {tensor.dtype} cannot cross to JAX without being "
            "narrowed to 32 bits; convert it explicitly first"
        )
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    strides = row_major_strides(tensor.shape)
    if tensor.stride() != strides:
        tensor = tensor.as_strided(tensor.shape, strides)
    return jax_env.jax().dlpack.from_dlpack(tensor)


def row_major_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def to_torch(array) -> torch.Tensor:
    """A torch tensor over the same memory as the JAX array `array`."""
    return torch.from_dlpack(array)


def shares_memory(tensor: torch.Tensor, array) -> bool:
    """Whether `tensor` and the JAX `array` are one buffer (zero copy)."""
    return tensor.data_ptr() == array.unsafe_buffer_pointer()
