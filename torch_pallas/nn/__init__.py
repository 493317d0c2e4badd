"""Drop-in modules computing their product with the Pallas matmul:
`Linear` (`x @ W.T + b`, a `torch.nn.Linear`) and, where transformers is
installed, `Conv1D` (`x @ W + b`, a `transformers.pytorch_utils.Conv1D`, as in
GPT-2). `replace_linear(model)` converts a model's layers to them IN PLACE;
`converted(model)` names the layers that run on the Pallas matmul.
`RMSNorm` and `LayerNorm` (norms.py) are torch.nn's on the fused norm ops;
`LinearCrossEntropyLoss` (loss.py) an LM head's product and its
cross-entropy loss in one op, without the logits.

The training ops' layers (RMSNorm, LayerNorm, ...) land here beside
`Linear`, one module per layer family.

Imports: the ops (`torch_pallas.ops`), as every integration; nothing of
torch_pallas imports it but the public API and `torch_pallas.transformers`
(model patching, the layer above).
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch.nn.utils import parametrize

from torch_pallas.nn.loss import LinearCrossEntropyLoss  # noqa: F401  (torch_pallas.nn.*)
from torch_pallas.nn.norms import LayerNorm, RMSNorm  # noqa: F401  (torch_pallas.nn.*)
from torch_pallas.ops.matmul import linear as _linear


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


# A user's linear-map class -> its torch_pallas subclass (replace_linear's `also`).
_PALLAS_LINEAR_MAPS: dict[type, type] = {}
LAYOUTS = ("out_in", "in_out")  # weight (out, in): x @ W.T + b; (in, out): x @ W + b


def _named_linear_maps(also) -> dict[type, str]:
    items = also.items() if isinstance(also, dict) else ((cls, "out_in") for cls in also)
    named = {}
    for cls, layout in items:
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise TypeError(f"torch_pallas.nn.replace_linear: also= takes torch.nn.Module "
                            f"classes, got {cls!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"torch_pallas.nn.replace_linear: also={{{cls.__name__}: "
                             f"{layout!r}}}: the layout must be one of {LAYOUTS}")
        named[cls] = layout
    return named


def _pallas_linear_map(base: type, layout: str) -> type:
    """The torch_pallas subclass of a user's class `base` whose forward is
    `x @ weight.T + bias` ("out_in") or `x @ weight + bias` ("in_out").
    Pickled by reference to a name in this module that encodes `base`'s
    module and qualified name, so torch.save(model) loads again."""
    key = (base, layout)
    if key not in _PALLAS_LINEAR_MAPS:
        transpose = layout == "in_out"

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            weight = self.weight.t() if transpose else self.weight
            return _linear(input, weight, getattr(self, "bias", None))

        name = _linear_map_name(base, layout)
        cls = type(name, (base,), {"forward": forward, "__module__": __name__,
                                   "__qualname__": name, "__doc__":
                                   f"{base.__qualname__} with its product on torch.ops.pallas.matmul."})
        _PALLAS_LINEAR_MAPS[key] = cls
    return _PALLAS_LINEAR_MAPS[key]


def _linear_map_name(base: type, layout: str) -> str:
    # No "." (pickle splits qualified names on it): module path and qualified
    # name joined by ":" and "|".
    return f"Pallas[{base.__module__.replace('.', ':')}|{base.__qualname__.replace('.', ':')}|{layout}]"


def _linear_map_from_name(name: str) -> type | None:
    if not (name.startswith("Pallas[") and name.endswith("]")):
        return None
    try:
        module_name, qualname, layout = name[len("Pallas["):-1].split("|")
    except ValueError:
        return None
    import importlib

    base = importlib.import_module(module_name.replace(":", "."))
    for part in qualname.split(":"):
        base = getattr(base, part)
    return _pallas_linear_map(base, layout)


def _check_linear_map(name: str, m: torch.nn.Module, layout: str, pallas: type) -> None:
    """`m`'s own forward and the Pallas product agree on a small random input
    (in eval mode, without hooks or gradients), or ValueError."""
    weight = getattr(m, "weight", None)
    where = f"torch_pallas.nn.replace_linear: {name or '(the module itself)'} ({type(m).__name__})"
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"{where}: a linear map named in also= needs a 2-D `weight`, got "
                         f"{None if weight is None else tuple(weight.shape)}")
    if weight.is_meta:
        return  # nothing to compute with: checked never
    in_features = weight.shape[1] if layout == "out_in" else weight.shape[0]
    x = torch.randn(3, in_features, dtype=weight.dtype, device=weight.device)
    training = m.training
    try:
        m.eval()
        with torch.no_grad():
            expected = type(m).forward(m, x)
            got = pallas.forward(m, x)
    finally:
        m.train(training)
    if not (isinstance(expected, torch.Tensor) and expected.shape == got.shape
            and torch.allclose(got.float(), expected.float(), rtol=1e-2, atol=1e-2 * (1 + expected.abs().max().item()))):
        raise ValueError(
            f"{where}: its forward does not compute x @ weight{'.T' if layout == 'out_in' else ''}"
            f" + bias (checked on a random input), so it is not converted; name it with the "
            f"layout it has (also={{{type(m).__name__}: {'in_out' if layout == 'out_in' else 'out_in'!r}}}) "
            "or leave it out")


def __getattr__(name: str):
    linear_map = _linear_map_from_name(name)
    if linear_map is not None:  # unpickling a converted user layer
        return linear_map
    # `torch_pallas.nn.Conv1D`: built (importing transformers) when first asked for.
    if name == "Conv1D":
        try:
            from transformers.pytorch_utils import Conv1D as TransformersConv1D
        except ImportError as e:  # AttributeError, so hasattr() and getattr(..., None) still work
            raise AttributeError(f"torch_pallas.nn.Conv1D needs transformers (pip install transformers): {e}") from e
        return _pallas_conv1d(TransformersConv1D)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def replace_linear(module: torch.nn.Module, *, also=(), verbose: bool = False) -> torch.nn.Module:
    """Converts `module` IN PLACE, and returns the same object (not a copy):
    every `torch.nn.Linear` in it (itself included) becomes a
    `torch_pallas.nn.Linear`, every transformers `Conv1D` (GPT-2's
    `c_attn`, `c_proj`, `c_fc`) a `torch_pallas.nn.Conv1D`, and every
    instance of a class named in `also` a subclass of it on the Pallas
    matmul (`also`: classes whose forward is `x @ weight.T + bias`, or a
    dict class -> "out_in" for that, "in_out" for `x @ weight + bias`;
    `bias` may be None or absent). Each such layer is checked once, on a
    small random input, against its own forward, and a class that computes
    something else raises ValueError naming it. Their forward then
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
    named = _named_linear_maps(also)
    for cls, layout in named.items():
        targets[cls] = _pallas_linear_map(cls, layout)
    for name, m in module.named_modules():  # all checked before anything changes
        if type(m) in named:
            _check_linear_map(name, m, named[type(m)], targets[type(m)])
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
    return (Linear, *_PALLAS_CONV1D.values(), *_PALLAS_LINEAR_MAPS.values())


def _parametrized_on(cls: type, base: type) -> type:
    """`cls`, the class parametrize made for one layer (its properties
    compute the parametrized tensors, and parametrize adds and deletes them
    there), rebuilt on the torch_pallas class `base`: its only base is what
    parametrize restores when the last parametrization is removed."""
    namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
    return type(cls.__name__, (base,), namespace)
