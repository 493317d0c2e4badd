"""`pl.pallas_call` with BlockSpec windows for Mosaic GPU, run as JAX 0.10's
Mosaic GPU lowering ran it on the hardware: on the simulator
(`mosaic_gpu_interpret`) on every JAX version, and on a GPU (`mosaic_gpu`)
where JAX no longer lowers it (0.11 on).

JAX 0.10 lowers a `pallas_call` into one CUDA block per point of its
"parallel" grid dimensions, each running a `plgpu.emit_pipeline` over the
"sequential" ones (`plgpu.CompilerParams(dimension_semantics=...)`; without
them every dimension is parallel): the pipeline copies each step's input
blocks GMEM -> SMEM by TMA, `max_concurrent_steps` steps ahead, runs the
kernel body on the SMEM blocks and copies the output blocks back
(jax/_src/pallas/mosaic_gpu/lowering.py, `lower_pipelined_jaxpr_to_module`).
Its simulator does not: it runs a `pallas_call` only with whole-array blocks
(it asserts `has_trivial_window()` for every BlockSpec) and returns 0 for
every `pl.program_id`. JAX 0.11 on lowers only `plgpu.kernel` to Mosaic GPU:
a `pallas_call` lowers to Triton on a GPU, and one with Mosaic GPU compiler
parameters fails a bare assertion (`jax_env.pallas_call_lowers_for_mosaic_gpu`).

So torch_pallas replaces each such `pallas_call` of a user's function
(torch_pallas.custom_op) with that structure spelled in public Mosaic GPU
API (`simulated`, `for_hardware`): a `plgpu.kernel` whose grid is the
parallel dimensions, and in it a pipeline over the sequential steps with
`max_concurrent_steps` SMEM slots per input block, which TMA-copies the
input blocks (the BlockSpecs' index maps and transforms, so
TilingTransform/SwizzleTransform layouts for wgmma are kept), runs the
kernel's own traced body with `pl.program_id`/`pl.num_programs` bound to the
step's indices, refills the slot for a later step and copies an output
block back when the next step moves to another block. In the simulator the
values are those of the hardware pipeline and its overlap is simulated,
blocks past an array's edge included (TMA reads zeros there and drops
writes; JAX 0.10's simulator would raise, so the arrays are zero-padded to
whole blocks around the simulated kernel).

Only pallas_calls are replaced that the simulator would get wrong (a window
or more than one grid point) or that the hardware path must re-express, and
that the function makes where this module can reach them: directly, or
inside `jax.jit`, `custom_jvp`/`custom_vjp`, `checkpoint`, `cond`, `while`
and `scan` (re-expressed by torch_pallas/custom_ops/jaxpr_walk.py);
`plgpu.kernel` and `pl.kernel` calls are left as they are.

What it cannot take raises torch_pallas.BackendLimitError, naming the limit
(torch_pallas/custom_ops/kernel_advice.py): input/output aliases, scalar prefetch,
dynamic grids, vmapped calls, `pl.Element`/`pl.BoundedSlice` blocks, a
windowed block in GMEM, scratch other than SMEM and `plgpu.ACC`, and a
`pl.program_id` inside a `pl.run_scoped` body.
"""

from __future__ import annotations

import dataclasses
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
    return _rewritten(fn, _takes_simulated, hardware=False)


def for_hardware(fn: Callable) -> Callable:
    """`fn` with each `pallas_call` written for Mosaic GPU (plgpu.CompilerParams
    or none, outside interpret mode) replaced by the kernel Mosaic GPU lowered
    it to, for a JAX that no longer lowers it (0.11 on:
    `jax_env.pallas_call_lowers_for_mosaic_gpu()`); `fn` itself when it has
    none."""
    return _rewritten(fn, _takes_for_hardware, hardware=True)


def _rewritten(fn: Callable, takes: Callable, *, hardware: bool) -> Callable:
    for_what = "this JAX's Mosaic GPU lowering" if hardware else "the Mosaic GPU simulator"

    def replace(eqn, invals):
        if not takes(eqn):
            return None
        try:
            return _pipelined_call(eqn, invals, hardware=hardware)
        except SimulatorLimit as e:
            if e.where is None:  # name the user's pallas_call
                e.where = source_location(eqn)
            raise

    @functools.wraps(fn)
    def run(*args):
        jax = jax_env.jax()
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        if not any(takes(e) for e in jaxpr_walk.equations(closed.jaxpr, enter=_not_a_kernel)):
            return fn(*args)
        try:
            outs = jaxpr_walk.evaluate(closed.jaxpr, closed.consts, args, replace=replace,
                                       wanted=takes, enter=_not_a_kernel)
        except jaxpr_walk.UnsupportedNesting as e:
            raise SimulatorLimit(
                f"a pl.pallas_call with BlockSpec windows inside `{e.primitive}`, which "
                f"torch_pallas cannot re-express for {for_what}",
                f"call the pallas_call outside `{e.primitive}`, or {WHAT_RUNS}") from None
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return run


