"""FLOP formulas for `torch.utils.flop_counter.FlopCounterMode`, registered
without importing that module: it imports Inductor and Triton, several times
what `import torch_pallas` costs. A formula is registered at once when the
module is already loaded, otherwise the moment it is imported (a one-shot
import hook, which leaves `sys.meta_path` as it found it), in either case
before any FlopCounterMode exists: each mode copies the registry when it is
made, so no lighter way (registering at the op's first call, say) would
reach a mode made before that.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from typing import Callable

FLOP_COUNTER = "torch.utils.flop_counter"

_pending: list[tuple[object, Callable]] = []


def register(op, formula: Callable) -> None:
    """`formula(*input_shapes, out_shape=..., **kwargs) -> int` counts the
    FLOPs of a call to `op` (an OpOverloadPacket), as for
    `torch.utils.flop_counter.register_flop_formula`."""
    module = sys.modules.get(FLOP_COUNTER)
    if module is not None:
        module.register_flop_formula(op)(formula)
        return
    if not _pending:
        sys.meta_path.insert(0, _RegisterWhenImported())
    _pending.append((op, formula))


class _RegisterWhenImported(importlib.abc.MetaPathFinder):
    """Finds flop_counter with the finders after it and wraps its loader so
    that the pending formulas are registered right after the module runs;
    then steps aside (leaves sys.meta_path, restores the module's loader)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != FLOP_COUNTER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenRegister(spec.loader)
        return spec


class _ThenRegister(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__spec__.loader = module.__loader__ = self.loader
        self.loader.exec_module(module)
        try:
            for op, formula in _pending:
                module.register_flop_formula(op)(formula)
        except Exception as e:  # a torch whose flop_counter changed: count without them
            warnings.warn(f"torch_pallas: FLOP formulas not registered with {FLOP_COUNTER}: {e!r}",
                          stacklevel=2)
        _pending.clear()
