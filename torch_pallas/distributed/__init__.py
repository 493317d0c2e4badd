"""The Pallas ops under PyTorch's own distributed engines (FSDP2, tensor
parallelism on DTensor): their sharding rules, registered through torch's
public `torch.distributed.tensor.experimental.register_sharding`, one
module per op family beside this file (`matmul.py`: matmul and add;
`attention.py`; `rows.py`: the norms; `elementwise.py`: swiglu and rotary
embedding; `cross_entropy.py`: the fused loss), all written as dimension
labels (`labels.py`). No distribution code of the package's own: DTensor
runs each op on its local shards under the placements a rule allows and
redistributes any other placement first, as it does for torch's ops.

Importing torch.distributed.tensor costs about a second, which a program
that never uses DTensor should not pay: `register` runs when torch_pallas
is imported if DTensor is already loaded, and otherwise the moment it is
first imported.

DDP and FSDP2 need no rule: they hand the ops plain tensors, which a call
leaves as it found them (tests/test_distributed.py, tests/test_fsdp2.py).

Imports: the ops (`torch_pallas.ops`) and `library`, like every integration;
nothing below imports it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

import torch

DTENSOR = "torch.distributed.tensor"
FAMILIES = ("matmul", "attention", "rows", "elementwise", "cross_entropy", "grouped_mm")
_registered = False


def register() -> None:
    """Registers every op's sharding rule with DTensor (once)."""
    global _registered
    if _registered:
        return
    _registered = True
    import torch_pallas.ops  # noqa: F401  (the ops the rules name)

    for family in FAMILIES:
        importlib.import_module(f"{__name__}.{family}")


class _RegisterAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds torch.distributed.tensor as the other finders do, then runs
    `register` once its module has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != DTENSOR:
            return None
        sys.meta_path.remove(self)  # once; the real spec from the other finders
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        register()


def register_when_dtensor_loads() -> None:
    """`register` now if DTensor is loaded, else when it is."""
    if not torch.distributed.is_available():
        return
    if DTENSOR in sys.modules:
        register()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
