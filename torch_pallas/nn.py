"""Drop-in modules: `Linear` computes `x @ W.T + b` with the Pallas matmul;
`replace_linear(model)` converts every `torch.nn.Linear` of a model in place.
"""

from __future__ import annotations

import torch

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
    keep working). Subclasses of nn.Linear with their own forward are left
    alone. Returns `module`."""
    for m in module.modules():
        if type(m) is torch.nn.Linear:
            m.__class__ = Linear
    return module
