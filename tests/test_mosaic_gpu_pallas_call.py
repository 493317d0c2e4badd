"""`pl.pallas_call` with pipelined BlockSpecs on Mosaic GPU, the quickstart's
compatibility route: examples/mosaic_gpu_pallas_call.py's matmul and other
windowed pallas_calls run in the Mosaic GPU simulator through
torch_pallas.custom_op (torch_pallas/custom_ops/mosaic_gpu_pallas_call.py) against
float64 torch references, and lower for sm_90a; what a backend cannot run
names its limit (torch_pallas/custom_ops/kernel_advice.py), and a fine grid on the
`interpret` backend warns."""

from __future__ import annotations

import functools
import importlib.util
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import torch_pallas
from helpers import assert_within
from test_mosaic_gpu_lowering import aval, lower_for_hopper
from torch_pallas import custom_ops
from torch_pallas.base import jax_env
from torch_pallas.custom_ops import kernel_advice, mosaic_gpu_pallas_call

SIMULATOR = "mosaic_gpu_interpret"
# JAX 0.10.2 warns when a pl.pallas_call lowers for Mosaic GPU (docs/custom_ops.md).
PALLAS_CALL_DEPRECATED = pytest.mark.filterwarnings(
    "ignore:Using ``pl.pallas_call`` for Mosaic GPU kernels is deprecated:DeprecationWarning")
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "mosaic_gpu_pallas_call.py"


def load_example():
    name = "mosaic_gpu_pallas_call"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


example = load_example()


def matmul_bound(a, b, ref, torch_out):
    """Twice torch's own error in the same dtype, plus one unit in the last
    place of the result and a float32 sum's rounding in another order (both
    accumulate in float32, then round)."""
    ulp = torch.finfo(a.dtype).eps * ref.abs()
    products = a.double().abs() @ b.double().abs()
    accumulation = a.shape[1] * torch.finfo(torch.float32).eps * products
    return 2 * (torch_out.double() - ref).abs() + ulp + accumulation


# --- the example's matmul: pallas_call + plgpu.CompilerParams ---------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,k,n,tile", [(128, 128, 64, 64), (70, 200, 72, 64), (130, 72, 136, 128)],
                         ids=str)
