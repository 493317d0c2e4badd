"""Drop-in modules: `Linear` computes `x @ W.T + b` with the Pallas matmul;
`replace_linear(model)` converts every `torch.nn.Linear` of a model in place.
"""

from __future__ import annotations

import torch
from torch.nn.utils import parametrize

from torch_pallas import functional


class Linear(torch.nn.Linear):
    """`torch.nn.Linear` with its product computed by `torch.ops.pallas.matmul`.

    Same constructor, parameters and state_dict as torch.nn.Linear, so
    checkpoints load either way. The weight's transpose is read in place
    (no copy) and the batch dimensions fold into one product.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return functional.linear(input, self.weight, self.bias)


def replace_linear(module: torch.nn.Module) -> torch.nn.Module:
    """Makes every `torch.nn.Linear` in `module` (itself included) a
    `torch_pallas.nn.Linear`, in place, keeping its parameters, buffers and
    hooks (the same Parameter objects, so optimizers already holding them
    keep working). Returns `module`.

    - A parametrized nn.Linear (torch.nn.utils.parametrize: weight_norm,
      spectral_norm, orthogonal, ...) keeps its parametrizations; removing
      the last one leaves a torch_pallas Linear.
    - A LazyLinear becomes a torch_pallas Linear when it materialises (its
      first call, which torch computes).
    - Subclasses of nn.Linear are left alone: they may change what the
      module computes or how it is called (nn.MultiheadAttention's out_proj
      is never called through its forward).
    """
    for m in module.modules():
        if type(m) is torch.nn.Linear:
            m.__class__ = Linear
        elif parametrize.is_parametrized(m) and type(m).__bases__[0] is torch.nn.Linear:
            m.__class__ = _parametrized_pallas_linear(type(m))
        elif isinstance(m, torch.nn.LazyLinear):
            m.cls_to_become = Linear
    return module


def _parametrized_pallas_linear(cls: type) -> type:
    """`cls`, the class parametrize made for one nn.Linear (its properties
    compute the parametrized tensors, and parametrize adds and deletes them
    there), rebuilt on Linear: its only base is what parametrize restores
    when the last parametrization is removed."""
    namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
    return type(cls.__name__, (Linear,), namespace)
