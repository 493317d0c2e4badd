"""The torch ops (`torch.ops.pallas.*`): one file per op with its
`torch.library` definition, fake (meta) function and autograd.

Importing this package registers the ops; it does not import JAX.
"""

from torch_pallas.ops import add, fill, iota, matmul  # noqa: F401  (registers the ops)