def _not_a_kernel(eqn) -> bool:
    return eqn.primitive.name != "pallas_call"


def _takes_simulated(eqn) -> bool:
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


def _takes_for_hardware(eqn) -> bool:
    """Whether `eqn` is a pallas_call for Mosaic GPU on the hardware: no mesh,
    not interpreted, Mosaic GPU compiler parameters or none (JAX 0.10 lowered
    both to Mosaic GPU; Triton-style kernels carry Triton's)."""
    if eqn.primitive.name != "pallas_call" or eqn.params.get("mesh") is not None:
        return False
    if eqn.params.get("interpret"):
        return False
    jax_env.jax()
    from jax.experimental.pallas import mosaic_gpu as plgpu

    params = eqn.params.get("compiler_params")
    return params is None or isinstance(params, plgpu.CompilerParams)


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
            _refuse(f"scratch of type {v.aval} (torch_pallas runs a pallas_call's SMEM and "
                    "plgpu.ACC scratch)")


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


def _block_indices(bm, grid_indices) -> list:
    """Block `bm`'s indices at grid point `grid_indices` (its index map)."""
    jax = jax_env.jax()
    imap = bm.index_map_jaxpr
    return jax.core.eval_jaxpr(imap.jaxpr, imap.consts, *grid_indices)


def _window(bm, grid_indices):
    """The GMEM slice of block `bm` at grid point `grid_indices`."""
    jax_env.jax()
    from jax.experimental import pallas as pl

    window = []
    for b, i in zip(bm.block_shape, _block_indices(bm, grid_indices)):
        if b is None or isinstance(b, pl.Squeezed):
            window.append(i)
        else:
            size = b.block_size if isinstance(b, pl.Blocked) else b
            window.append(pl.ds(i * size, size))
    return tuple(window)


