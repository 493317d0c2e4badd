"""torch_pallas: Pallas kernels (JAX's kernel language) as PyTorch operators.

`import torch_pallas` registers `torch.ops.pallas.fill`, `iota`, `add` and
`matmul` (it does not import JAX; the first kernel call does). Backends:
`torch_pallas.backends`; choose one with `TORCH_PALLAS_BACKEND=name` or
`with torch_pallas.backend(name):`.
"""

from torch_pallas import nn, ops  # noqa: F401  (ops registers torch.ops.pallas.*)
from torch_pallas.backends import BACKENDS, BackendError, backend
from torch_pallas.compile_cache import clear as clear_cache
from torch_pallas.functional import add, fill, iota, linear, matmul
from torch_pallas.launch import RaceDetectedError, race_detection
from torch_pallas.library import custom_op

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "BackendError",
    "RaceDetectedError",
    "add",
    "backend",
    "clear_cache",
    "custom_op",
    "fill",
    "iota",
    "linear",
    "matmul",
    "nn",
    "race_detection",
]
