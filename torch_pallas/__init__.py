"""torch_pallas: Pallas kernels (JAX's kernel language) as PyTorch operators.

`import torch_pallas` registers every op of ops/ (`torch.ops.pallas.fill`,
`iota`, `add`, `matmul`, `attention`, ...; torch_pallas.registry lists them) and makes
each a function here (`torch_pallas.matmul`). It does not import JAX; the
first kernel call does. Backends: `torch_pallas.backends`; choose one with
`TORCH_PALLAS_BACKEND=name` or `with torch_pallas.backend(name):`.
"""

from torch_pallas import functional, nn, registry
from torch_pallas.backends import BACKENDS, backend
from torch_pallas.compile_cache import clear as clear_cache
from torch_pallas.custom_ops import custom_op
from torch_pallas.errors import BackendError, BackendLimitError, FineGridWarning, RaceDetectedError
from torch_pallas.functional import linear
from torch_pallas.simulators import race_detection

__version__ = "0.1.0"

_OPS = [info.name for info in registry.ops()]
globals().update({name: getattr(functional, name) for name in _OPS})

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


def __getattr__(name: str):
    # `torch_pallas.transformers` imports transformers: loaded when first used.
    if name == "transformers":
        import importlib

        return importlib.import_module("torch_pallas.transformers")
    raise AttributeError(f"module 'torch_pallas' has no attribute {name!r}")
