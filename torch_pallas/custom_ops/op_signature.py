"""What a custom op's JAX function takes and returns (torch_pallas.custom_op),
and how each parameter crosses from the torch op to the function.

Parameters, by annotation (each may also be `X | None`, default None):

| annotation | the op's schema | the function receives |
|---|---|---|
| `torch.Tensor` | `Tensor` | a JAX array (None where optional and absent) |
| `int`, `float`, `bool`, `str` | the same | the value |
| `tuple[int, ...]`, `list[int]`, `Sequence[int]` (float, bool alike) | `int[]` | a tuple |
| `torch.dtype` | `ScalarType` | the JAX dtype |
| any other hashable class (a frozen dataclass such as `BlockSizes`) | `str` | the object |

Everything but tensors is static: part of the compiled kernel's identity.
An object of a class of the last row crosses the op's schema as a token
(`StaticObjects`): call the op through what custom_op returns, which
passes the object itself. A parameter named `interpret` is not part of the
op: it receives what the backend needs. Outputs are a tensor or a tuple of
outputs, nested as the function returns them: the torch op returns their
leaves, flat; what custom_op returns nests them again.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, get_args, get_origin

import torch

from torch_pallas.base import dtypes, jax_env

SCALARS = {int: "int", float: "float", bool: "bool", str: "str"}
SAVED = object()  # a tensor argument's place while autograd holds the tensor
INTERPRET = "interpret"


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter of the op: its schema type and its way to the function."""

    name: str
    schema_type: str  # "Tensor", "int", "float[]", "ScalarType", "str", ...
    optional: bool  # `X | None`
    default: Any  # inspect.Parameter.empty when required
    keyword_only: bool
    element: type | None = None  # int/float/bool of a list; the class of an object

    @property
    def is_tensor(self) -> bool:
        return self.schema_type == "Tensor"

    @property
    def is_object(self) -> bool:
        """A hashable object that crosses the schema as a token."""
        return self.schema_type == "str" and self.element is not None

    def schema(self) -> str:
        text = f"{self.schema_type}{'?' if self.optional else ''} {self.name}"
        if self.default is not inspect.Parameter.empty:
            text += "=" + _schema_default(self, self.default)
        return text

    def to_op(self, value):
        """A user's value as the torch op takes it."""
        if value is None:
            return None
        if self.is_object and not isinstance(value, str):  # a token stays one
            return _token(value)
        if self.schema_type.endswith("[]") and isinstance(value, tuple):
            return list(value)
        return value

    def to_function(self, value):
        """The op's (concrete) value as the JAX function receives it."""
        if value is None:
            return None
        if self.is_object:
            return STATIC_OBJECTS.get(value) if isinstance(value, str) else value
        if self.schema_type.endswith("[]"):
            return tuple(_concrete(v) for v in value)
        if self.schema_type == "ScalarType":
            return jax_env.jax().numpy.dtype(dtypes.jax_name(value))
        return _concrete(value)


def _concrete(value):
    """A value torch.compile made symbolic, specialised (the graph is guarded
    on it): static values are part of the kernel's identity."""
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.SymFloat):
        return float(value)
    if isinstance(value, torch.SymBool):
        return bool(value)
    return value


def _schema_default(param: Param, value) -> str:
    if value is None:
        return "None"
    if param.is_object:
        return f'"{STATIC_OBJECTS.token(value)}"'
    if param.schema_type == "str":
        if '"' in value or "\\" in value:
            raise TypeError(f"parameter {param.name!r}: a str default with quotes or "
                            f"backslashes cannot be written in a torch schema: {value!r}")
        return f'"{value}"'
    if param.schema_type == "ScalarType":
        return str(value).removeprefix("torch.")
    if param.schema_type.endswith("[]"):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