def test_example_matmul_on_the_simulator(dtype, m, k, n, tile):
    """Whole and ragged tiles (zero-padded by the example), several K steps
    accumulated in the plgpu.ACC scratch, against the float64 product."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    with torch_pallas.backend(SIMULATOR):
        out = torch.ops.examples.pallas_call_matmul(a, b, tile, tile)
    ref = example.matmul_reference(a, b)
    assert out.dtype == dtype
    assert_within(out, ref, matmul_bound(a, b, ref, a @ b), f"{dtype} {m}x{k}x{n}")


def test_example_refuses_float32():
    a = torch.randn(64, 64)
    with torch_pallas.backend(SIMULATOR), pytest.raises(ValueError, match="float16 or bfloat16"):
        torch.ops.examples.pallas_call_matmul(a, a)


def hopper_forms(f):
    """The forms of `f` that may run on a GPU: torch_pallas's re-expression of
    its pallas_calls (what the mosaic_gpu backend runs on JAX 0.11 on, which
    lowers only plgpu.kernel to Mosaic GPU), and JAX's own lowering where
    this JAX has one (0.10)."""
    forms = {"torch_pallas": mosaic_gpu_pallas_call.for_hardware(f)}
    if jax_env.pallas_call_lowers_for_mosaic_gpu():
        forms["jax"] = f
    return forms


@PALLAS_CALL_DEPRECATED
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("m,k,n", [(1000, 999, 1001), (256, 64, 128)], ids=str)
@pytest.mark.parametrize("tile,steps", [(128, 2), (64, 4)], ids=str)
def test_example_matmul_lowers_for_hopper(dtype, m, k, n, tile, steps):
    """The hardware path the call is lowered to (a pipeline over K, TMA with
    the swizzled layout, wgmma, the SMEM budget)."""
    f = functools.partial(example.matmul, tile_m=tile, tile_n=tile,
                          max_concurrent_steps=steps, interpret=None)
    for form in hopper_forms(f).values():
        lower_for_hopper(form, aval((m, k), dtype), aval((k, n), dtype))


def test_the_mosaic_gpu_backend_runs_what_this_jax_lowers():
    run = custom_ops._as_run_on(scaled_rows, "mosaic_gpu")
    assert (run is scaled_rows) == jax_env.pallas_call_lowers_for_mosaic_gpu()


# --- other windowed pallas_calls on the simulator ---------------------------

ROWS = 8


def scaled_rows(x, interpret):
    """x * 2 + the row block's index: pl.BlockSpec, a grid, no plgpu
    CompilerParams (every dimension parallel), pl.program_id at the top."""
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2 + pl.program_id(0).astype(x_ref.dtype)

    spec = pl.BlockSpec((ROWS, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(kernel, grid=(pl.cdiv(x.shape[0], ROWS),), in_specs=[spec],
                          out_specs=spec, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=interpret)(x)


def weighted_column_blocks(x, interpret, width=128):
    """sum over column blocks j > 0 of j * x[:, j-th block] + the row block's
    index (counted by a fori_loop): a ("parallel", "sequential") grid whose
    output block stays put along the sequential dimension, with
    pl.program_id inside pl.when and inside a loop."""
    def kernel(x_ref, o_ref):
        j = pl.program_id(1)

        @pl.when(j == 0)
        def _init():
            rows = jax.lax.fori_loop(0, pl.program_id(0), lambda _, c: c + 1, 0)
            o_ref[...] = jnp.full(o_ref.shape, rows, o_ref.dtype)

        @pl.when(j > 0)
        def _accumulate():
            o_ref[...] += x_ref[...] * pl.program_id(1).astype(x_ref.dtype)

    m, n = x.shape
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(m, ROWS), n // width),
        in_specs=[pl.BlockSpec((ROWS, width), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((ROWS, width), lambda i, j: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((m, width), x.dtype),
        compiler_params=plgpu.CompilerParams(dimension_semantics=("parallel", "sequential"),
                                             max_concurrent_steps=2),
        interpret=interpret)(x)


def weighted_column_blocks_reference(x, width=128):
    x64 = x.double()
    blocks = x64.reshape(x.shape[0], -1, width)
    weights = torch.arange(blocks.shape[1], dtype=torch.float64)[None, :, None]
    row_blocks = (torch.arange(x.shape[0]) // ROWS).double()[:, None]
    return (blocks * weights).sum(1) + row_blocks


@torch_pallas.custom_op("test_mosaic_gpu_pallas_call::scaled_rows")
def scaled_rows_op(x: torch.Tensor, interpret=None) -> torch.Tensor:
    return scaled_rows(x, interpret)


@torch_pallas.custom_op("test_mosaic_gpu_pallas_call::weighted_column_blocks")
def weighted_column_blocks_op(x: torch.Tensor, interpret=None) -> torch.Tensor:
    # Inside jax.jit and lax.cond: reached there too.
    return jax.jit(lambda v: jax.lax.cond(v.shape[0] > 0, lambda u: weighted_column_blocks(
        u, interpret), lambda u: u[:, :128], v))(x)


@pytest.mark.parametrize("rows", [8, 20], ids=lambda r: f"rows={r}")
def test_blockspec_grid_without_compiler_params(rows):
    """The call the simulator used to refuse with a bare AssertionError;
    20 rows: the last block runs past the edge (TMA reads zeros, drops
    writes there)."""
    x = torch.randn(rows, 128)
    with torch_pallas.backend(SIMULATOR):
        out = torch.ops.test_mosaic_gpu_pallas_call.scaled_rows(x)
    ref = x.double() * 2 + (torch.arange(rows) // ROWS).double()[:, None]
    assert_within(out, ref, 1e-6, "scaled_rows")


def test_parallel_and_sequential_dimensions():
    x = torch.randn(20, 3 * 128)
    with torch_pallas.backend(SIMULATOR):
        out = torch.ops.test_mosaic_gpu_pallas_call.weighted_column_blocks(x)
    ref = weighted_column_blocks_reference(x)
    assert_within(out, ref, 1e-5 * (1 + ref.abs()), "weighted_column_blocks")


@torch_pallas.custom_op("test_mosaic_gpu_pallas_call::row_per_program")
def row_per_program_op(x: torch.Tensor, interpret=None) -> torch.Tensor:
    """Whole arrays in GMEM, one program per row: windows the simulator
    takes, a pl.program_id it reads as 0 for every program."""
    def kernel(x_ref, o_ref):
        i = pl.program_id(0)
        o_ref[i] = x_ref[i] + i.astype(x_ref.dtype)

    gmem = pl.BlockSpec(memory_space=plgpu.GMEM)
    return pl.pallas_call(kernel, grid=(x.shape[0],), in_specs=[gmem], out_specs=gmem,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=interpret)(x)


def test_program_ids_of_a_grid_over_whole_arrays():
    x = torch.randn(4, 128)
    with torch_pallas.backend(SIMULATOR):
        out = torch.ops.test_mosaic_gpu_pallas_call.row_per_program(x)
    assert_within(out, x.double() + torch.arange(4).double()[:, None], 1e-6, "row_per_program")


@PALLAS_CALL_DEPRECATED
def test_windowed_kernels_lower_for_hopper():
    for f in (scaled_rows, weighted_column_blocks):
        for form in hopper_forms(functools.partial(f, interpret=None)).values():
            lower_for_hopper(form, aval((200, 256), "float32"))


def test_the_hardware_form_computes_the_same_values():
    """The re-expression for a GPU as it is (no padding: the last row block
    runs past the edge), run in the simulator: where TMA reads zeros past
    an array's edge as the hardware's does (JAX 0.11 on), the same values;
    on JAX 0.10, whose simulator raises there instead, that refusal (which
    is why the simulated form pads)."""
    interpret = jax_env.gpu_interpret_params(detect_races=False)
    x = torch.randn(20, 3 * 128)
    hardware_form = mosaic_gpu_pallas_call._rewritten(
        functools.partial(weighted_column_blocks, interpret=interpret),
        mosaic_gpu_pallas_call._takes_simulated, hardware=True)

    def run():
        return torch.from_numpy(np.array(jax.jit(hardware_form)(jnp.asarray(x.numpy()))))

    if not jax_env.gpu_simulator_reads_zeros_past_edges():
        try:
            with pytest.raises(Exception, match="Out-of-bounds read"):
                run()
        finally:
            jax_env.reset_simulator("mosaic_gpu")
        return
    ref = weighted_column_blocks_reference(x)
    assert_within(run(), ref, 1e-5 * (1 + ref.abs()), "weighted_column_blocks")


# --- what the simulator cannot run says which limit it hit ------------------

@torch_pallas.custom_op("test_mosaic_gpu_pallas_call::aliased")
def aliased_op(x: torch.Tensor, interpret=None) -> torch.Tensor:
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    spec = pl.BlockSpec((ROWS, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(kernel, grid=(x.shape[0] // ROWS,), in_specs=[spec], out_specs=spec,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          input_output_aliases={0: 0}, interpret=interpret)(x)


@torch_pallas.custom_op("test_mosaic_gpu_pallas_call::program_id_in_run_scoped")
def program_id_in_run_scoped_op(x: torch.Tensor, interpret=None) -> torch.Tensor:
    def kernel(x_ref, o_ref):
        def scoped(tmp_ref):
            tmp_ref[...] = x_ref[...] + pl.program_id(0).astype(x_ref.dtype)
            o_ref[...] = tmp_ref[...]

        pl.run_scoped(scoped, plgpu.SMEM(x_ref.shape, x_ref.dtype))

    spec = pl.BlockSpec((ROWS, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(kernel, grid=(x.shape[0] // ROWS,), in_specs=[spec], out_specs=spec,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=interpret)(x)


@pytest.mark.parametrize("op,limit", [
    ("aliased", "input_output_aliases"),
    ("program_id_in_run_scoped", "pl.program_id or pl.num_programs inside `run_scoped`"),
])
def test_a_limit_names_the_op_the_backend_and_what_to_do(op, limit):
    x = torch.randn(16, 128)
    with torch_pallas.backend(SIMULATOR), pytest.raises(torch_pallas.BackendLimitError) as info:
        getattr(torch.ops.test_mosaic_gpu_pallas_call, op)(x)
    message = str(info.value)
    assert f"test_mosaic_gpu_pallas_call::{op}: backend 'mosaic_gpu_interpret'" in message
    assert limit in message and "What to do:" in message
    assert "test_mosaic_gpu_pallas_call.py:" in message  # where in the user's code


def lowering_error(f, *avals):
    try:
        jax.jit(f).lower(*avals)
    except Exception as e:
        return e
    raise AssertionError("lowered")


def test_jax_simulator_assertion_is_explained():
    """JAX's bare AssertionError (a windowed pallas_call handed to the
    simulator as it is) becomes a BackendLimitError naming the limit."""
    interpret = jax_env.gpu_interpret_params(detect_races=False)
    error = lowering_error(functools.partial(scaled_rows, interpret=interpret),
                           aval((16, 128), "float32"))
    assert type(error) is AssertionError and not str(error)
    explained = kernel_advice.explain(error, op="mylib::op", backend=SIMULATOR,
                                      takes_interpret=True)
    assert isinstance(explained, torch_pallas.BackendLimitError)
    assert "mylib::op: backend 'mosaic_gpu_interpret' cannot run this kernel" in str(explained)
    assert "whole-array blocks" in str(explained) and "plgpu.emit_pipeline" in str(explained)


@pytest.mark.parametrize("takes_interpret", [True, False])
def test_cpu_error_gets_a_hint(takes_interpret):
    error = lowering_error(functools.partial(scaled_rows, interpret=None),
                           aval((16, 128), "float32"))
    assert "Only interpret mode is supported on CPU backend" in str(error)
    assert kernel_advice.explain(error, op="mylib::op", backend="interpret",
                                 takes_interpret=takes_interpret) is None
    note = error.__notes__[-1]
    assert note.startswith("mylib::op: on backend 'interpret'")
    assert ("pass the function's `interpret` argument on" if takes_interpret
            else "give the function an `interpret=None` parameter") in note
    assert "without `interpret=`" in note


@torch_pallas.custom_op("test_mosaic_gpu_pallas_call::reads_past_the_edge")
def reads_past_the_edge_op(x: torch.Tensor, interpret=None) -> torch.Tensor:
    """Two programs copy 16 rows each: past the edge of fewer than 32."""
    def kernel(x_gmem, o_gmem, smem, barrier):
        rows = pl.ds(jax.lax.axis_index("i") * 16, 16)
        plgpu.copy_gmem_to_smem(x_gmem.at[rows], smem, barrier)
        plgpu.barrier_wait(barrier)
        o_gmem[rows] = smem[...]

    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((32, x.shape[1]), x.dtype),
                        scratch_types=[plgpu.SMEM((16, x.shape[1]), x.dtype), plgpu.Barrier()],
                        grid=(2,), grid_names=("i",), interpret=interpret)(x)


def test_read_past_an_edge_is_explained_when_it_runs():
    x = torch.randn(20, 128)
    if jax_env.gpu_simulator_reads_zeros_past_edges():  # JAX 0.11 on: as TMA does
        with torch_pallas.backend(SIMULATOR):
            out = torch.ops.test_mosaic_gpu_pallas_call.reads_past_the_edge(x)
        torch.testing.assert_close(out, torch.cat([x, torch.zeros(12, 128)]))
        return
    with torch_pallas.backend(SIMULATOR), pytest.raises(Exception) as info:
        torch.ops.test_mosaic_gpu_pallas_call.reads_past_the_edge(x)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "test_mosaic_gpu_pallas_call::reads_past_the_edge (inputs" in notes
    assert "pad the operands to whole blocks" in notes
    x = torch.randn(32, 128)  # the simulator runs again after the failure
    with torch_pallas.backend(SIMULATOR):
        torch.testing.assert_close(torch.ops.test_mosaic_gpu_pallas_call.reads_past_the_edge(x), x)


# --- a fine grid on the `interpret` backend warns once ----------------------

def rows_plus_one(x, block_rows, interpret):
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    spec = pl.BlockSpec((block_rows, x.shape[1]), lambda i: (i, 0))
    return pl.pallas_call(kernel, grid=(x.shape[0] // block_rows,), in_specs=[spec],
                          out_specs=spec, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          interpret=interpret)(x)


@torch_pallas.custom_op("test_mosaic_gpu_pallas_call::fine_grid")
def fine_grid_op(x: torch.Tensor, interpret=None) -> torch.Tensor:
    return jax.jit(functools.partial(rows_plus_one, block_rows=8, interpret=interpret))(x)


@torch_pallas.custom_op("test_mosaic_gpu_pallas_call::coarse_grid")
def coarse_grid_op(x: torch.Tensor, interpret=None) -> torch.Tensor:
    return rows_plus_one(x, block_rows=x.shape[0] // 2, interpret=interpret)


def fine_grid_warnings(op, *shapes):
    with warnings.catch_warnings(record=True) as caught, torch_pallas.backend("interpret"):
        warnings.simplefilter("always")
        for shape in shapes:
            x = torch.randn(shape)
            torch.testing.assert_close(op(x), x + 1)
    return [w for w in caught if issubclass(w.category, torch_pallas.FineGridWarning)]


def test_fine_grid_warns_once_per_op():
    steps = kernel_advice.FINE_GRID_STEPS
    caught = fine_grid_warnings(torch.ops.test_mosaic_gpu_pallas_call.fine_grid,
                                (8 * steps, 128), (16 * steps, 128))
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert message.startswith("test_mosaic_gpu_pallas_call::fine_grid: its pallas_call grids "
                              f"run {steps} steps per call on backend 'interpret'")
    assert "copies whole buffers on every grid step" in message and "larger blocks" in message


def test_coarse_grid_does_not_warn():
    assert not fine_grid_warnings(torch.ops.test_mosaic_gpu_pallas_call.coarse_grid,
                                  (4096, 128))


def test_pallas_call_grids_are_found_inside_jit_and_loops():
    def f(x):
        y = jax.jit(functools.partial(rows_plus_one, block_rows=8, interpret=True))(x)
        return jax.lax.fori_loop(0, 2, lambda _, v: rows_plus_one(v, 16, True), y)

    grids = kernel_advice.pallas_call_grids(f, [((64, 128), "float32")])
    assert [grid for _, grid in grids] == [(8,), (4,)]
