"""`pl.pallas_call` with BlockSpec windows on the Mosaic GPU simulator
(`mosaic_gpu_interpret`), as Mosaic GPU runs it on the hardware.

On a GPU, Mosaic GPU lowers a `pallas_call` into one CUDA block per point of
its "parallel" grid dimensions, each running a `plgpu.emit_pipeline` over the
"sequential" ones (`plgpu.CompilerParams(dimension_semantics=...)`; without
them every dimension is parallel): the pipeline copies each step's input
blocks GMEM -> SMEM by TMA, runs the kernel body on the SMEM blocks and copies
the output blocks back (jax/_src/pallas/mosaic_gpu/lowering.py,
`lower_pipelined_jaxpr_to_module`). JAX 0.10.2's simulator does not: it runs
a `pallas_call` only with whole-array blocks (it asserts
`has_trivial_window()` for every BlockSpec) and returns 0 for every
`pl.program_id`.

So, on that backend, torch_pallas replaces each such `pallas_call` of a
user's function (torch_pallas.custom_op) with the same structure spelled in
what the simulator runs: a `plgpu.kernel` whose grid is the parallel
dimensions, and in it a loop over the sequential steps that, per step, TMA-
copies the input blocks (the BlockSpecs' index maps and transforms, so
TilingTransform/SwizzleTransform layouts for wgmma are simulated), runs the
kernel's own traced body with `pl.program_id`/`pl.num_programs` bound to the
step's indices, and copies the output blocks back. The values are those of
the hardware pipeline, blocks past an array's edge included (TMA reads zeros
there and drops writes; the simulator would raise, so the arrays are
zero-padded to whole blocks around the simulated kernel). Its overlap is not
simulated: the steps run one at a time, each step's copies waited for before
its body, where the hardware keeps `max_concurrent_steps` of them in flight,
so a race that the overlap would cause is not found here.

Only pallas_calls are replaced that the simulator would get wrong (a window
or more than one grid point) and that the function makes where this module
can reach them: directly, or inside `jax.jit`, `custom_jvp`/`custom_vjp`,
`checkpoint`, `cond`, `while` and `scan` (re-expressed by
torch_pallas/custom_ops/jaxpr_walk.py); `plgpu.kernel` and `pl.kernel` calls are left
to the simulator as they are.

What it cannot take raises torch_pallas.BackendLimitError, naming the limit
(torch_pallas/custom_ops/kernel_advice.py): input/output aliases, scalar prefetch,
dynamic grids, vmapped calls, `pl.Element`/`pl.BoundedSlice` blocks, a
windowed block in GMEM, scratch other than SMEM and `plgpu.ACC`, and a
`pl.program_id` inside a `pl.run_scoped` body.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

from torch_pallas.base import jax_env
from torch_pallas.custom_ops import jaxpr_walk

_PROGRAM_ID_PRIMITIVES = ("program_id", "num_programs")
WHAT_RUNS = ("write the kernel with plgpu.kernel and plgpu.emit_pipeline (what Mosaic GPU "
             "lowers a pipelined pallas_call to; examples/mosaic_gpu_pallas_call.py)")


class SimulatorLimit(Exception):
    """A kernel a simulator cannot run: `limit` (what the kernel does that
    the simulator cannot) and `what_to_do`. Internal: kernel_advice.explain turns
    it into a BackendLimitError that names the op and the backend."""

    def __init__(self, limit: str, what_to_do: str, where: str | None = None):
        super().__init__(f"{limit}; {what_to_do}")
        self.limit = limit
        self.what_to_do = what_to_do
        self.where = where  # file:line of the user's code, if known


def simulated(fn: Callable) -> Callable:
    """`fn` (JAX arrays in and out) with its windowed `pallas_call`s for the
    Mosaic GPU simulator replaced as the module docstring says; `fn` itself
    when it has none."""

    @functools.wraps(fn)
    def run(*args):
        jax = jax_env.jax()
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        if not any(_takes(e) for e in jaxpr_walk.equations(closed.jaxpr, enter=_not_a_kernel)):
            return fn(*args)
        try:
            outs = jaxpr_walk.evaluate(closed.jaxpr, closed.consts, args, replace=_replace,
                                       wanted=_takes, enter=_not_a_kernel)
        except jaxpr_walk.UnsupportedNesting as e:
            raise SimulatorLimit(
                f"a pl.pallas_call with BlockSpec windows inside `{e.primitive}`, which "
                "torch_pallas cannot re-express for the Mosaic GPU simulator",
                f"call the pallas_call outside `{e.primitive}`, or {WHAT_RUNS}") from None
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return run


def _not_a_kernel(eqn) -> bool:
    return eqn.primitive.name != "pallas_call"


def _takes(eqn) -> bool:
    """Whether `eqn` is a pallas_call this module runs for the simulator:
    one without a mesh (plgpu.kernel and pl.kernel have one), in GPU
    interpret mode, whose windows or grid the simulator would get wrong."""
    if eqn.primitive.name != "pallas_call" or eqn.params.get("mesh") is not None:
        return False
    if type(eqn.params.get("interpret")).__name__ != "InterpretGPUParams":
        return False
    gm = eqn.params["grid_mapping"]
    grid_points = math.prod(d if isinstance(d, int) else 2 for d in gm.grid)
    return grid_points > 1 or not all(bm.has_trivial_window() for bm in gm.block_mappings)


def _replace(eqn, invals):
    if not _takes(eqn):
        return None
    try:
        return _pipelined_call(eqn, invals)
    except SimulatorLimit as e:
        if e.where is None:  # name the user's pallas_call
            e.where = source_location(eqn)
        raise


def _refuse(limit: str, what_to_do: str = WHAT_RUNS):
    raise SimulatorLimit(limit, what_to_do)


def _check(eqn):
    """Raises SimulatorLimit for what this module cannot simulate."""
    jax_env.jax()
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    p = eqn.params
    gm = p["grid_mapping"]
    if gm.num_dynamic_grid_bounds or not all(isinstance(d, int) for d in gm.grid):
        _refuse("a pl.pallas_call with a dynamic grid", "give the grid static sizes")
    if gm.num_index_operands:
        _refuse("a pl.pallas_call with scalar prefetch (num_scalar_prefetch)",
                "pass the scalars as SMEM or GMEM operands")
    if gm.vmapped_dims:
        _refuse("a vmapped pl.pallas_call with BlockSpec windows",
                "add the batch as a grid dimension of the pallas_call instead of vmapping it")
    if p.get("input_output_aliases"):
        _refuse("a pl.pallas_call with BlockSpec windows and input_output_aliases",
                "return a new output instead of aliasing an input")
    cp = p.get("compiler_params")
    if cp is not None and not isinstance(cp, plgpu.CompilerParams):
        _refuse(f"a pl.pallas_call with {type(cp).__name__}, another backend's compiler "
                "parameters (a Triton-style kernel, say, which JAX lowers with Triton on a GPU)",
                "run it on backend 'interpret' (JAX's generic interpreter runs such kernels), "
                "or give it plgpu.CompilerParams if it is written for Mosaic GPU")
    for bm in gm.block_mappings:
        if any(isinstance(b, (pl.Element, pl.BoundedSlice)) for b in bm.block_shape):
            _refuse(f"a BlockSpec of {bm.origin} with pl.Element or pl.BoundedSlice "
                    "dimensions (Mosaic GPU supports only blocked ones)",
                    "use plain block sizes")
        if getattr(bm, "pipeline_mode", None) is not None:
            _refuse(f"a BlockSpec of {bm.origin} with pipeline_mode (Mosaic GPU has none)",
                    "leave pipeline_mode out; CompilerParams(max_concurrent_steps=) sets "
                    "the buffering")
        space = bm.transformed_block_aval.memory_space
        if _is_gmem(space) and not bm.has_trivial_window():
            _refuse(f"a BlockSpec of {bm.origin} in GMEM with a window (Mosaic GPU needs GMEM "
                    "blocks to be the whole array)", "leave memory_space out (SMEM blocks)")
        if not (_is_gmem(space) or _is_smem(space)):
            _refuse(f"a BlockSpec of {bm.origin} in memory space {space}",
                    "use SMEM (the default) or GMEM blocks")
    for v in p["jaxpr"].invars[gm.slice_scratch_ops]:
        if _scratch_type(v.aval) is None:
            _refuse(f"scratch of type {v.aval} (torch_pallas simulates SMEM and plgpu.ACC "
                    "scratch of a pallas_call)")


def _is_gmem(space) -> bool:
    return space is not None and str(space) == "gmem"


def _is_smem(space) -> bool:
    """SMEM, or no memory space given: Mosaic GPU stages such blocks in SMEM."""
    return space is None or str(space) in ("smem", "default")


def _scratch_type(aval):
    """The allocation for a kernel's scratch operand: plgpu.ACC or SMEM."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if type(aval).__name__ == "WGMMAAbstractAccumulatorRef":
        return plgpu.ACC(aval.shape, aval.dtype)
    space = getattr(aval, "memory_space", None)
    if hasattr(aval, "shape") and hasattr(aval, "dtype") and space is not None \
            and str(space) == "smem":
        return plgpu.SMEM(aval.shape, aval.dtype)
    return None