class StaticObjects:
    """Hashable objects (a kernel's config dataclass) as the tokens a torch
    schema can carry: equal objects share one token, for the process's
    lifetime, so a token names one kernel configuration. No lock (Dynamo
    traces this): a token is claimed by dict.setdefault, atomic in CPython,
    and tried again if another object took it first."""

    def __init__(self):
        self._tokens: dict[Any, str] = {}
        self._objects: dict[str, Any] = {}

    def token(self, obj) -> str:
        token = self._tokens.get(obj)
        while token is None:
            candidate = f"{type(obj).__qualname__}#{len(self._objects)}"
            if self._objects.setdefault(candidate, obj) == obj:  # ours, or an equal object's
                token = self._tokens.setdefault(obj, candidate)
        return token

    def get(self, token: str):
        try:
            return self._objects[token]
        except KeyError:
            raise ValueError(
                f"torch_pallas: {token!r} names no static object: pass the object itself "
                "through the op custom_op returned"
            ) from None


STATIC_OBJECTS = StaticObjects()


def _token(obj) -> str:
    """The object's token. Marked `torch.compiler.assume_constant_result`
    once an op takes objects (marking imports Dynamo, which `import
    torch_pallas` must not): Dynamo then calls it for real while it traces
    (the table must hold the token before the op's fake function looks it
    up) and keeps the result as a constant; the object is guarded as any
    input is."""
    return STATIC_OBJECTS.token(obj)


def _classify(op: str, p: inspect.Parameter) -> Param:
    annotation, optional = _strip_optional(p.annotation)
    keyword_only = p.kind is p.KEYWORD_ONLY
    kind = dict(name=p.name, optional=optional, default=p.default, keyword_only=keyword_only)
    if annotation is torch.Tensor:
        if keyword_only:
            raise TypeError(f"custom_op {op}: tensor parameter {p.name!r} is keyword-only; "
                            "make it positional")
        if p.default is not p.empty and not (optional and p.default is None):
            raise TypeError(
                f"custom_op {op}: tensor parameter {p.name!r} has a default ({p.default!r}); "
                "only an optional one (torch.Tensor | None) may, and only None"
            )
        return Param(schema_type="Tensor", **kind)
    if annotation in SCALARS:
        return Param(schema_type=SCALARS[annotation], **kind)
    if annotation is torch.dtype:
        return Param(schema_type="ScalarType", **kind)
    element = _list_element(annotation)
    if element is not None:
        return Param(schema_type=f"{SCALARS[element]}[]", element=element, **kind)
    if isinstance(annotation, type) and annotation.__hash__ is not None and not _is_typing(annotation):
        return Param(schema_type="str", element=annotation, **kind)
    raise TypeError(
        f"custom_op {op}: parameter {p.name!r} has annotation {p.annotation!r}; supported: "
        "torch.Tensor, int, float, bool, str, torch.dtype, tuple/list of int, float or bool, "
        "a hashable class (a frozen dataclass), each optionally `| None`"
    )


def _strip_optional(annotation):
    """(X, True) for `X | None` / Optional[X], else (annotation, False)."""
    if get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1 and len(args) < len(get_args(annotation)):
            return args[0], True
    return annotation, False


def _list_element(annotation):
    """int, float or bool for tuple[int, ...], tuple[int, int], list[int] or
    Sequence[int] (float, bool alike); else None."""
    if get_origin(annotation) not in (tuple, list, Sequence):
        return None
    args = [a for a in get_args(annotation) if a is not Ellipsis]
    if args and len(set(args)) == 1 and args[0] in (int, float, bool):
        return args[0]
    return None


def _is_typing(annotation) -> bool:
    return annotation.__module__ in ("typing", "types", "collections.abc") or annotation in (
        list, tuple, dict, set, object, type(None))


def _output_structure(op: str, annotation):
    """None for one tensor, else a tuple of structures (nested tuples)."""
    if annotation is torch.Tensor:
        return None
    if get_origin(annotation) in (tuple, Sequence) and get_args(annotation) and (
        Ellipsis not in get_args(annotation)
    ):
        return tuple(_output_structure(op, a) for a in get_args(annotation))
    raise TypeError(
        f"custom_op {op}: annotate the return as torch.Tensor or a tuple of "
        f"torch.Tensor (nested tuples allowed), got {annotation!r}"
    )


