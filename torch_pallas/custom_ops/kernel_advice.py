"""What torch_pallas tells a user whose kernel a backend cannot run, or runs
slowly: the limit that was hit, or the cost, and what to do about it.

- `explain(error, ...)`, for an exception raised while building a user's
  kernel (torch_pallas.custom_op) on a backend:
  - a limit of JAX's Mosaic GPU simulator (`mosaic_gpu_interpret`): JAX raises
    a bare `AssertionError` (a `pl.pallas_call` with BlockSpec windows: the
    simulator asserts `has_trivial_window()` for every block) or a
    `NotImplementedError` ("Higher-order primitive run_state", "load_p is not
    supported on GPU yet"); what torch_pallas/custom_ops/mosaic_gpu_pallas_call.py cannot
    simulate raises `SimulatorLimit`. Either becomes a
    `torch_pallas.BackendLimitError` naming the op, the backend, the limit,
    where in the user's code it was hit, and what to do, raised from JAX's
    exception. (A block read past an array's edge, which the simulator
    refuses only when the kernel runs, gets its note from
    torch_pallas/runtime/simulators.py, for every kernel.)
  - JAX's CPU error "Only interpret mode is supported on CPU backend" (a
    kernel compiled for the CPU without interpret mode) gets a note naming
    the fix: take an `interpret` parameter and pass it on, or call the kernel
    without `interpret=` (torch_pallas runs it under JAX's interpret-mode
    context).
- `check_grid(op, backend, fn, avals)`: on the `interpret` backend (JAX's
  generic interpreter), which copies whole buffers on every grid step, a
  user's function whose `pallas_call` grids have FINE_GRID_STEPS steps or
  more warns once per op (`torch_pallas.FineGridWarning`): why it is slow and
  what to do. docs/custom_ops.md has the measurements behind the
  threshold.
"""

from __future__ import annotations

import math
import traceback
import warnings
from collections.abc import Callable

from torch_pallas.base import jax_env
from torch_pallas.base.errors import BackendLimitError, FineGridWarning, add_note
from torch_pallas.custom_ops import jaxpr_walk
from torch_pallas.custom_ops.mosaic_gpu_pallas_call import WHAT_RUNS, SimulatorLimit

# On the `interpret` backend every grid step costs about one pass over the
# kernel's whole buffers (docs/custom_ops.md, measured on 2 cores:
# 20-30 us per step at 256x256 float32, 150-500 us at 1024x1024): at 64 steps
# a kernel already runs 7-30x slower than with whole-array blocks.
FINE_GRID_STEPS = 64

_GPU_SIMULATOR_FILES = "pallas/mosaic_gpu/interpret/"
_TPU_SIMULATOR_FILES = "pallas/mosaic/interpret/"
_CPU_ERROR = "Only interpret mode is supported on CPU backend"
_warned_ops: set[str] = set()


def explain(error: BaseException, *, op: str, backend: str,
            takes_interpret: bool) -> BaseException | None:
    """The exception to raise instead of `error` (raised while building op
    `op`'s kernel from a user's function on `backend`), or None to re-raise
    `error` itself, possibly with a note added. `takes_interpret`: whether
    the user's function has an `interpret` parameter."""
    if isinstance(error, SimulatorLimit):
        return _limit_error(op, backend, error.limit, error.what_to_do, error.where)
    jax_limit = _jax_simulator_limit(error)
    if jax_limit is not None:
        return _limit_error(op, backend, *jax_limit, _user_location(error))
    if isinstance(error, ValueError) and _CPU_ERROR in str(error):
        if takes_interpret:
            fix = ("pass the function's `interpret` argument on to every pl.pallas_call, "
                   "pl.kernel and plgpu.kernel it makes (one was compiled without it), or "
                   "leave `interpret=` out of that call")
        else:
            fix = ("give the function an `interpret=None` parameter and pass it on to its "
                   "pl.pallas_call / pl.kernel / plgpu.kernel calls (torch_pallas passes "
                   "what the backend needs), or call the kernels without `interpret=`")
        add_note(error, f"{op}: on backend {backend!r} the kernel was compiled for the CPU "
                        f"without interpret mode. Fix: {fix}; torch_pallas runs a kernel "
                        "called without `interpret=` under JAX's interpret-mode context for "
                        "the backend.")
    return None


def _limit_error(op: str, backend: str, limit: str, what_to_do: str,
                 where: str | None) -> BackendLimitError:
    return BackendLimitError(
        f"{op}: backend {backend!r} cannot run this kernel: {limit}"
        f"{f' (at {where})' if where else ''}. What to do: {what_to_do}"
        f"{' (or run it on a GPU: backend mosaic_gpu)' if backend == 'mosaic_gpu_interpret' else ''}.")


