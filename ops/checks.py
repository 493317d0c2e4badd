"""Argument checks shared by the op files: each raises before any kernel
runs, with a message naming the op, the argument and the offending value."""

from __future__ import annotations

import torch

from torch_pallas import dtypes


def tensor(op: str, name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise TypeError(f"{op}: {name} must be a dense (strided) tensor, got layout {value.layout}")


def dtype_in(op: str, name: str, dtype: torch.dtype, supported) -> None:
    if dtype not in supported:
        raise TypeError(
            f"{op}: {name} has dtype {dtype}, which is not supported; "
            f"supported: {dtypes.names(supported)}"
        )


def same_dtype(op: str, x: torch.Tensor, y: torch.Tensor, names=("x", "y")) -> None:
    if x.dtype != y.dtype:
        raise TypeError(
            f"{op}: {names[0]} and {names[1]} must have the same dtype, got "
            f"{names[0]}.dtype={x.dtype} and {names[1]}.dtype={y.dtype} "
            "(convert one explicitly)"
        )


def same_device(op: str, x: torch.Tensor, y: torch.Tensor, names=("x", "y")) -> None:
    if x.device != y.device:
        raise ValueError(
            f"{op}: {names[0]} and {names[1]} must be on the same device, got "
            f"{names[0]} on {x.device} and {names[1]} on {y.device}"
        )


def size(op: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{op}: {name} must be an int, got {value!r}")
    torch._check(value >= 0, lambda: f"{op}: {name} must be >= 0, got {value}")


def factory_device(device) -> torch.device:
    """The device a factory op creates on: a CUDA device without an index is
    the current one, as for torch's factories."""
    device = torch.device(device) if device is not None else torch.get_default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def caller_device(device):
    """`device`, or torch's default device as the caller sees it (`with
    torch.device(...)` included, which the op itself, called inside that
    mode, no longer sees): for the factory ops' Python functions. Dynamo
    cannot trace the lookup: a compiled call leaves it to the op."""
    if device is None and not torch.compiler.is_compiling():
        return torch.get_default_device()
    return device