def _pipelined_call(eqn, invals, *, hardware: bool):
    """The outputs of pallas_call `eqn` on `invals`, run as Mosaic GPU lowers
    it (JAX 0.10's `lower_pipelined_jaxpr_to_module`): a plgpu.kernel over
    its parallel dimensions, in each program a pipeline over its sequential
    steps that keeps `max_concurrent_steps` steps' input blocks in flight
    (TMA copies into that many SMEM slots, each refilled as soon as its step
    has run) and writes an output block back when the next step moves to
    another block or at the last step, as Pallas's revisiting semantics say
    (an output block that stays put accumulates across steps). Each slot is
    its own allocation, so the kernel's traced body takes it as its block
    ref; the loop is unrolled over the slots.

    `hardware`: for a GPU (the arrays as they are: TMA reads zeros past an
    edge and drops writes there), or for the simulator (arrays zero-padded
    to whole blocks around the kernel: JAX 0.10's simulator raises there)."""
    _check(eqn)
    jax = jax_env.jax()
    lax = jax.lax
    jnp = jax.numpy
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
    steps = math.prod(sequential_grid)
    slots = max(1, min(cp.max_concurrent_steps, steps))
    n_in = gm.num_inputs
    mappings = gm.block_mappings
    windowed = [not _is_gmem(bm.transformed_block_aval.memory_space) for bm in mappings]
    inputs = [i for i in range(n_in) if windowed[i]]
    outputs = [i for i in range(n_in, len(mappings)) if windowed[i]]
    scratch_types = [_scratch_type(v.aval) for v in kernel_jaxpr.invars[gm.slice_scratch_ops]]

    def block_type(bm):
        return plgpu.SMEM(_block_shape(bm), bm.array_aval.dtype, transforms=tuple(bm.transforms))

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

        def fetch(step, slot_blocks, barrier):
            ids = grid_point(step, parallel_ids)
            for i, block in zip(inputs, slot_blocks):
                plgpu.copy_gmem_to_smem(gmem_refs[i].at[_window(mappings[i], ids)], block, barrier)

        def written_back(i, step):
            """Whether output block i leaves after `step`: the last step, or
            the next one maps it elsewhere."""
            here = _block_indices(mappings[i], grid_point(step, parallel_ids))
            there = _block_indices(mappings[i], grid_point(step + 1, parallel_ids))
            moved = [jnp.asarray(a) != jnp.asarray(b) for a, b in zip(here, there)]
            return functools.reduce(jnp.logical_or, moved, step == steps - 1)

        def run_step(step, slot, in_blocks, out_blocks, barriers, scratch):
            ids = grid_point(step, parallel_ids)
            if inputs:
                plgpu.barrier_wait(barriers[slot])
            if outputs:  # the last write-back has read the output blocks
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            blocks = iter([*in_blocks[slot], *out_blocks])
            refs = [_untransformed(next(blocks)) if w else g for g, w in zip(gmem_refs, windowed)]
            env = [pallas_core.GridAxis(i, d) for i, d in zip(ids, grid)]
            with pallas_core.grid_env(env):  # pl.program_id/num_programs read it
                try:
                    jaxpr_walk.evaluate(kernel_jaxpr, (), [*refs, *scratch],
                                        replace=lambda e, v: None, wanted=is_program_id)
                except jaxpr_walk.UnsupportedNesting as e:
                    _refuse(f"pl.program_id or pl.num_programs inside `{e.primitive}` in "
                            "a pl.pallas_call kernel",
                            "read them at the kernel's top level and use the values inside")
            # The TMA copies below read the output blocks and refill this
            # slot, which the body accessed with plain loads and stores: PTX
            # orders the two proxies only across this fence.
            plgpu.commit_smem()
            for i, block in zip(outputs, out_blocks):
                @pl.when(written_back(i, step))
                def _write_back(i=i, block=block):
                    plgpu.copy_smem_to_gmem(block, gmem_refs[i].at[_window(mappings[i], ids)])
            if inputs:
                @pl.when(step + slots < steps)
                def _refill():
                    fetch(step + slots, in_blocks[slot], barriers[slot])

        def run_steps(in_blocks, out_blocks, barriers, scratch):
            for slot in range(slots):  # slots <= steps
                if inputs:
                    fetch(slot, in_blocks[slot], barriers[slot])

            def round_(r, carry):
                for slot in range(slots):
                    step = r * slots + slot
                    if steps % slots:
                        pl.when(step < steps)(functools.partial(
                            run_step, step, slot, in_blocks, out_blocks, barriers, scratch))
                    else:
                        run_step(step, slot, in_blocks, out_blocks, barriers, scratch)
                return carry

            lax.fori_loop(0, -(-steps // slots), round_, None)
            if outputs:
                plgpu.wait_smem_to_gmem(0)

        def allocate(scratch, remaining):
            # One allocation each: the simulator cannot place a plgpu.ACC in
            # one allocation with SMEM refs.
            if remaining:
                return pl.run_scoped(lambda ref: allocate([*scratch, ref], remaining[1:]),
                                     remaining[0])
            in_types = [[block_type(mappings[i]) for i in inputs] for _ in range(slots)]
            out_types = [block_type(mappings[i]) for i in outputs]
            barrier_types = ([plgpu.Barrier(num_arrivals=len(inputs)) for _ in range(slots)]
                             if inputs else [])
            return pl.run_scoped(lambda ins, outs, bars: run_steps(ins, outs, bars, scratch),
                                 in_types, out_types, barrier_types)

        allocate([], scratch_types)

    body.__name__ = str(p.get("name") or "pallas_call")
    if hardware:
        shapes = [bm.array_aval.shape for bm in mappings]
        params = dict(compiler_params=dataclasses.replace(cp, dimension_semantics=None))
    else:
        # Edge blocks: TMA reads zeros past an array's edge and drops writes
        # there; JAX 0.10's simulator raises instead, so the arrays are
        # padded to whole blocks around the kernel.
        shapes = [_whole_blocks(bm) if w else bm.array_aval.shape
                  for bm, w in zip(mappings, windowed)]
        params = {}
    args = [jnp.pad(x, [(0, q - d) for d, q in zip(x.shape, shape)])
            if tuple(shape) != tuple(x.shape) else x
            for x, shape in zip(invals, shapes[:n_in])]
    out_type = [jax.ShapeDtypeStruct(shape, a.dtype)
                for a, shape in zip(p["out_avals"], shapes[n_in:])]
    outs = plgpu.kernel(body, out_type=out_type, grid=parallel_grid, grid_names=names,
                        interpret=p["interpret"], **params)(*args)
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
