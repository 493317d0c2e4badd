"""Drop-in modules computing their product with the Pallas matmul:
`Linear` (`x @ W.T + b`, a `torch.nn.Linear`) and, where transformers is
installed, `Conv1D` (`x @ W + b`, a `transformers.pytorch_utils.Conv1D`, as in
GPT-2). `replace_linear(model)` converts a model's layers to them IN PLACE;
`converted(model)` names the layers that run on the Pallas matmul.
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch.nn.utils import parametrize

from torch_pallas.functional import linear as _linear


class Linear(torch.nn.Linear):
    """`torch.nn.Linear` with its product computed by `torch.ops.pallas.matmul`.

    Same constructor, parameters and state_dict as torch.nn.Linear, so
    checkpoints load either way. The weight's transpose is read in place
    (no copy) and the batch dimensions fold into one product.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return _linear(input, self.weight, self.bias)


# transformers' Conv1D class -> its torch_pallas subclass, built on first use
# so that `import torch_pallas` never imports transformers.
_PALLAS_CONV1D: dict[type, type] = {}


def _pallas_conv1d(base: type) -> type:
    """The torch_pallas subclass of transformers' Conv1D class `base`."""
    if base not in _PALLAS_CONV1D:

        class Conv1D(base):
            """`transformers.pytorch_utils.Conv1D` (`x @ W + b`, the weight
            stored (in_features, out_features): GPT-2's attention and MLP
            projections) with its product computed by `torch.ops.pallas.matmul`,
            which reads the weight as stored. Same constructor (`nf, nx`),
            parameters and state_dict as transformers' Conv1D, of which it is
            a subclass (transformers' `isinstance(m, Conv1D)` checks still hold).
            """

            def forward(self, input: torch.Tensor) -> torch.Tensor:
                # linear takes W as (out, in) and transposes it; handing it
                # W.t() makes the op read W itself. linear also casts the bias
                # under autocast as addmm does.
                return _linear(input, self.weight.t(), self.bias)

        Conv1D.__qualname__ = "Conv1D"  # pickled by reference: torch_pallas.nn.Conv1D
        _PALLAS_CONV1D[base] = Conv1D
    return _PALLAS_CONV1D[base]


def __getattr__(name: str):
    # `torch_pallas.nn.Conv1D`: built (importing transformers) when first asked for.
    if name == "Conv1D":
        try:
            from transformers.pytorch_utils import Conv1D as TransformersConv1D
        except ImportError as e:  # AttributeError, so hasattr() and getattr(..., None) still work
            raise AttributeError(f"torch_pallas.nn.Conv1D needs transformers (pip install transformers): {e}") from e
        return _pallas_conv1d(TransformersConv1D)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def replace_linear(module: torch.nn.Module, *, verbose: bool = False) -> torch.nn.Module:
    """Converts `module` IN PLACE, and returns the same object (not a copy):
    every `torch.nn.Linear` in it (itself included) becomes a
    `torch_pallas.nn.Linear`, and every transformers `Conv1D` (GPT-2's
    `c_attn`, `c_proj`, `c_fc`) a `torch_pallas.nn.Conv1D`. Their forward then
    runs on `torch.ops.pallas.matmul`; nothing else changes: the same
    Parameter objects (optimizers already holding them, and tied weights such
    as GPT-2's `lm_head`/`wte`, keep working), buffers, hooks and state_dict.
    To keep an unconverted model, convert a copy:
    `replace_linear(copy.deepcopy(model))`.

    `converted(module)` lists what then runs on the Pallas matmul;
    `verbose=True` prints each layer converted and each left alone. Warns
    (UserWarning) when `module` holds no layer to convert.

    - A parametrized layer (torch.nn.utils.parametrize: weight_norm,
      spectral_norm, orthogonal, ...) keeps its parametrizations; removing
      the last one leaves a torch_pallas layer.
    - A LazyLinear becomes a torch_pallas Linear when it materialises (its
      first call, which torch computes).
    - Subclasses of nn.Linear and Conv1D are left alone: they may change what
      the module computes or how it is called (nn.MultiheadAttention's
      out_proj is never called through its forward).
    - transformers is never imported here: a model holding a Conv1D has
      imported it already.
    """
    targets = _pallas_targets()
    report = []  # (name, what happened), for verbose
    converts = False  # anything on, or bound for, the Pallas matmul
    left_alone = set()
    for name, m in module.named_modules():
        cls = type(m)
        if cls in targets:
            m.__class__ = targets[cls]
            report.append((name, f"{cls.__name__} -> torch_pallas.nn.{targets[cls].__name__}"))
        elif parametrize.is_parametrized(m) and cls.__bases__[0] in targets:
            m.__class__ = _parametrized_on(cls, targets[cls.__bases__[0]])
            report.append((name, f"{cls.__name__} -> {cls.__name__} on torch_pallas.nn.{targets[cls.__bases__[0]].__name__}"))
        elif isinstance(m, torch.nn.LazyLinear):
            m.cls_to_become = Linear
            report.append((name, "LazyLinear -> torch_pallas.nn.Linear when it materialises"))
        elif isinstance(m, _pallas_classes()):
            report.append((name, f"{cls.__name__}: already on the Pallas matmul"))
        elif isinstance(m, tuple(targets)):
            left_alone.add(cls.__name__)
            report.append((name, f"{cls.__name__} left alone (a subclass: it may compute something else)"))
            continue
        else:
            continue
        converts = True  # reached by the branches above that leave `m` on the Pallas matmul

    if verbose:
        print(f"torch_pallas.nn.replace_linear({type(module).__name__}), in place:")
        for name, what in report:
            print(f"  {name or '(the module itself)'}: {what}")
        if not report:
            print("  nothing to convert")
    if not converts:
        why = f"; its subclasses of them ({', '.join(sorted(left_alone))}) are left alone" if left_alone else ""
        warnings.warn(
            f"torch_pallas.nn.replace_linear: {type(module).__name__} holds no torch.nn.Linear "
            f"or transformers Conv1D to convert{why}; it runs as before",
            UserWarning,
            stacklevel=2,
        )
    return module


def converted(module: torch.nn.Module) -> list[str]:
    """The qualified names (as `named_modules` gives them; "" for `module`
    itself) of the layers in `module` whose forward runs on the Pallas
    matmul: torch_pallas Linear and Conv1D, whether `replace_linear` made
    them or they were built so. A parent that reads a layer's weight itself
    (README: nn.MultiheadAttention, TransformerEncoderLayer's fast path)
    still computes that product with torch."""
    pallas = _pallas_classes()
    return [name for name, m in module.named_modules() if isinstance(m, pallas)]


def _pallas_targets() -> dict[type, type]:
    """Each class `replace_linear` converts -> the class it becomes."""
    targets = {torch.nn.Linear: Linear}
    # transformers imports pytorch_utils with any model holding a Conv1D;
    # looked up, never imported, so a model without one costs nothing.
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    transformers_conv1d = getattr(pytorch_utils, "Conv1D", None)
    if isinstance(transformers_conv1d, type):
        targets[transformers_conv1d] = _pallas_conv1d(transformers_conv1d)
    return targets


def _pallas_classes() -> tuple[type, ...]:
    return (Linear, *_PALLAS_CONV1D.values())


def _parametrized_on(cls: type, base: type) -> type:
    """`cls`, the class parametrize made for one layer (its properties
    compute the parametrized tensors, and parametrize adds and deletes them
    there), rebuilt on the torch_pallas class `base`: its only base is what
    parametrize restores when the last parametrization is removed."""
    namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
    return type(cls.__name__, (base,), namespace)
