"""torch_pallas: Pallas kernels (JAX's kernel language) as PyTorch operators.

`import torch_pallas` registers every op of ops/ (`torch.ops.pallas.fill`,
`iota`, `add`, `matmul`, `attention`, ...) and makes each a function here
(`torch_pallas.matmul`), beside `linear`, the backends' controls, the
errors and `custom_op`. It does not import JAX; the first kernel call does.
Choose a backend with `TORCH_PALLAS_BACKEND=name` or
`with torch_pallas.backend(name):`.

The package in layers, each importing only the layers below it
(tests/test_layering.py holds the rule):

- `torch_pallas.kernels` (kernels/): the Pallas and Triton kernels, pure JAX
  and Triton;
- `base/`: the package's errors and dtypes, and the one place for torch's
  and JAX's private APIs;
- `runtime/`: one call from torch tensors to a compiled kernel and back
  (backends, the op registry, launch, compilation and caches, the bridge);
- `library/`: defining torch ops on the runtime (torch.library schema,
  fake, autograd, autocast, the torch.compile path, FLOP formulas);
- `torch_pallas.ops` (ops/): the shipped ops, one file each; `custom_ops/`:
  users' JAX functions as ops (`custom_op`);
- integrations, on the ops: `nn/` (layers and `replace_linear`),
  `distributed/`, `jax/` (`torch_pallas.jax`: the ops as functions of JAX
  arrays, on the same kernels); above `nn/`, `transformers/` (`attn_implementation=
  "pallas"`, and `apply`, which puts a model on every op); `torchax` and
  `torch_tpu` (the ops on those libraries' tensors, through `jax/`);
- this module and `__main__` (the environment report) on top.
"""

from torch_pallas import nn, ops
from torch_pallas.base import VERSION as __version__
from torch_pallas.base.errors import (BackendError, BackendLimitError, FineGridWarning,
                                      RaceDetectedError)
from torch_pallas.runtime.registry import ops as _registered_ops
from torch_pallas.runtime.backends import BACKENDS, backend
from torch_pallas.runtime.compile_cache import clear as clear_cache
from torch_pallas.runtime.simulators import race_detection
from torch_pallas.custom_ops import custom_op
from torch_pallas.ops.matmul import linear
from torch_pallas.distributed import register_when_dtensor_loads
from torch_pallas import torch_tpu as _torch_tpu

register_when_dtensor_loads()  # the ops' sharding rules, once DTensor is loaded
_torch_tpu.register_if_loaded()  # tpu kernels where torch_tpu is loaded (it imports nothing else)

_OPS = [info.name for info in _registered_ops()]
globals().update({info.name: info.function for info in _registered_ops()})

__all__ = [
    "BACKENDS",
    "BackendError",
    "BackendLimitError",
    "FineGridWarning",
    "RaceDetectedError",
    "backend",
    "clear_cache",
    "custom_op",
    "linear",
    "nn",
    "race_detection",
    *_OPS,
]


# The integrations `import torch_pallas` leaves unloaded, each imported when
# first named (`torch_pallas.torchax.register()`): `jax` imports JAX,
# `transformers`'s register imports transformers.
_LAZY = ("jax", "torchax", "torch_tpu", "transformers", "trl")


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"torch_pallas.{name}")
    raise AttributeError(f"module 'torch_pallas' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_LAZY})