def _block_shape(bm) -> tuple[int, ...]:
    """The block as the kernel sees it (squeezed dimensions dropped)."""
    from jax.experimental import pallas as pl

    return tuple(b.block_size if isinstance(b, pl.Blocked) else b
                 for b in bm.block_shape if not isinstance(b, pl.Squeezed) and b is not None)


def _window(bm, grid_indices):
    """The GMEM slice of block `bm` at grid point `grid_indices`."""
    jax = jax_env.jax()
    from jax.experimental import pallas as pl

    imap = bm.index_map_jaxpr
    starts = jax.core.eval_jaxpr(imap.jaxpr, imap.consts, *grid_indices)
    window = []
    for b, i in zip(bm.block_shape, starts):
        if b is None or isinstance(b, pl.Squeezed):
            window.append(i)
        else:
            size = b.block_size if isinstance(b, pl.Blocked) else b
            window.append(pl.ds(i * size, size))
    return tuple(window)


def _pipelined_call(eqn, invals):
    """The outputs of pallas_call `eqn` on `invals`, run as a plgpu.kernel
    over its parallel dimensions with a loop over its sequential ones."""
    _check(eqn)
    jax = jax_env.jax()
    lax = jax.lax
    from jax._src.pallas import core as pallas_core  # GridAxis, grid_env: no public spelling
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    p = eqn.params
    gm = p["grid_mapping"]
    kernel_jaxpr = p["jaxpr"]
    grid = tuple(gm.grid)
    cp = p.get("compiler_params") or plgpu.CompilerParams()
    semantics = cp.dimension_semantics or ("parallel",) * len(grid)
    parallel = [s == "parallel" for s in semantics]
    names = tuple(f"pallas_call_axis{axis}" for axis, par in enumerate(parallel) if par)
    parallel_grid = tuple(d for d, par in zip(grid, parallel) if par)
    sequential_grid = tuple(d for d, par in zip(grid, parallel) if not par)
    n_in = gm.num_inputs
    mappings = gm.block_mappings
    windowed = [not _is_gmem(bm.transformed_block_aval.memory_space) for bm in mappings]
    block_types = [plgpu.SMEM(_block_shape(bm), bm.array_aval.dtype,
                              transforms=tuple(bm.transforms))
                   for bm, w in zip(mappings, windowed) if w]
    scratch_types = [_scratch_type(v.aval) for v in kernel_jaxpr.invars[gm.slice_scratch_ops]]
    copies_in = sum(windowed[:n_in])

    def grid_point(step, parallel_ids):
        sequential = []
        for d in reversed(sequential_grid):  # the last dimension varies fastest
            sequential.append(step % d)
            step = step // d
        seq, par = iter(sequential[::-1]), iter(parallel_ids)
        return [next(par) if is_par else next(seq) for is_par in parallel]

    def is_program_id(e):
        return e.primitive.name in _PROGRAM_ID_PRIMITIVES

    def body(*gmem_refs):
        parallel_ids = [lax.axis_index(n) for n in names]

        def run_steps(blocks, barrier, scratch):
            def step(s, carry):
                ids = grid_point(s, parallel_ids)
                smem = iter(blocks)
                refs = [next(smem) if w else g for g, w in zip(gmem_refs, windowed)]
                for bm, g, ref, w in zip(mappings[:n_in], gmem_refs, refs, windowed):
                    if w:
                        plgpu.copy_gmem_to_smem(g.at[_window(bm, ids)], ref, barrier)
                if copies_in:
                    plgpu.barrier_wait(barrier)
                env = [pallas_core.GridAxis(i, d) for i, d in zip(ids, grid)]
                with pallas_core.grid_env(env):  # pl.program_id/num_programs read it
                    try:
                        jaxpr_walk.evaluate(kernel_jaxpr, (), [*map(_untransformed, refs),
                                                               *scratch],
                                            replace=lambda e, v: None, wanted=is_program_id)
                    except jaxpr_walk.UnsupportedNesting as e:
                        _refuse(f"pl.program_id or pl.num_programs inside `{e.primitive}` in "
                                "a pl.pallas_call kernel",
                                "read them at the kernel's top level and use the values "
                                "inside")
                plgpu.commit_smem()
                for bm, g, ref, w in zip(mappings[n_in:], gmem_refs[n_in:], refs[n_in:],
                                         windowed[n_in:]):
                    if w:
                        plgpu.copy_smem_to_gmem(ref, g.at[_window(bm, ids)])
                plgpu.wait_smem_to_gmem(0)
                return carry

            lax.fori_loop(0, math.prod(sequential_grid), step, None)

        def allocate(scratch, remaining):
            # One allocation each: the simulator cannot place a plgpu.ACC in
            # one allocation with SMEM refs.
            if remaining:
                return pl.run_scoped(lambda ref: allocate([*scratch, ref], remaining[1:]),
                                     remaining[0])
            barrier = plgpu.Barrier(num_arrivals=copies_in) if copies_in else None
            return pl.run_scoped(lambda blocks, bar: run_steps(blocks, bar, scratch),
                                 block_types, barrier)

        allocate([], scratch_types)

    body.__name__ = str(p.get("name") or "pallas_call")
    # Edge blocks: TMA reads zeros past an array's edge and drops writes
    # there; the simulator raises instead, so arrays are padded to whole
    # blocks around the kernel.
    padded = [_whole_blocks(bm) if w else bm.array_aval.shape
              for bm, w in zip(mappings, windowed)]
    inputs = [jax.numpy.pad(x, [(0, q - d) for d, q in zip(x.shape, shape)])
              if tuple(shape) != tuple(x.shape) else x
              for x, shape in zip(invals, padded[:n_in])]
    out_type = [jax.ShapeDtypeStruct(shape, a.dtype)
                for a, shape in zip(p["out_avals"], padded[n_in:])]
    outs = plgpu.kernel(body, out_type=out_type, grid=parallel_grid, grid_names=names,
                        interpret=p["interpret"])(*inputs)
    return [o[tuple(slice(0, d) for d in a.shape)] if o.shape != a.shape else o
            for o, a in zip(outs, p["out_avals"])]


def _whole_blocks(bm) -> tuple[int, ...]:
    """Block `bm`'s array shape rounded up to whole blocks."""
    from jax.experimental import pallas as pl

    shape = []
    for b, d in zip(bm.block_shape, bm.array_aval.shape):
        size = b.block_size if isinstance(b, pl.Blocked) else b
        shape.append(d if size is None or isinstance(b, pl.Squeezed) else -(-d // size) * size)
    return tuple(shape)


def _untransformed(ref):
    """The buffer under a transformed SMEM ref: the kernel's traced body
    applies its BlockSpec's (un)tiling and (un)swizzling itself."""
    return getattr(ref, "ref", ref)


def source_location(eqn) -> str | None:
    """file:line of the innermost frame outside JAX and torch_pallas in
    the traceback JAX recorded for equation `eqn`: the user's call."""
    libraries = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                      for m in (jax_env.jax(), jax_env))
    traceback_ = getattr(getattr(eqn, "source_info", None), "traceback", None)
    for frame in getattr(traceback_, "frames", ()):
        if not os.path.abspath(frame.file_name).startswith(libraries):
            return f"{frame.file_name}:{frame.line_num}"
    return None
