"""What a custom op's JAX function takes and returns (torch_pallas.custom_op):
its tensor parameters (JAX arrays inside the function), its static
parameters (int, float, bool: part of the compiled kernel's identity), the
`interpret` parameter the backend fills in, and its outputs."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Any, get_args, get_origin

import torch

from torch_pallas import dtypes

STATIC_TYPES = (int, float, bool)


class Signature:
    """What an op's JAX function takes: tensors, static scalars, interpret."""

    def __init__(self, name: str, fn: Callable):
        self.name = name
        # Annotations resolved (they are strings under `from __future__ import annotations`).
        hints = typing.get_type_hints(fn)
        signature = inspect.signature(fn)
        self.signature = signature.replace(
            parameters=[p.replace(annotation=hints.get(p.name, p.annotation))
                        for p in signature.parameters.values()],
            return_annotation=hints.get("return", signature.return_annotation),
        )
        self.tensors: list[str] = []
        self.statics: list[str] = []
        self.takes_interpret = False
        for p in self.signature.parameters.values():
            if p.name == "interpret":
                self.takes_interpret = True
            elif p.annotation is torch.Tensor and p.kind is p.KEYWORD_ONLY:
                raise TypeError(
                    f"custom_op {name}: tensor parameter {p.name!r} is keyword-only; "
                    "make it positional"
                )
            elif p.annotation is torch.Tensor and p.default is not p.empty:
                raise TypeError(
                    f"custom_op {name}: tensor parameter {p.name!r} has a default "
                    f"({p.default!r}); tensor parameters take tensors only"
                )
            elif p.annotation is torch.Tensor:
                self.tensors.append(p.name)
            elif p.annotation in STATIC_TYPES:
                self.statics.append(p.name)
            else:
                raise TypeError(
                    f"custom_op {name}: parameter {p.name!r} must be annotated "
                    f"torch.Tensor, int, float or bool, got {p.annotation!r}"
                )
        if not self.tensors:
            raise TypeError(f"custom_op {name}: the function takes no torch.Tensor parameter")
        returns = self.signature.return_annotation
        if returns is torch.Tensor:
            self.outputs = None  # a single tensor
        elif get_origin(returns) in (tuple, Sequence) and all(
            a is torch.Tensor for a in get_args(returns)
        ):
            self.outputs = len(get_args(returns))
        else:
            raise TypeError(
                f"custom_op {name}: annotate the return as torch.Tensor or "
                f"tuple[torch.Tensor, ...], got {returns!r}"
            )

    def op_signature(self) -> inspect.Signature:
        """The torch op's signature: the function's, without `interpret`."""
        return self.signature.replace(
            parameters=[p for p in self.signature.parameters.values() if p.name != "interpret"]
        )

    def split(self, args, kwargs) -> tuple[list[torch.Tensor], dict[str, Any]]:
        bound = self.op_signature().bind(*args, **kwargs)
        bound.apply_defaults()
        tensors = [bound.arguments[n] for n in self.tensors]
        statics = {n: bound.arguments[n] for n in self.statics}
        return tensors, statics


def check_tensors(name: str, sig: Signature, tensors) -> torch.device:
    device = None
    for arg, t in zip(sig.tensors, tensors):
        if not isinstance(t, torch.Tensor):  # the dispatcher lets None through
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {t!r}")
        if t.layout != torch.strided:
            raise TypeError(f"{name}: {arg} must be a dense (strided) tensor, got layout {t.layout}")
        if t.dtype not in dtypes.JAX_NAMES:
            raise TypeError(
                f"{name}: {arg} has dtype {t.dtype}, which the JAX function cannot "
                f"receive exactly; supported: {dtypes.names(dtypes.JAX_NAMES)}"
            )
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(
                f"{name}: all tensors must be on one device, got {sig.tensors[0]} on "
                f"{device} and {arg} on {t.device}"
            )
    return device


def checked_outputs(name: str, outputs, result) -> list:
    """The JAX function's output arrays (or abstract arrays), after checking
    that there are as many as the op declares and each can cross to torch."""
    leaves = [result] if outputs is None else result
    if outputs is not None and (not isinstance(result, (tuple, list)) or len(result) != outputs):
        raise TypeError(f"{name}: the JAX function must return {outputs} arrays, got {result!r}")
    for i, leaf in enumerate(leaves):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(
                f"{name}: output {i} of the JAX function is {leaf!r}, not an array"
            )
        if str(leaf.dtype) not in TORCH_DTYPES:
            raise TypeError(
                f"{name}: output {i} of the JAX function has dtype {leaf.dtype}, which "
                f"cannot cross to torch exactly; supported: {dtypes.names(dtypes.JAX_NAMES)}"
            )
    return leaves


def kernel_entry(sig: Signature, fn: Callable) -> Callable:
    """`fn` as launch and eval_shape call it: its tensor parameters (JAX
    arrays) by position, in the signature's order, everything else by name,
    wherever the function declares them; its outputs checked while it is
    traced (once per compiled kernel, not per call)."""
    @functools.wraps(fn)  # keeps the signature: `interpret` stays visible
    def entry(*arrays, **kwargs):
        result = fn(**dict(zip(sig.tensors, arrays)), **kwargs)
        checked_outputs(sig.name, sig.outputs, result)
        return result

    return entry


TORCH_DTYPES = {name: dtype for dtype, name in dtypes.JAX_NAMES.items()}
