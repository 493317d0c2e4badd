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
    with pytest.raises(TypeError, match="usertest::bad_param: parameter 'n' must be annotated"):
        @torch_pallas.custom_op("usertest::bad_param")
        def bad_param(x: torch.Tensor, n: str) -> torch.Tensor:
            return x

    with pytest.raises(TypeError, match="usertest::no_return: annotate the return"):
        @torch_pallas.custom_op("usertest::no_return")
        def no_return(x: torch.Tensor):
            return x

    @torch_pallas.custom_op("usertest::identity")
    def identity(x: torch.Tensor) -> torch.Tensor:
        return x + 0

    with pytest.raises(TypeError, match="usertest::identity: x has dtype torch.float64"):
        torch.ops.usertest.identity(torch.randn(3, dtype=torch.float64))


def test_autograd_paths_of_a_user_op():
    """Without gradients the op runs below autograd (no graph); with them,
    backward gets only the gradients asked for; an op without a backward
    says so when differentiated."""
    @torch_pallas.custom_op("usertest::times_two")
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
