"""Tensors across the torch/JAX border without copies.

A contiguous tensor crosses as a view of the same memory in both directions:
CPU tensors into JAX as NumPy views (`to_kernel_argument`, `to_jax`), CUDA
tensors through DLPack, whose stream argument orders the two libraries'
streams, and results back through DLPack (`torch.from_dlpack(array)`). What
DLPack cannot take directly is made acceptable first, never reinterpreted:

- a tensor that requires grad is detached (torch refuses to export it);
- an expanded (stride 0), transposed or otherwise strided tensor is made
  contiguous (one copy; JAX rejects stride-0 and reorders the rest anyway);
- a contiguous tensor whose size-1 dimensions carry unusual strides is
  re-viewed with row-major strides (no copy), since JAX would otherwise
  import it with a non-default layout that compiled kernels refuse (NumPy
  views need no such care: NumPy's contiguity ignores those strides);
- 64-bit dtypes are refused unless JAX's 64-bit mode is on (a custom op's
  kernel with 64-bit tensors runs under it): without it JAX narrows them to
  32 bits silently.

Per call, the protocol's Python on both sides costs more than a small
kernel, so the crossings call jaxlib's capsule import/export directly (CPU
capsules from torch's C exporter; CUDA keeps the protocol, which orders the
streams). Each direct path is checked once against the public API on a probe
and replaced by it if they disagree, as they may on another JAX version.
Kernel launches hand CPU tensors over as NumPy views instead
(`to_kernel_argument`), which a compiled JAX function imports in C++ for
less than a DLPack import costs.
"""

from __future__ import annotations

import functools
import weakref

import numpy as np
import torch

from torch_pallas.base import jax_env

NARROWED_BY_JAX = frozenset({torch.float64, torch.int64, torch.complex128})
CPU_DL_DEVICE = 1  # DLPack's kDLCPU


def to_jax(tensor: torch.Tensor, device=None):
    """A JAX array over the same memory as `tensor`. `device`, for a CPU
    tensor: the JAX CPU device to put it on, of JAX's client or of the
    package's synchronous one (default: JAX's first CPU device); a CUDA
    tensor stays on its GPU. A copy is made only where the layout or
    requires_grad forbids sharing (see the module's notes) or, on CPU,
    where the data is not 64-byte aligned (a view at an odd offset, which
    DLPack's import copies too; torch's CPU allocations are aligned).
    Writes to the tensor show in the array and must not race a computation
    reading it.

    A CPU tensor goes as its NumPy view (`to_kernel_argument`) through
    `jax.device_put`, not as a DLPack capsule, so that exiting is safe: the
    array keeps the tensor alive by a Python reference, which jaxlib, when
    one of its worker threads frees the array, queues for a thread holding
    the GIL to drop, and never drops on the worker. A process may thus exit
    while computations on these arrays still run. A DLPack import left the
    tensor to torch's deleter on whichever thread freed the array last:
    where the tensor's Python object had died and a computation on JAX's
    asynchronous CPU client was still running, the worker finishing it
    took the GIL, and if the interpreter was shutting down by then, CPython
    ended that thread inside jaxlib and the process aborted (SIGABRT,
    "terminate called without an active exception"; tests/test_exit.py).
    The price is jax.device_put's Python: ~90 µs a call against 6-10 µs
    for the DLPack import (2-core VM), nothing for inputs prepared once, as
    the benchmarks' are; kernel launches take `to_kernel_argument`'s views
    directly. CUDA tensors cross by DLPack's protocol, which orders the two
    libraries' streams."""
    tensor = row_major(shareable(tensor))
    if tensor.device.type == "cpu":
        jax = jax_env.jax()
        return jax.device_put(to_kernel_argument(tensor), device or jax.devices("cpu")[0])
    return _importer()(tensor)


def to_kernel_argument(tensor: torch.Tensor):
    """What a compiled kernel takes for `tensor`, sharing its memory like
    `to_jax`. A CPU tensor goes as a NumPy view: a compiled JAX function
    imports NumPy arguments in C++, for a third of a DLPack import's cost,
    and as DLPack does, without a copy when the data is 64-byte aligned (a
    copy otherwise), onto whichever CPU client the kernel was compiled for.
    bfloat16 and float8, which NumPy lacks, are viewed as ml_dtypes' types
    (JAX's)."""
    tensor = shareable(tensor)
    if tensor.device.type != "cpu":
        return _importer()(row_major(tensor))
    return _numpy_view(tensor.dtype)(tensor)


def kernel_argument_maker(dtype: torch.dtype):
    """`to_kernel_argument` for CPU tensors of `dtype`, its dtype's
    decisions taken once: what a caller that launches one kernel many times
    (launch.bound, matmul's linear plans) converts each call's tensors with."""
    if dtype in NARROWED_BY_JAX:  # depends on JAX's 64-bit mode at each call
        return to_kernel_argument
    view = _numpy_view(dtype)
    return lambda tensor: view(_detached_contiguous(tensor))


