"""torch_pallas.custom_op without a hand-written backward: gradients from JAX's
autodiff of the function (its kernels' custom_vjp rules, the residuals they
keep), and the signatures, dtypes and interpret handling JAX's own kernels
need."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
import torch
from jax.experimental import io_callback
from jax.experimental import pallas as pl

import torch_pallas

# -- a Pallas kernel with its own custom_vjp: softmax over the last axis,
# -- whose backward reads the forward's output and a row statistic ----------

BLOCK_ROWS = 8


def _rows(x):
    """x (R, C) zero-padded to whole blocks of rows."""
    return jnp.pad(x, ((0, -x.shape[0] % BLOCK_ROWS), (0, 0)))


def _accumulation(dtype):
    return jnp.promote_types(dtype, jnp.float32)  # float64 stays float64


def _softmax_kernel(x_ref, o_ref, m_ref):
    x = x_ref[...].astype(_accumulation(x_ref.dtype))
    m = jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x - m)
    s = jnp.sum(e, axis=-1, keepdims=True)
    o_ref[...] = (e / s).astype(o_ref.dtype)
    m_ref[...] = m + jnp.log(s)  # the row's log-sum-exp


def _softmax_backward_kernel(o_ref, g_ref, dx_ref):
    acc = _accumulation(o_ref.dtype)
    o, g = o_ref[...].astype(acc), g_ref[...].astype(acc)
    dx_ref[...] = (o * (g - jnp.sum(o * g, axis=-1, keepdims=True))).astype(dx_ref.dtype)


forward_runs = []  # one entry per forward kernel execution (io_callback)


def _count_forward():
    forward_runs.append(1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def pallas_softmax(x, interpret):
    return _softmax_forward(x, interpret)[0]


def _softmax_forward(x, interpret):
    rows, cols = x.shape
    xp = _rows(x)
    spec = pl.BlockSpec((BLOCK_ROWS, cols), lambda i: (i, 0))
    stat = pl.BlockSpec((BLOCK_ROWS, 1), lambda i: (i, 0))
    out, lse = pl.pallas_call(
        _softmax_kernel, grid=(xp.shape[0] // BLOCK_ROWS,), in_specs=[spec],
        out_specs=[spec, stat],
        out_shape=[jax.ShapeDtypeStruct(xp.shape, x.dtype),
                   jax.ShapeDtypeStruct((xp.shape[0], 1), _accumulation(x.dtype))],
        interpret=interpret,
    )(xp)
    io_callback(_count_forward, None, ordered=False)
    return out[:rows], lse[:rows]


def _softmax_fwd(x, interpret):
    out, lse = _softmax_forward(x, interpret)
    return out, (x, out, lse)  # x and out: an input and an output; lse: computed


def _softmax_bwd(interpret, residuals, g):
    x, out, lse = residuals
    rows, cols = out.shape
    spec = pl.BlockSpec((BLOCK_ROWS, cols), lambda i: (i, 0))
    op, gp = _rows(out), _rows(g)
    dx = pl.pallas_call(
        _softmax_backward_kernel, grid=(op.shape[0] // BLOCK_ROWS,), in_specs=[spec, spec],
        out_specs=spec, out_shape=jax.ShapeDtypeStruct(op.shape, x.dtype), interpret=interpret,
    )(op, gp)
    # lse is unused by this backward's math but must reach it intact:
    # a NaN here would poison dx if it were garbage.
    return (dx[:rows] + 0 * lse,)


pallas_softmax.defvjp(_softmax_fwd, _softmax_bwd)


@torch_pallas.custom_op("gradtest::softmax")
def softmax(x: torch.Tensor, interpret=None) -> torch.Tensor:
    return pallas_softmax(x, interpret)


@pytest.mark.parametrize("shape", [(1, 7), (13, 130), (40, 33)], ids=str)
def test_gradient_from_the_kernels_custom_vjp_without_running_the_forward_again(shape):
    x = (torch.randn(shape, dtype=torch.float32) * 3).requires_grad_()
    grad = torch.randn(shape)
    forward_runs.clear()
    out = softmax(x)
    (gx,) = torch.autograd.grad(out, x, grad)
    assert len(forward_runs) == 1  # the backward kernel ran no forward
    x64 = x.detach().double().requires_grad_()
    ref = x64.softmax(-1)
    (ex,) = torch.autograd.grad(ref, x64, grad.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx.double(), ex, rtol=1e-5, atol=1e-6)


def test_residuals_that_are_inputs_or_outputs_are_not_returned_again():
    x = torch.randn(9, 16)
    result = torch.ops.gradtest.softmax__forward(x, jax_residuals=True)
    # The output, then only the log-sum-exp: x and the output are saved as they are.
    assert [tuple(t.shape) for t in result] == [(9, 16), (9, 1)]
    torch.testing.assert_close(result[1][:, 0].double(), torch.logsumexp(x.double(), -1))
    assert len(torch.ops.gradtest.softmax__forward(x)) == 1


def test_gradients_from_jax_under_torch_compile_and_opcheck():
    compiled = torch.compile(lambda x: softmax(x * 2).square().sum(), fullgraph=True)
    for rows in (5, 12):
        x = torch.randn(rows, 24, requires_grad=True)
        compiled(x).backward()
        x64 = x.detach().double().requires_grad_()
        (x64 * 2).softmax(-1).square().sum().backward()
        torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)
    x = torch.randn(11, 40, requires_grad=True)
    torch.library.opcheck(torch.ops.gradtest.softmax.default, (x,))


def test_gradcheck_in_float64():
    x = torch.randn(6, 10, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(softmax(x), x.softmax(-1), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(softmax, (x,))


# -- gradients of plain JAX code and its edge cases --------------------------

def test_integer_inputs_get_no_gradient_and_integer_outputs_no_cotangent():
    @torch_pallas.custom_op("gradtest::gather_scale")
    def gather_scale(table: torch.Tensor, index: torch.Tensor, scale: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = table[index] * scale
        return rows, jnp.argmax(rows, axis=-1).astype(jnp.int32)

    table = torch.randn(10, 6, requires_grad=True)
    index = torch.tensor([3, 3, 7, 0], dtype=torch.int32)
    scale = torch.randn(6, requires_grad=True)
    rows, best = gather_scale(table, index, scale)
    assert best.dtype == torch.int32 and not best.requires_grad
    grad = torch.randn(4, 6)
    gt, gs = torch.autograd.grad(rows, (table, scale), grad)
    t64, s64 = table.detach().double().requires_grad_(), scale.detach().double().requires_grad_()
    et, es = torch.autograd.grad(t64[index.long()] * s64, (t64, s64), grad.double())
    torch.testing.assert_close(gt.double(), et)
    torch.testing.assert_close(gs.double(), es)
    torch.testing.assert_close(best, rows.argmax(-1).int())


def test_only_the_gradients_asked_for_and_none_for_an_absent_optional_tensor():
    @torch_pallas.custom_op("gradtest::affine")
    def affine(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        y = x @ w
        return y if b is None else y + b

    x, w = torch.randn(5, 3, requires_grad=True), torch.randn(3, 4)
    b = torch.randn(4, requires_grad=True)
    grad = torch.randn(5, 4)
    gx, gb = torch.autograd.grad(affine(x, w, b), (x, b), grad)
    torch.testing.assert_close(gx, grad @ w.T)
    torch.testing.assert_close(gb, grad.sum(0))
    (gx,) = torch.autograd.grad(affine(x, w), (x,), grad)  # b absent
    torch.testing.assert_close(gx, grad @ w.T)
    assert affine(x, w).grad_fn is not None and w.grad is None


def test_nested_outputs_and_gradients_through_each():
    @torch_pallas.custom_op("gradtest::stats")
    def stats(x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        m = jnp.max(x, axis=-1)
        return jnp.exp(x - m[:, None]), (m, jnp.log(jnp.sum(jnp.exp(x - m[:, None]), -1)) + m)

    x = torch.randn(4, 9, requires_grad=True)
    e, (m, lse) = stats(x)
    flat = torch.ops.gradtest.stats(x)
    assert len(flat) == 3 and torch.equal(flat[1], m)
    torch.testing.assert_close(lse, torch.logsumexp(x, -1))
    (g,) = torch.autograd.grad(lse.sum() + e.sum() * 0, x)
    torch.testing.assert_close(g, x.softmax(-1))


def test_a_function_jax_cannot_differentiate_raises_when_the_backward_runs():
    @torch_pallas.custom_op("gradtest::no_transpose")
    def no_transpose(x: torch.Tensor, interpret=None) -> torch.Tensor:
        def kernel(x_ref, o_ref):
            o_ref[...] = jnp.sin(x_ref[...])

        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              interpret=interpret)(x)

    x = torch.randn(8, 16, requires_grad=True)
    out = no_transpose(x)  # the forward runs
    torch.testing.assert_close(out, torch.sin(x.detach()))
    with pytest.raises(Exception) as error:
        out.sum().backward()
    notes = " ".join(getattr(error.value, "__notes__", [])) + str(error.value)
    assert "gradtest::no_transpose" in notes and "custom_vjp" in notes and "backward=" in notes


def test_a_backward_with_the_wrong_signature_is_refused_when_the_op_is_defined():
    with pytest.raises(TypeError, match=r"gradtest::bad_arity: backward must take 1 output "
                                        r"gradient\(s\), then the op's 2 arguments \(x, w\)"):
        @torch_pallas.custom_op("gradtest::bad_arity", backward=lambda g, x: (g, None))
        def bad_arity(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return x * w


# -- the signatures JAX's kernels have --------------------------------------

@dataclasses.dataclass(frozen=True)
class Tiles:
    rows: int = 8
    scale: float = 1.0


def test_static_types_reach_the_function_as_jax_code_expects():
    seen = []

    @torch_pallas.custom_op("gradtest::statics")
    def statics(x: torch.Tensor, mode: str, shape: tuple[int, ...], weights: list[float],
                dtype: torch.dtype, cap: float | None = None, tiles: Tiles | None = None,
                flag: bool | None = None) -> torch.Tensor:
        seen.append((mode, shape, weights, dtype, cap, tiles, flag))
        y = x.reshape(shape).astype(dtype) * sum(weights)
        if cap is not None:
            y = cap * jnp.tanh(y / cap)
        if tiles is not None:
            y = y * tiles.scale
        return -y if mode == "negate" else y

    x = torch.randn(6, 4)
    out = statics(x, "negate", (4, 6), [0.5, 1.5], torch.bfloat16, 3.0, Tiles(scale=2.0))
    expected = -(3.0 * torch.tanh(x.reshape(4, 6).to(torch.bfloat16).double() * 2 / 3)) * 2
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)
    mode, shape, weights, dtype, cap, tiles, flag = seen[-1]
    assert (mode, shape, weights, cap, tiles, flag) == ("negate", (4, 6), (0.5, 1.5), 3.0,
                                                        Tiles(scale=2.0), None)
    assert dtype == jnp.bfloat16
    # Each static value is part of the kernel's identity.
    other = statics(x, "keep", (24,), [1.0], torch.float32, None, Tiles(scale=0.5))
    torch.testing.assert_close(other, x.reshape(24) * 0.5)
    compiled = torch.compile(
        lambda x: statics(x, "keep", (3, 8), [2.0], torch.float32, tiles=Tiles(rows=4)) + 1,
        fullgraph=True)
    torch.testing.assert_close(compiled(x), x.reshape(3, 8) * 2 + 1)
    torch.library.opcheck(torch.ops.gradtest.statics.default,
                          (x, "keep", [4, 6], [1.0], torch.float32))


# -- dtypes ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_float8_in_and_out(dtype):
    @torch_pallas.custom_op(f"gradtest::dequantize_{str(dtype)[6:]}")
    def dequantize(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values = q.astype(jnp.float32) * scale
        return values, (values / scale * 2).astype(q.dtype)

    x = torch.randn(5, 33) * 4
    q, scale = x.to(dtype), torch.rand(33) + 0.5
    values, requantized = dequantize(q, scale)
    torch.testing.assert_close(values, q.float() * scale, rtol=0, atol=0)
    assert requantized.dtype == dtype
    torch.testing.assert_close(requantized.float(), (q.float() * 2).to(dtype).float(),
                               rtol=0, atol=0)


def test_64_bit_tensors_reach_the_function_exactly():
    @torch_pallas.custom_op("gradtest::wide")
    def wide(x: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + 1e-12, n * 3

    x = torch.randn(7, dtype=torch.float64)
    n = torch.tensor([2**40 + 1, -(2**35), 5], dtype=torch.int64)
    y, m = wide(x, n)
    assert y.dtype == torch.float64 and m.dtype == torch.int64
    assert torch.equal(y, x + 1e-12) and torch.equal(m, n * 3)
    assert not jax.config.read("jax_enable_x64")  # scoped to the kernel
    f32 = torch.ops.gradtest.softmax(torch.randn(3, 8))
    assert f32.dtype == torch.float32


# -- interpret mode without the user's help ----------------------------------

def test_kernels_without_interpret_run_as_the_backend_needs():
    @torch_pallas.custom_op("gradtest::no_interpret_param")
    def doubled(x: torch.Tensor) -> torch.Tensor:
        def kernel(x_ref, o_ref):
            o_ref[...] = x_ref[...] * 2

        # No interpret=: JAX would refuse to lower this for the CPU.
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

    x = torch.randn(8, 128)
    for backend in ("interpret", "tpu_interpret"):
        with torch_pallas.backend(backend):
            torch.testing.assert_close(doubled(x), x * 2)


def test_the_shape_evaluation_traces_with_the_backends_interpret():
    @torch_pallas.custom_op("gradtest::backend_shaped")
    def shaped(x: torch.Tensor, interpret=None) -> torch.Tensor:
        # A function whose output depends on what it is told it runs on.
        return jnp.zeros((1 if interpret is True else 2, 3)) + x.sum()

    x = torch.randn(4)
    # aot_eager: Inductor would reuse the first graph it compiled, whose size
    # checks hold for the backend it was traced for.
    compiled = torch.compile(lambda x: shaped(x) + 0, fullgraph=True, backend="aot_eager")
    with torch_pallas.backend("tpu_interpret"):
        torch._dynamo.reset()
        assert shaped(x).shape == compiled(x).shape == (2, 3)
    torch._dynamo.reset()
    assert shaped(x).shape == compiled(x).shape == (1, 3)
