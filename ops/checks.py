"""Argument checks shared by the op files: each raises before any kernel
runs, with a message naming the op, the argument and the offending value."""

from __future__ import annotations

import sys

import torch

from torch_pallas.base import dtypes, torch_compat
from torch_pallas.runtime import compile_path


class RefusedLikeTorch(RuntimeError, ValueError):
    """An input torch's own op refuses too (shapes that do not broadcast,
    tensors on two devices, a value past the dtype's range): a RuntimeError,
    the type torch raises for it, and a ValueError, the type these checks
    raised before, so `except ValueError` written for them keeps working."""


def tensor(op: str, name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise TypeError(f"{op}: {name} must be a dense (strided) tensor, got layout {value.layout}")


def dtype_in(op: str, name: str, dtype: torch.dtype, supported) -> None:
    """A tensor argument's dtype (`name` is the tensor's)."""
    if dtype not in supported:
        raise TypeError(
            f"{op}: {name} has dtype {dtype}, which is not supported; "
            f"supported: {dtypes.names(supported)}"
        )


def dtype_argument(op: str, dtype: torch.dtype, supported) -> None:
    """A factory op's `dtype=` argument."""
    if dtype not in supported:
        raise TypeError(
            f"{op}: dtype={dtype} is not supported; supported: {dtypes.names(supported)}"
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
        raise RefusedLikeTorch(
            f"{op}: {names[0]} and {names[1]} must be on the same device, got "
            f"{names[0]} on {x.device} and {names[1]} on {y.device}"
        )


def require(condition, message) -> None:
    """`torch._check(condition, message)`: RuntimeError with `message()`
    unless `condition` holds. A plain bool (an eager call's sizes) is
    answered here: torch._check's first call imports torch's symbolic-shapes
    module and sympy (0.38 s on the 2-core CPU, in a process's first op
    call); a SymBool (under torch.compile) goes to torch._check, which
    records it without forcing it to a bool."""
    if condition is True:
        return
    if condition is False:
        raise RuntimeError(message())
    torch._check(condition, message)


def size(op: str, name: str, value) -> None:
    """A size: an int (or a SymInt under torch.compile) >= 0. A negative one
    raises RuntimeError, as torch's factories do; through `require`, because
    comparing a SymInt must not force it to a Python bool (that would
    specialise a compiled graph on the size)."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{op}: {name} must be an int, got {value!r}")
    require(value >= 0, lambda: f"{op}: {name} must be >= 0, got {value}")


def factory_device(op: str, device, *, fake: bool = False) -> torch.device:
    """The device a factory op creates on: a CUDA device without an index is
    the current one, as for torch's factories. A CUDA device this process
    cannot use raises the exception type torch.full raises for it, naming
    `op`: AssertionError where torch is built without CUDA, RuntimeError
    where it sees no GPU or not that index.

    `fake` (the op's fake function: torch.compile, export), like a trace of
    the op into its Triton kernels (torch_pallas/runtime/compile_path.py), checks nothing:
    a graph may be traced for a GPU the tracing machine lacks, as torch's own
    factories may be under fake tensors; the implementation checks when it
    runs. A missing index is then the one FakeTensor itself picks."""
    device = torch.device(device) if device is not None else torch_compat.default_device()
    if device.type != "cuda":
        return device
    if fake or compile_path.tracing_triton():  # traced into the Triton kernels, not run
        if device.index is None:
            index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
            device = torch.device("cuda", index)
        return device
    if not torch.backends.cuda.is_built():
        raise AssertionError(
            f"{op}: device={device} was asked for, but this torch is not compiled with "
            "CUDA enabled (a CPU-only build); use device='cpu' or a CUDA build of torch"
        )
    count = torch.cuda.device_count()
    if count == 0:
        raise RuntimeError(
            f"{op}: device={device} was asked for, but torch sees no CUDA GPU "
            "(torch.cuda.device_count() == 0: no driver, or CUDA_VISIBLE_DEVICES hides them)"
        )
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    if device.index >= count:
        raise RuntimeError(
            f"{op}: device={device} does not exist; torch sees {count} CUDA "
            f"GPU{'s' if count > 1 else ''}: {', '.join(f'cuda:{i}' for i in range(count))}"
        )
    return device


def caller_device(device):
    """`device`, or torch's default device as the caller sees it (`with
    torch.device(...)` included, which the op itself, called inside that
    mode, no longer sees): for the factory ops' Python functions. Dynamo
    cannot trace the lookup: a compiled call leaves it to the op."""
    if device is None and not torch.compiler.is_compiling():
        return torch_compat.default_device()
    return device


def normalized(op: str, input: torch.Tensor, normalized_shape, params: dict, supported) -> None:
    """A norm's arguments (rms_norm, layer_norm): `input` a tensor of a
    `supported` dtype whose last dimensions are `normalized_shape` (not
    empty), and each of `params` (name -> tensor or None: weight, bias) of
    that shape, a supported dtype, on the input's device."""
    tensor(op, "input", input)
    dtype_in(op, "input", input.dtype, supported)
    shape = tuple(normalized_shape)
    if not shape or input.dim() < len(shape) or tuple(input.shape[-len(shape):]) != shape:
        raise RefusedLikeTorch(
            f"{op}: normalized_shape={list(shape)} must be the input's last dimensions "
            f"and not empty; got input.shape={tuple(input.shape)}")
    for name, param in params.items():
        if param is None:
            continue
        tensor(op, name, param)
        dtype_in(op, name, param.dtype, supported)
        same_device(op, input, param, names=("input", name))
        if tuple(param.shape) != shape:
            raise RefusedLikeTorch(
                f"{op}: {name}.shape={tuple(param.shape)} must equal "
                f"normalized_shape={list(shape)}")


def is_dtensor(t) -> bool:
    """Whether `t` is a DTensor (without importing torch.distributed.tensor,
    a second's import, where nobody has made one)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def merged_normalized(input: torch.Tensor, normalized_shape) -> torch.Tensor:
    """A norm's input with its normalized dimensions merged into the last
    one (itself where there is one: the leading dimensions, and a DTensor's
    sharding along them, are never touched)."""
    count = len(normalized_shape)
    return input if count == 1 else input.flatten(-count)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., N) as the rows (R, N) a row-wise kernel reads (a copy only
    where the layout needs one); x itself when it has two dimensions."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def flat(parameter: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """A norm's weight or bias as the (N,) its kernels read (None stays
    None): itself where it has one dimension, a reshape otherwise."""
    return parameter if parameter is None or parameter.dim() == 1 else parameter.reshape(n)


def shaped(t: torch.Tensor, shape) -> torch.Tensor:
    """A kernel's fresh result `t` viewed as `shape`, or `t` itself where it
    has that shape already: a view is a dispatcher call, several us of a
    decode step's small call."""
    return t if t.shape == shape else t.view(shape)