@functools.cache
def _numpy_view(dtype: torch.dtype, keep_alive: bool = True):
    """The NumPy view of a shareable CPU tensor of `dtype` (see
    `numpy_view`): bfloat16 and float8, which NumPy lacks, as ml_dtypes'
    types (JAX's)."""
    if dtype not in _BIT_VIEWS:
        return numpy_view if keep_alive else functools.partial(numpy_view, keep_alive=False)
    bits, name = _BIT_VIEWS[dtype]
    ml_dtype = _ml_dtype(name)
    return lambda tensor: numpy_view(tensor.view(bits), keep_alive=keep_alive).view(ml_dtype)


class _TensorMemory:
    """What NumPy reads a tensor's memory from (its `__array_interface__`),
    and what keeps the tensor alive: the view's base."""

    __slots__ = ("__array_interface__", "tensor")


def numpy_view(tensor: torch.Tensor, *, keep_alive: bool = True):
    """A NumPy array over a contiguous CPU tensor's memory (no copy), of a
    dtype NumPy has, leaving the tensor exactly as it was.

    Not `Tensor.numpy()`: torch's export marks the tensor's storage
    non-resizable for good (torch/csrc/utils/tensor_numpy.cpp), and FSDP2
    frees an unsharded parameter after each use by resizing its storage to
    0, which then fails ("Trying to resize storage that is not resizable").
    NumPy reads this view from the data pointer instead, through an object
    that holds the tensor for the view's lifetime; 0.6 us more a call than
    Tensor.numpy() (2-core CPU). Without `keep_alive` it holds nothing:
    the caller sees that the memory lives while the view is read
    (`kept_array`)."""
    memory = _TensorMemory()
    memory.tensor = tensor if keep_alive else None
    memory.__array_interface__ = {
        "data": (tensor.data_ptr(), False), "shape": tuple(tensor.shape),
        "typestr": _typestr(tensor.dtype), "version": 3,
    }
    return np.asarray(memory)


@functools.cache
def _typestr(dtype: torch.dtype) -> str:
    """NumPy's name of `dtype` (read off an empty tensor of it, once)."""
    return torch.empty(0, dtype=dtype).numpy().dtype.str


# dtype -> (an integer dtype of its width, ml_dtypes' name of the type).
_BIT_VIEWS = {
    torch.bfloat16: (torch.int16, "bfloat16"),
    torch.float8_e4m3fn: (torch.uint8, "float8_e4m3fn"),
    torch.float8_e5m2: (torch.uint8, "float8_e5m2"),
}


@functools.cache
def _ml_dtype(name: str):
    import ml_dtypes  # JAX's own dependency

    return getattr(ml_dtypes, name)


# (id(tensor), JAX device, shape) -> (weak reference to the tensor, its data
# pointer, the array or None where JAX copied it)
_kept: dict[tuple, tuple] = {}


def kept_array(tensor: torch.Tensor, device, shape: tuple):
    """A JAX array on the CPU `device`, of `shape` (the tensor's own, with
    size-1 dimensions added or removed), over the memory of `tensor`, a
    contiguous CPU tensor that lives across many calls (a linear layer's
    weight in a decode loop): made once, and kept while the same tensor
    object holds the same memory (its data pointer is compared at each
    call; a parameter given new data (`.data = ...`), or its storage freed
    and allocated again elsewhere (FSDP2), is crossed anew). A weight
    crossed anew at each call cost 9 us (256 x 512) to 24 us (1376 x 512)
    more per kernel call than one crossed once (2-core CPU: JAX imports a
    NumPy argument it has not seen for longer than one it keeps).

    The array keeps nothing alive: it is read only while its caller holds
    `tensor`, and dropped when the tensor is collected. Writes to the
    tensor (an optimizer step) show in it, as in every crossing here, and
    must not race a computation reading it. None where JAX would copy the
    memory instead of sharing it (unaligned data): the caller crosses the
    tensor at each call then."""
    key = (id(tensor), device, shape)
    found = _kept.get(key)
    if found is not None and found[0]() is tensor and found[1] == tensor.data_ptr():
        return found[2]
    view = _numpy_view(tensor.dtype, False)(tensor).reshape(shape)
    array = jax_env.jax().device_put(view, device)
    if array.unsafe_buffer_pointer() != tensor.data_ptr():
        array = None  # a copy: it would not follow the tensor's writes

    def forget(_, key=key):
        _kept.pop(key, None)

    _kept[key] = (weakref.ref(tensor, forget), tensor.data_ptr(), array)
    return array