def _jax_simulator_limit(error: BaseException) -> tuple[str, str] | None:
    """(limit, what to do) for an exception JAX's Mosaic GPU or TPU
    simulator raised, found by where it was raised (its innermost frame)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return None
    where = frames[-1].filename.replace("\\", "/")
    version = jax_env.jax().__version__
    line = (frames[-1].line or "").strip()
    if isinstance(error, TypeError) and "kernel_arg_transforms" in str(error):
        return (f"JAX {version}'s Mosaic GPU interpret mode cannot batch a pl.pallas_call "
                "under jax.vmap (its batching rule does not take the simulator's "
                "kernel_arg_transforms: a JAX bug)",
                "run it on backend 'interpret', or add the batch as a grid dimension instead "
                "of vmapping the kernel")
    if _TPU_SIMULATOR_FILES in where and isinstance(error, AssertionError) and (
            "CompilerParams" in line):
        return (f"JAX {version}'s TPU simulator runs only kernels with TPU compiler "
                "parameters (pltpu.CompilerParams), and this pallas_call carries another "
                "backend's (a Triton-style or Mosaic GPU kernel)",
                "run it on backend 'interpret' (JAX's generic interpreter), or on the "
                "simulator of the kernel's own family")
    if _GPU_SIMULATOR_FILES not in where:
        return None
    message = str(error)
    if isinstance(error, AssertionError) and "has_trivial_window" in line:
        return (f"JAX {version}'s Mosaic GPU simulator runs a pl.pallas_call only with "
                "whole-array blocks (it asserts has_trivial_window() for every BlockSpec), "
                "and torch_pallas could not reach this pallas_call to simulate its windows",
                f"call it from the custom op's function itself, or {WHAT_RUNS}")
    if message.startswith("Higher-order primitive"):
        primitive = message.removeprefix("Higher-order primitive").strip()
        return (f"JAX {version}'s Mosaic GPU simulator cannot interpret `{primitive}` "
                "inside a kernel", f"express that part of the kernel without `{primitive}`")
    if "load_p is not supported" in message or "swap_p is not supported" in message:
        return (f"JAX {version}'s Mosaic GPU simulator does not support pl.load / pl.store",
                "index the refs instead (x = ref[...], ref[...] = x)")
    if isinstance(error, (NotImplementedError, AssertionError)):
        return (f"a limit of JAX {version}'s Mosaic GPU simulator "
                f"({type(error).__name__}: {message or line})",
                "simplify that part of the kernel")
    return None


def _user_location(error: BaseException) -> str | None:
    """file:line of the user's code that JAX records as the source of the
    failing operation (its JaxStackTraceBeforeTransformation cause)."""
    cause = error.__cause__
    if cause is None or type(cause).__name__ != "JaxStackTraceBeforeTransformation":
        return None
    frames = traceback.extract_tb(cause.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


def pallas_call_grids(fn: Callable, avals) -> list[tuple[str, tuple[int, ...]]]:
    """(kernel name, grid) of every pl.pallas_call `fn` makes when traced
    for `avals` ((shape, dtype) pairs), inside jit, custom_vjp, cond and
    loops too (a loop's body counted once)."""
    jax = jax_env.jax()
    shapes = [jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype)) for shape, dtype in avals]
    closed = jax.make_jaxpr(fn)(*shapes)
    grids = []
    not_a_kernel = lambda e: e.primitive.name != "pallas_call"  # noqa: E731
    for eqn in jaxpr_walk.equations(closed.jaxpr, enter=not_a_kernel):
        if eqn.primitive.name == "pallas_call":
            grid = tuple(d for d in eqn.params["grid_mapping"].grid if isinstance(d, int))
            debug = getattr(eqn.params["jaxpr"], "debug_info", None)
            name = eqn.params.get("name") or getattr(debug, "func_name", None) or "kernel"
            grids.append((str(name), grid))
    return grids


def check_grid(op: str, backend: str, fn: Callable, avals) -> None:
    """Warns (FineGridWarning, once per op) when `fn`'s pallas_call grids
    have FINE_GRID_STEPS steps or more on the `interpret` backend."""
    if backend != "interpret" or op in _warned_ops:
        return
    try:
        grids = pallas_call_grids(fn, avals)
    except Exception:  # advice never breaks a call that built
        return
    steps = sum(math.prod(grid) for _, grid in grids)
    if steps < FINE_GRID_STEPS:
        return
    _warned_ops.add(op)
    name, grid = max(grids, key=lambda g: math.prod(g[1]))
    warnings.warn(FineGridWarning(
        f"{op}: its pallas_call grids run {steps} steps per call on backend 'interpret' "
        f"(largest: {name} with grid {grid}). JAX's generic interpreter copies whole "
        "buffers on every grid step, so each step costs about a pass over the kernel's "
        "arrays: this kernel runs far slower than with larger blocks. What to do: on this "
        f"backend use blocks that cover the arrays in a few steps (under {FINE_GRID_STEPS}; "
        "whole-array blocks are fastest), e.g. choose block sizes by backend: the "
        "function's `interpret` argument is True on 'interpret'. A library's kernel whose "
        "blocks are not yours to choose: silence this with warnings.filterwarnings("
        "'ignore', category=torch_pallas.FineGridWarning)."), stacklevel=2)