def _leaf_count(structure) -> int:
    return 1 if structure is None else sum(_leaf_count(s) for s in structure)


class Signature:
    """What an op's JAX function takes and returns."""

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
        self.takes_interpret = INTERPRET in self.signature.parameters
        self.params = [_classify(name, p) for p in self.signature.parameters.values()
                       if p.name != INTERPRET]
        if any(p.is_object for p in self.params):
            torch.compiler.assume_constant_result(_token)  # marks it in place
        self.tensors = [p.name for p in self.params if p.is_tensor]
        self.statics = [p.name for p in self.params if not p.is_tensor]
        if not self.tensors:
            raise TypeError(f"custom_op {name}: the function takes no torch.Tensor parameter")
        self.structure = _output_structure(name, self.signature.return_annotation)
        self.outputs = _leaf_count(self.structure)  # leaves, flat
        self.single = self.structure is None
        self._by_name = {p.name: p for p in self.params}

    # -- the torch op's side ----------------------------------------------
    def schema_arguments(self, extra: Sequence[str] = (), extra_keyword: Sequence[str] = ()) -> str:
        """The op's arguments as a schema's "(...)" text, with `extra`
        positional ones after the function's and `extra_keyword` ones
        keyword-only at the end."""
        positional = [p.schema() for p in self.params if not p.keyword_only] + list(extra)
        keyword = [p.schema() for p in self.params if p.keyword_only] + list(extra_keyword)
        return "(" + ", ".join(positional + (["*"] + keyword if keyword else [])) + ")"

    def return_schema(self) -> str:
        return "Tensor" if self.single else "(" + ", ".join(["Tensor"] * self.outputs) + ")"

    def op_signature(self) -> inspect.Signature:
        """The torch op's signature: the function's, without `interpret`."""
        return self.signature.replace(
            parameters=[p for p in self.signature.parameters.values() if p.name != INTERPRET]
        )

    def bind(self, args, kwargs) -> dict[str, Any]:
        """The op's arguments by name, defaults applied."""
        bound = self.op_signature().bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def to_op(self, args, kwargs):
        """A user's call (`what custom_op returned`(...)) as the torch op's."""
        bound = self.op_signature().bind(*args, **kwargs)
        arguments = {n: self._by_name[n].to_op(v) for n, v in bound.arguments.items()}
        positional = []
        for p in self.params:  # by position up to the first one omitted
            if p.keyword_only or p.name not in arguments:
                break
            positional.append(arguments.pop(p.name))
        return positional, arguments

    def split(self, args, kwargs, tensors_only=False):
        """(tensors, in the signature's order, None where absent; statics
        as the function receives them), or the tensors alone."""
        arguments = self.bind(args, kwargs)
        tensors = [arguments[n] for n in self.tensors]
        if tensors_only:
            return tensors
        statics = {n: self._by_name[n].to_function(arguments[n]) for n in self.statics}
        return tensors, statics

    def with_tensors(self, arguments: dict, tensors) -> dict:
        """`arguments` (by name) with its present tensors replaced, in order,
        by `tensors`; None: by a placeholder (SAVED) that a later call
        replaces. Absent optional tensors stay None."""
        replaced = iter(tensors or ())
        return {n: (SAVED if tensors is None else next(replaced))
                if n in self.tensors and v is not None else v
                for n, v in arguments.items()}

    def call_parts(self, arguments: dict):
        """(args, kwargs) for the op from arguments by name."""
        args = [arguments[p.name] for p in self.params if not p.keyword_only]
        kwargs = {p.name: arguments[p.name] for p in self.params if p.keyword_only}
        return args, kwargs

    def nest(self, flat):
        """The op's flat outputs, nested as the function returns them."""
        if self.single:
            return flat
        leaves = iter(flat)

        def build(structure):
            if structure is None:
                return next(leaves)
            return tuple(build(s) for s in structure)

        return build(self.structure)

    # -- the JAX function's side ------------------------------------------
    def flatten(self, result) -> list:
        """The JAX function's outputs as a flat list, checked against the
        declared structure and for crossing to torch."""
        leaves: list = []

        def walk(structure, value, where):
            if structure is None:
                leaves.append((value, where))
                return
            if not isinstance(value, (tuple, list)) or len(value) != len(structure):
                raise TypeError(
                    f"{self.name}: the JAX function must return {len(structure)} arrays"
                    f"{' at ' + where if where else ''}, got {value!r}"
                )
            for i, (s, v) in enumerate(zip(structure, value)):
                walk(s, v, f"{where}[{i}]")

        walk(self.structure, result, "")
        for i, (leaf, where) in enumerate(leaves):
            if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
                raise TypeError(f"{self.name}: output {i} of the JAX function is {leaf!r}, "
                                "not an array")
            if str(leaf.dtype) not in dtypes.TORCH_DTYPES:
                raise TypeError(
                    f"{self.name}: output {i} of the JAX function has dtype {leaf.dtype}, which "
                    f"cannot cross to torch exactly; supported: "
                    f"{dtypes.names(dtypes.CUSTOM_OP_NAMES)}"
                )
        return [leaf for leaf, _ in leaves]

    @functools.lru_cache(maxsize=None)  # one per set of present tensors: a stable identity
    def entry(self, fn: Callable, present: tuple[str, ...]) -> Callable:
        """`fn` as launch and eval_shape call it: `entry(*arrays, interpret,
        **statics) -> tuple of output arrays`, its present tensors (JAX
        arrays) by position, in the signature's order, absent optional ones
        None, everything else by name. It runs under JAX's interpret-mode
        context for `interpret`, so kernels called without `interpret=`
        run as the backend needs; its outputs are checked while it is
        traced (once per compiled kernel, not per call)."""
        absent = {n: None for n in self.tensors if n not in present}
        takes_interpret = self.takes_interpret

        @functools.wraps(fn)
        def entry(*arrays, interpret=None, **statics):
            bound = {INTERPRET: interpret} if takes_interpret else {}
            with jax_env.forced_interpret(interpret):
                result = fn(**dict(zip(present, arrays)), **absent, **statics, **bound)
            return tuple(self.flatten(result))

        entry.takes_interpret = takes_interpret  # whether the user's function does
        entry.__signature__ = inspect.Signature(
            [inspect.Parameter("arrays", inspect.Parameter.VAR_POSITIONAL),
             inspect.Parameter(INTERPRET, inspect.Parameter.KEYWORD_ONLY, default=None),
             inspect.Parameter("statics", inspect.Parameter.VAR_KEYWORD)])
        return entry

    def __hash__(self):
        return id(self)

    def __eq__(self, other):
        return self is other


def check_tensors(name: str, sig: Signature, tensors) -> torch.device:
    """The device of the call's tensors, after checking each can reach the
    function exactly. `tensors` holds None for absent optional ones."""
    device = None
    first = None
    for arg, t in zip(sig.tensors, tensors):
        if t is None and sig._by_name[arg].optional:
            continue
        if not isinstance(t, torch.Tensor):  # the dispatcher lets None through
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {t!r}")
        if t.layout != torch.strided:
            raise TypeError(f"{name}: {arg} must be a dense (strided) tensor, got layout {t.layout}")
        if t.dtype not in dtypes.CUSTOM_OP_NAMES:
            raise TypeError(
                f"{name}: {arg} has dtype {t.dtype}, which the JAX function cannot "
                f"receive exactly; supported: {dtypes.names(dtypes.CUSTOM_OP_NAMES)}"
            )
        if device is None:
            device, first = t.device, arg
        elif t.device != device:
            raise ValueError(
                f"{name}: all tensors must be on one device, got {first} on "
                f"{device} and {arg} on {t.device}"
            )
    return device