def shareable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in a form JAX imports as it is (see the module's notes)."""
    if tensor.dtype in NARROWED_BY_JAX and not jax_env.x64_enabled():
        raise TypeError(
            f"torch_pallas: {tensor.dtype} cannot cross to JAX without being "
            "narrowed to 32 bits; convert it explicitly first"
        )
    return _detached_contiguous(tensor)


def _detached_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor


def row_major(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous `tensor` viewed with row-major strides: contiguous
    strides are row-major except along size-1 (and in empty) tensors, where
    torch leaves them free."""
    shape = tensor.shape
    if 1 in shape or 0 in shape:
        strides = row_major_strides(shape)
        if tensor.stride() != strides:
            tensor = tensor.as_strided(shape, strides)
    return tensor


def _from_dlpack_public(tensor: torch.Tensor):
    return jax_env.jax().dlpack.from_dlpack(tensor)


def _direct_importer():
    """jax.dlpack.from_dlpack without its per-call Python: the target device
    and stream are looked up once per device, and the dtype canonicalisation
    (a jnp.asarray call, most of the cost) is skipped, since 64-bit dtypes
    never get here. CPU tensors leave through torch's C exporter (no streams
    to order); CUDA ones through the protocol, which orders torch's stream
    before JAX's."""
    to_buffer = jax_env.dlpack_to_buffer()
    to_dlpack = torch.utils.dlpack.to_dlpack
    cpu_device, cpu_stream = jax_env.dlpack_import_target(CPU_DL_DEVICE, 0)

    def from_dlpack(tensor: torch.Tensor):
        if tensor.device.type == "cpu":
            return to_buffer(to_dlpack(tensor), cpu_device, cpu_stream, CPU_DL_DEVICE)
        dl_device_type, device_id = tensor.__dlpack_device__()
        device, stream = jax_env.dlpack_import_target(int(dl_device_type), device_id)
        return to_buffer(tensor.__dlpack__(stream=stream), device, stream, int(dl_device_type))

    return from_dlpack


@functools.cache
def _importer():
    """The direct import when it gives what the public API gives on this
    JAX (checked once on a probe tensor), else jax.dlpack.from_dlpack."""
    try:
        direct = _direct_importer()
        probe = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        mine, public = direct(probe), _from_dlpack_public(probe)
        same = (
            mine.shape == public.shape
            and mine.dtype == public.dtype
            and mine.unsafe_buffer_pointer() == probe.data_ptr()
            and bool((mine == public).all())
        )
        return direct if same else _from_dlpack_public
    except Exception:  # a JAX whose internals differ: the public API
        return _from_dlpack_public


def row_major_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def to_torch(array) -> torch.Tensor:
    """A torch tensor over the same memory as the JAX array `array`."""
    return _exporter()(array)


def device_to_torch(array) -> torch.Tensor:
    """A CPU torch tensor holding a copy of the JAX array `array`, which
    lives on a device torch does not see (a TPU): copied to JAX's CPU
    device, then shared with torch as `to_torch` does."""
    jax = jax_env.jax()
    return to_torch(jax.device_put(array, jax.devices("cpu")[0]))


def cpu_to_torch():
    """`to_torch` for arrays known to be on a CPU (a CPU kernel's results),
    without the per-call check of their device."""
    exporter = _exporter()
    return _cpu_array_to_torch if exporter is _to_torch_direct else exporter


def _to_torch_public(array) -> torch.Tensor:
    return torch.from_dlpack(array)


def _to_torch_direct(array) -> torch.Tensor:
    """torch.from_dlpack(array) without the protocol's Python on both sides,
    for CPU arrays (no streams to order); like the public path, the export
    waits until the array is computed."""
    (device,) = array.devices()
    if device.platform != "cpu":  # CUDA: the protocol orders the streams
        return torch.from_dlpack(array)
    return _cpu_array_to_torch(array)


def _cpu_array_to_torch(array) -> torch.Tensor:
    # The array itself, not its addressable_data(0), whose first call on a
    # fresh array costs more than the rest of the export.
    capsule = jax_env.buffer_to_dlpack()(array, stream=None)
    return torch.utils.dlpack.from_dlpack(capsule)


@functools.cache
def _exporter():
    """The direct export when it gives what torch.from_dlpack gives on this
    JAX (checked once on a probe array), else torch.from_dlpack."""
    try:
        probe = jax_env.jax().numpy.arange(6, dtype="float32").reshape(2, 3)
        direct, public = _to_torch_direct(probe), _to_torch_public(probe)
        same = (
            direct.shape == public.shape
            and direct.dtype == public.dtype
            and direct.data_ptr() == probe.unsafe_buffer_pointer()
            and torch.equal(direct, public)
        )
        return _to_torch_direct if same else _to_torch_public
    except Exception:  # a JAX whose internals differ: the public API
        return _to_torch_public

