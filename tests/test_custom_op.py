"""torch_pallas.custom_op: users' Pallas kernels as torch ops (the examples,
a kernel written here in a few lines, and the errors for what the API cannot
map)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import torch
from jax.experimental import pallas as pl

import torch_pallas

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


rms_norm = load_example("rms_norm")
softmax = load_example("softmax")

SIMPLE_BACKENDS = ("interpret", "tpu_interpret")  # where pl.pallas_call runs on CPU


@pytest.mark.parametrize("backend", SIMPLE_BACKENDS)
@pytest.mark.parametrize("shape", [(1, 128), (37, 256), (2, 5, 384)], ids=str)
def test_rms_norm_example_forward_and_backward(backend, shape):
    x = torch.randn(shape, requires_grad=True)
    w = torch.randn(shape[-1], requires_grad=True)
    grad = torch.randn(shape)
    with torch_pallas.backend(backend):
        out = torch.ops.examples.rms_norm(x, w, 1e-5)
        gx, gw = torch.autograd.grad(out, (x, w), grad)
    ref = rms_norm.rms_norm_reference(x, w, 1e-5)
    ex, ew = torch.autograd.grad(ref, (x, w), grad)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, ex, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gw, ew, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", SIMPLE_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_example(backend, dtype):
    x = (torch.randn(3, 29, 200) * 5).to(dtype).requires_grad_()
    grad = torch.randn(3, 29, 200).to(dtype)
    with torch_pallas.backend(backend):
        out = torch.ops.examples.softmax(x)
        (gx,) = torch.autograd.grad(out, x, grad)
    ref = x.double().softmax(-1)
    (ex,) = torch.autograd.grad(ref, x, grad.double())
    assert out.dtype == gx.dtype == dtype
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(gx.double(), ex.double(), **tol)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_examples_pass_opcheck(requires_grad):
    x = torch.randn(9, 128, requires_grad=requires_grad)
    w = torch.randn(128, requires_grad=requires_grad)
    torch.library.opcheck(torch.ops.examples.rms_norm.default, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.examples.softmax.default, (x,))


def test_user_op_compiles_with_dynamic_shapes():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    w = torch.randn(128)

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def block(x):
        return torch.ops.examples.softmax(torch.ops.examples.rms_norm(x, w, 1e-6)) * 2

    torch._dynamo.reset()
    for batch, seq in [(2, 5), (3, 9), (4, 17)]:
        x = torch.randn(batch, seq, 128)
        expected = rms_norm.rms_norm_reference(x, w, 1e-6).softmax(-1) * 2
        torch.testing.assert_close(block(x), expected, rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1


def test_a_new_kernel_in_a_few_lines_works_eagerly_compiled_and_with_opcheck():
    # -- what a user writes: 10 lines ---------------------------------------
    @torch_pallas.custom_op("usertest::scaled_relu")
    def scaled_relu(x: torch.Tensor, scale: float, interpret=None) -> torch.Tensor:
        def kernel(x_ref, o_ref):
            o_ref[...] = jnp.maximum(x_ref[...], 0) * scale

        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              interpret=interpret)(x)
    # ------------------------------------------------------------------------
    x = torch.randn(33, 70)
    torch.testing.assert_close(torch.ops.usertest.scaled_relu(x, 1.5), x.relu() * 1.5)
    compiled = torch.compile(lambda x: torch.ops.usertest.scaled_relu(x, 0.5) + 1, fullgraph=True)
    torch.testing.assert_close(compiled(x), x.relu() * 0.5 + 1)
    torch.library.opcheck(torch.ops.usertest.scaled_relu.default, (x, 2.0))
    assert scaled_relu(x, 3.0).shape == x.shape  # the returned op is callable too


def test_two_outputs_and_static_arguments_in_the_cache_key():
    @torch_pallas.custom_op("usertest::split_scale")
    def split_scale(x: torch.Tensor, factor: int) -> tuple[torch.Tensor, torch.Tensor]:
        return x * factor, (x - 1).astype(jnp.int32)

    x = torch.randn(4, 6)
    a, b = torch.ops.usertest.split_scale(x, 3)
    torch.testing.assert_close(a, x * 3)
    assert b.dtype == torch.int32 and torch.equal(b, (x - 1).to(torch.int32))
    torch.testing.assert_close(torch.ops.usertest.split_scale(x, 5)[0], x * 5)


def test_flop_formula_of_a_user_op_sees_shapes_and_static_arguments():
    from torch.utils.flop_counter import FlopCounterMode

    def flops(x_shape, w_shape, repeats, *, out_shape):
        return 2 * repeats * out_shape[0] * out_shape[1] * x_shape[1]

    @torch_pallas.custom_op("usertest::repeated_matmul", flops=flops)
    def repeated_matmul(x: torch.Tensor, w: torch.Tensor, repeats: int) -> torch.Tensor:
        for _ in range(repeats):
            x = x @ w
        return x

    x, w = torch.randn(5, 7), torch.randn(7, 7) / 7**0.5
    with FlopCounterMode(display=False) as counter:
        out = torch.ops.usertest.repeated_matmul(x, w, 3)
    torch.testing.assert_close(out, x @ w @ w @ w, rtol=1e-5, atol=1e-5)
    assert counter.get_total_flops() == 2 * 3 * 5 * 7 * 7


def test_outputs_the_api_cannot_map_raise_clearly():
    @torch_pallas.custom_op("usertest::not_an_array")
    def not_an_array(x: torch.Tensor) -> torch.Tensor:
        return None

    with pytest.raises(TypeError, match="usertest::not_an_array: output 0 .* not an array"):
        torch.ops.usertest.not_an_array(torch.randn(3))

    @torch_pallas.custom_op("usertest::complex_out")
    def complex_out(x: torch.Tensor) -> torch.Tensor:
        return x.astype(jnp.complex64)

    with pytest.raises(TypeError, match="usertest::complex_out: output 0 .* complex64"):
        torch.ops.usertest.complex_out(torch.randn(3))

    @torch_pallas.custom_op("usertest::wrong_count")
    def wrong_count(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x

    with pytest.raises(TypeError, match="usertest::wrong_count: the JAX function must return 2"):
        torch.ops.usertest.wrong_count(torch.randn(3))


def test_inputs_and_signatures_the_api_cannot_map_raise_clearly():
    with pytest.raises(TypeError, match="usertest::bad_param: parameter 'n' has annotation"):
        @torch_pallas.custom_op("usertest::bad_param")
        def bad_param(x: torch.Tensor, n: dict[str, int]) -> torch.Tensor:
            return x

    with pytest.raises(TypeError, match="usertest::no_return: annotate the return"):
        @torch_pallas.custom_op("usertest::no_return")
        def no_return(x: torch.Tensor):
            return x

    @torch_pallas.custom_op("usertest::identity")
    def identity(x: torch.Tensor) -> torch.Tensor:
        return x + 0

    with pytest.raises(TypeError, match="usertest::identity: x has dtype torch.complex64"):
        torch.ops.usertest.identity(torch.randn(3, dtype=torch.complex64))
    with pytest.raises(TypeError, match="usertest::identity: x must be a dense .* torch.sparse_coo"):
        torch.ops.usertest.identity(torch.randn(3).to_sparse())
    with pytest.raises(TypeError, match="usertest::identity: x must be a torch.Tensor, got None"):
        torch.ops.usertest.identity(None)  # the dispatcher lets None through

    with pytest.raises(TypeError, match="usertest::optional: tensor parameter 'y' has a default"):
        @torch_pallas.custom_op("usertest::optional")
        def optional(x: torch.Tensor, y: torch.Tensor = None) -> torch.Tensor:
            return x if y is None else x + y


def test_autograd_paths_of_a_user_op():
    """Without gradients the op runs below autograd (no graph); with them,
    backward gets only the gradients asked for; an op declared not
    differentiable says so when differentiated."""
    @torch_pallas.custom_op("usertest::times_two", differentiable=False)
    def times_two(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @torch_pallas.custom_op("usertest::weighted", backward=lambda g, x, w: (g * w, g * x))
    def weighted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    x, w = torch.randn(5, 3, requires_grad=True), torch.randn(5, 3)
    with torch.no_grad():
        assert torch.ops.usertest.weighted(x, w).grad_fn is None
    out = torch.ops.usertest.weighted(x, w)
    out.backward(torch.ones_like(out))
    torch.testing.assert_close(x.grad, w)
    assert w.grad is None

    y = torch.ops.usertest.times_two(x)
    torch.testing.assert_close(y, x.detach() * 2)
    with pytest.raises(RuntimeError, match="usertest::times_two has no backward"):
        y.sum().backward()


def test_keyword_only_arguments_reach_the_backward():
    @torch_pallas.custom_op("usertest::scaled", backward=lambda g, x, scale: g * scale)
    def scaled(x: torch.Tensor, *, scale: float = 2.0) -> torch.Tensor:
        return x * scale

    x = torch.randn(4, 3, requires_grad=True)
    torch.ops.usertest.scaled(x, scale=3.0).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4, 3), 3.0))
    x.grad = None
    torch.ops.usertest.scaled(x).sum().backward()  # the default
    torch.testing.assert_close(x.grad, torch.full((4, 3), 2.0))

    with pytest.raises(TypeError, match="usertest::kw_tensor: tensor parameter 'w' is keyword-only"):
        @torch_pallas.custom_op("usertest::kw_tensor")
        def kw_tensor(x: torch.Tensor, *, w: torch.Tensor) -> torch.Tensor:
            return x * w


def test_a_kernel_registered_for_the_device_takes_over_with_and_without_grad():
    """A torch.library kernel for the CPU key overrides the op's own, as the
    dispatcher decides; calls needing no gradient take no short cut past it."""
    @torch_pallas.custom_op("usertest::doubled")
    def doubled(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    x = torch.randn(6)
    torch.testing.assert_close(torch.ops.usertest.doubled(x), x * 2)
    override = torch.library.Library("usertest", "IMPL")
    try:
        override.impl("doubled", lambda x: x * 3, "CPU")
        with torch.no_grad():
            torch.testing.assert_close(torch.ops.usertest.doubled(x), x * 3)
        torch.testing.assert_close(torch.ops.usertest.doubled(x), x * 3)
        torch.testing.assert_close(torch.ops.usertest.doubled(x.requires_grad_()), x * 3)
    finally:
        override._destroy()
    with torch.no_grad():  # the registration gone, the op's own kernel again
        torch.testing.assert_close(torch.ops.usertest.doubled(x), x * 2)
    torch.testing.assert_close(torch.ops.usertest.doubled(x), x * 2)


def test_static_and_interpret_parameters_may_come_before_the_tensors():
    @torch_pallas.custom_op("usertest::scale_first")
    def scale_first(scale: float, interpret, x: torch.Tensor, shift: int = 0) -> torch.Tensor:
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * scale + shift

        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              interpret=interpret)(x)

    x = torch.randn(5, 33)
    torch.testing.assert_close(torch.ops.usertest.scale_first(2.5, x), x * 2.5)
    torch.testing.assert_close(torch.ops.usertest.scale_first(0.5, x, shift=3), x * 0.5 + 3)
    compiled = torch.compile(lambda x: torch.ops.usertest.scale_first(1.5, x) - 1, fullgraph=True)
    torch.testing.assert_close(compiled(x), x * 1.5 - 1)


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
def test_output_sizes_computed_from_input_sizes_under_compile(dynamic):
    @torch_pallas.custom_op(f"usertest::flat_twice_{'dynamic' if dynamic else 'automatic'}")
    def flat_twice(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.reshape(-1), jnp.concatenate([x, x])[1:]

    compiled = torch.compile(lambda x: [y * 2 for y in flat_twice(x)], fullgraph=True,
                             dynamic=dynamic)
    torch._dynamo.reset()
    for rows in (4, 6, 9):  # the output sizes are 3n and 2n - 1, which no input size is
        x = torch.randn(rows, 3)
        flat, doubled = compiled(x)
        torch.testing.assert_close(flat, x.reshape(-1) * 2)
        torch.testing.assert_close(doubled, torch.cat([x, x])[1:] * 2)


def test_output_sizes_clamped_or_rounded_are_not_taken_for_the_input_size():
    """Sizes that equal the input's at some sizes only: min(n, 16) and n
    rounded up to a multiple of 8. Compiled with dynamic shapes, the graph
    must not assume either is n."""
    @torch_pallas.custom_op("usertest::head16")
    def head16(x: torch.Tensor) -> torch.Tensor:
        return x[:16] * 2

    @torch_pallas.custom_op("usertest::pad8")
    def pad8(x: torch.Tensor) -> torch.Tensor:
        return jnp.pad(x, ((0, -x.shape[0] % 8),))

    def rows(x):  # uses the op's output size only
        return torch.ones(torch.ops.usertest.head16(x).shape[0]).sum()

    compiled_rows = torch.compile(rows, fullgraph=True, dynamic=True)
    compiled_pad = torch.compile(lambda x: torch.ops.usertest.pad8(x) + 1, fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    for n in (3, 40, 8, 12):
        x = torch.randn(n)
        assert compiled_rows(x).item() == min(n, 16)
        torch.testing.assert_close(compiled_pad(x), torch.nn.functional.pad(x, (0, -n % 8)) + 1)


def test_an_int_parameter_torch_compile_makes_symbolic():
    @torch_pallas.custom_op("usertest::tile")
    def tile(x: torch.Tensor, n: int) -> torch.Tensor:
        return jnp.tile(x, n)

    x = torch.randn(7)
    compiled = torch.compile(lambda x, n: torch.ops.usertest.tile(x, n) * 2, fullgraph=True)
    torch._dynamo.reset()
    for n in (2, 3, 5):  # from the second value on, Dynamo passes n as a SymInt
        torch.testing.assert_close(compiled(x, n), x.repeat(n) * 2)
    by_size = torch.compile(lambda x: torch.ops.usertest.tile(x, x.shape[0]), dynamic=True,
                            fullgraph=True)
    for size in (3, 4):
        y = torch.randn(size)
        torch.testing.assert_close(by_size(y), y.repeat(size))


def test_errors_from_tracing_the_jax_function_name_the_op_and_inputs():
    @torch_pallas.custom_op("usertest::bad_shapes")
    def bad_shapes(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y

    x, y = torch.randn(8, 16), torch.randn(8, 15)
    with pytest.raises(TypeError, match="incompatible shapes") as eager:
        torch.ops.usertest.bad_shapes(x, y)
    assert any("usertest::bad_shapes" in n and "(8, 15)" in n for n in eager.value.__notes__)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode, pytest.raises(TypeError, match="incompatible shapes") as fake:
        torch.ops.usertest.bad_shapes(mode.from_tensor(x), mode.from_tensor(y))
    assert any("usertest::bad_shapes: tracing" in n for n in fake.value.__notes__)


def test_a_backward_returning_the_wrong_number_of_gradients_names_the_op():
    @torch_pallas.custom_op("usertest::bad_backward", backward=lambda g, x, w: g)
    def bad_backward(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    out = torch.ops.usertest.bad_backward(torch.randn(3, requires_grad=True), torch.randn(3))
    with pytest.raises(TypeError, match="usertest::bad_backward: the backward must return 2"):
        out.sum().backward()


def test_empty_inputs_with_empty_outputs_run_no_kernel():
    @torch_pallas.custom_op("usertest::doubled_or_empty")
    def doubled(x: torch.Tensor, interpret=None) -> torch.Tensor:
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 2

        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              interpret=interpret)(x)

    @torch_pallas.custom_op("usertest::count_elements")
    def count(x: torch.Tensor) -> torch.Tensor:  # an empty input, a non-empty output
        return jnp.full((1,), x.size, jnp.int32)

    for shape in [(0, 16), (3, 0), (0,)]:
        out = torch.ops.usertest.doubled_or_empty(torch.randn(shape))
        assert out.shape == shape and out.dtype == torch.float32
    assert torch.equal(torch.ops.usertest.count_elements(torch.randn(4, 0)), torch.tensor([0], dtype=torch.int32))
    x = torch.randn(5, 16)
    torch.testing.assert_close(torch.ops.usertest.doubled_or_empty(x), x * 2)


def test_a_user_ops_triton_implementation_is_what_cuda_tracing_sees(tmp_path):
    """`custom_op(..., triton=)`: AOTAutograd on fake CUDA tensors traces the
    Triton implementation (the op differentiated by JAX included: its
    forward op returns the implementation's output as a list)."""
    from helpers import fake_cuda_trace

    # triton.jit needs its kernel in a file.
    (tmp_path / "twice_op.py").write_text('''import torch, torch_pallas
import triton
import triton.language as tl

@triton.jit
def twice_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(o_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)

def twice_triton(x, *, wrap):
    out = torch.empty_like(x)
    wrap(twice_kernel)[(triton.cdiv(x.numel(), 128),)](x, out, x.numel(), BLOCK=128)
    return out

@torch_pallas.custom_op("tracetest::twice", triton=twice_triton)
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2

class Model(torch.nn.Module):
    def forward(self, x):
        return (torch.ops.tracetest.twice(x) + 1,)
''')
    model = f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nfrom twice_op import Model\n"
    lines = fake_cuda_trace(model, "inputs = (torch.randn(100, device='cuda'),)")
    assert lines["KERNELS"].split() == ["twice_kernel"]
    assert int(lines["WRAPPERS"]) == 1


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_user_ops_promise_what_they_return_on_model_layouts(dynamic):
    """A user's op promises row-major outputs (its fake is built from
    jax.eval_shape) and returns them, whatever its inputs' layouts and
    whatever layout the JAX function computes (`x.T`): opcheck's fake-tensor
    check on each layout of tests/layouts.py, then forward and backward
    (JAX's autodiff: the op's __forward and __backward ops) compiled with
    fullgraph=True against eager."""
    from layouts import LAYOUTS, compiled_matches_eager, rebased

    @torch_pallas.custom_op(f"usertest::transposed_scale_{dynamic}")
    def transposed_scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x * w).T[None] * 2  # (1, H, N): a size-1 dimension in front

    calls = [(transposed_scale, (torch.randn(7, 24), torch.randn(24)), {}),
             (torch.ops.examples.rms_norm, (torch.randn(2, 5, 128), torch.randn(128), 1e-5), {})]
    for op, args, kwargs in calls:
        args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) else a for a in args)
        overload = op._packet.default if isinstance(op, torch_pallas.custom_ops.CustomOp) else op.default
        for layout in LAYOUTS:
            bases, rebuild = rebased(args, kwargs, layout)
            call_args, call_kwargs = rebuild([b.detach() for b in bases])
            torch.library.opcheck(overload, call_args, call_kwargs, test_utils="test_faketensor")
        compiled_matches_eager(op, args, kwargs, dynamic=dynamic, what=str(op))
