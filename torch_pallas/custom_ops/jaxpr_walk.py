"""Walking a traced JAX function: the equations of a jaxpr and of every jaxpr
nested in it, and evaluating a jaxpr again with some equations replaced.

`equations` finds, for instance, every `pallas_call` a user's function makes,
however deep inside `jax.jit`, `custom_vjp`, `cond` or loops
(torch_pallas/custom_ops/kernel_advice.py counts their grid steps). `evaluate` re-runs a
jaxpr on tracers, equation by equation, binding each primitive as traced,
except where a `replace` function returns the outputs itself; a higher-order
equation whose inner jaxprs hold something to replace is evaluated inside the
same way, through lax's public API (`lax.switch`, `lax.while_loop`,
`lax.scan`) or inlined (`jit`, `custom_jvp`/`custom_vjp` calls, `checkpoint`:
their forward computation, which is all a compiled forward kernel runs).
torch_pallas/custom_ops/mosaic_gpu_pallas_call.py uses it twice: to replace a user's
`pallas_call`s, and inside a kernel to give `pl.program_id` its value.

Only `jax.extend.core` (JAX's public API for jaxprs) is used here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch_pallas.base import jax_env

# Replaces one equation: its outputs (a list), or None to bind it as traced.
Replace = Callable[[Any, list], "list | None"]


class UnsupportedNesting(Exception):
    """An equation to replace sits inside a higher-order primitive `evaluate`
    cannot re-express (its name: `primitive`)."""

    def __init__(self, primitive: str):
        super().__init__(primitive)
        self.primitive = primitive


def _core():
    jax_env.jax()
    import jax.extend.core as core

    return core


def inner_jaxprs(eqn) -> Iterator[Any]:
    """The jaxprs in an equation's parameters (one level down)."""
    yield from _core().jaxprs_in_params(eqn.params)


def equations(jaxpr, *, enter: Callable[[Any], bool] = lambda eqn: True) -> Iterator[Any]:
    """Every equation of `jaxpr` (a Jaxpr or ClosedJaxpr) and, for those that
    `enter` accepts, of the jaxprs nested in them, depth first."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        if enter(eqn):
            for inner in inner_jaxprs(eqn):
                yield from equations(inner, enter=enter)


def holds(eqn, wanted: Callable[[Any], bool], enter: Callable[[Any], bool]) -> bool:
    """Whether a jaxpr nested in `eqn` holds an equation `wanted` accepts."""
    return any(wanted(e) for inner in inner_jaxprs(eqn) for e in equations(inner, enter=enter))


def evaluate(jaxpr, consts: Sequence, args: Sequence, *, replace: Replace,
             wanted: Callable[[Any], bool],
             enter: Callable[[Any], bool] = lambda eqn: True) -> list:
    """`jaxpr`'s outputs for `args`, traced again equation by equation.

    `replace(eqn, inputs)` may return an equation's outputs; `wanted(eqn)`
    marks the equations that make a higher-order equation around them worth
    evaluating inside (`enter(eqn)`: whether to look inside `eqn` for them).
    Raises UnsupportedNesting for a wanted equation inside a higher-order
    primitive this module cannot re-express."""
    core = _core()
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        outs = replace(eqn, invals)
        if outs is None and enter(eqn) and holds(eqn, wanted, enter):
            outs = _inside(eqn, invals, replace=replace, wanted=wanted, enter=enter)
        if outs is None:
            params = eqn.primitive.get_bind_params(eqn.params)
            subfuns = ()
            if isinstance(params, tuple):  # older JAX: (subfuns, params)
                subfuns, params = params
            outs = eqn.primitive.bind(*subfuns, *invals, **params)
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, core.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _inside(eqn, invals: list, **how) -> list:
    """A higher-order equation's outputs, its inner jaxprs evaluated by
    `evaluate` (closed over their operands, as lax's API traces them)."""
    jax = jax_env.jax()
    lax = jax.lax
    params = eqn.params
    name = eqn.primitive.name

    def run(closed, values):
        inner = getattr(closed, "jaxpr", closed)
        return evaluate(inner, getattr(closed, "consts", ()), values, **how)

    if name in ("jit", "pjit", "closed_call", "core_call", "remat", "checkpoint",
                "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
        inner = params.get("jaxpr", params.get("call_jaxpr", params.get("fun_jaxpr")))
        if inner is not None:
            return run(inner, invals)
    if name == "cond":
        index, operands = invals[0], invals[1:]
        branches = [lambda b=b: tuple(run(b, operands)) for b in params["branches"]]
        return list(lax.switch(index, branches))
    if name == "while":
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cond_consts, body_consts, init = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]
        out = lax.while_loop(lambda c: run(params["cond_jaxpr"], [*cond_consts, *c])[0],
                             lambda c: tuple(run(params["body_jaxpr"], [*body_consts, *c])),
                             tuple(init))
        return list(out)
    if name == "scan":
        n_consts, n_carry = params["num_consts"], params["num_carry"]
        consts, init, xs = invals[:n_consts], invals[n_consts:n_consts + n_carry], \
            invals[n_consts + n_carry:]

        def step(carry, x):
            outs = run(params["jaxpr"], [*consts, *carry, *x])
            return tuple(outs[:n_carry]), tuple(outs[n_carry:])

        carry, ys = lax.scan(step, tuple(init), tuple(xs), length=params["length"],
                             reverse=params["reverse"], unroll=params["unroll"])
        return [*carry, *ys]
    raise UnsupportedNesting(name)
