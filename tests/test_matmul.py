"""pallas::matmul against a float64 reference on every CPU backend:
torch.matmul's semantics, layouts, gradients, autocast, dynamic shapes."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import torch_pallas
from torch_pallas.kernels.mosaic_gpu import matmul as mosaic_matmul
from torch_pallas.kernels.tpu import matmul as tpu_matmul
from torch_pallas.runtime import backends, bridge, compile_cache, registry
from torch_pallas.ops import matmul as matmul_op
from torch_pallas.ops.matmul import as_kernel_operand
from helpers import FLOAT_DTYPES, assert_within, random_tensor, shares_memory, simulators_exhaustive

SHAPES = [  # (M, K, N): tiny, ragged everywhere, exact tiles, K not a tile multiple
    (1, 1, 1),
    (7, 5, 3),
    (128, 64, 128),
    (130, 70, 200),
    (33, 257, 65),
]


def check_matmul(a, b):
    out = torch.ops.pallas.matmul(a, b)
    ref = matmul_op.reference(a, b)
    assert out.dtype == a.dtype and out.device == a.device
    assert out.shape == torch.matmul(a, b).shape
    assert_within(out, ref, matmul_op.error_bound(a, b, ref),
                  f"matmul {tuple(a.shape)}x{tuple(b.shape)} {a.dtype}")


SEMANTICS = [  # (a shape, b shape): every case of torch.matmul
    ((9,), (9,)),  # vector . vector
    ((6, 9), (9,)),  # matrix . vector
    ((9,), (9, 5)),  # vector . matrix
    ((3, 6, 9), (9, 5)),  # batch . matrix (folds into one product)
    ((3, 6, 9), (9,)),
    ((9,), (3, 9, 5)),
    ((6, 9), (3, 9, 5)),  # matrix . batch
    ((2, 3, 6, 9), (2, 3, 9, 5)),  # equal batches
    ((2, 1, 6, 9), (3, 9, 5)),  # broadcast batches
    ((1, 6, 9), (3, 9, 5)),
]


@pytest.mark.parametrize("a_shape,b_shape", SEMANTICS, ids=str)
def test_matmul_semantics_of_torch_matmul(cpu_backend, a_shape, b_shape):
    check_matmul(random_tensor(a_shape, torch.float32), random_tensor(b_shape, torch.float32))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_matmul_transposed_operands(cpu_backend, dtype):
    x = random_tensor((2, 40, 70), dtype)
    w = random_tensor((50, 70), dtype)
    check_matmul(x, w.t())  # x @ w.T: the Linear layout
    check_matmul(x.mT, random_tensor((40, 30), dtype))  # a transposed batch
    check_matmul(x.mT[1], x[0])  # a.T @ b


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_matmul_matches_float64(cpu_backend, m, k, n, dtype):
    check_matmul(random_tensor((m, k), dtype), random_tensor((k, n), dtype))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# Triton's CPU interpreter is a simulation too: 25-37 s a dtype at this size.
@pytest.mark.parametrize("cpu_backend", simulators_exhaustive(also=("triton",)), indirect=True)
def test_matmul_large_ragged(cpu_backend, dtype):
    check_matmul(random_tensor((1000, 999), dtype), random_tensor((999, 1001), dtype))


@pytest.mark.parametrize("transposed", [False, True], ids=["a", "a.mT"])
def test_matmul_many_rows_float32(transposed):
    """Enough rows that the interpret backend compiles the dot with oneDNN
    (kernels/tpu/matmul.py compiler_options): still exact to float32."""
    rows = tpu_matmul.ONEDNN_MIN_ROWS + 13
    a = random_tensor((37, rows), torch.float32).mT if transposed else random_tensor((rows, 37), torch.float32)
    with torch_pallas.backend("interpret"):
        check_matmul(a, random_tensor((37, 29), torch.float32))


@pytest.mark.parametrize("b_transposed", [False, True], ids=["w", "w.t()"])
def test_matmul_one_row_float32(b_transposed):
    """A single row (a decode step's product), which the interpret backend
    compiles with Eigen's dot (kernels/tpu/matmul.py compiler_options):
    exact to float32, as a vector and as a (1, K) matrix."""
    assert tpu_matmul.compiler_options(
        "interpret", (((1, 1, 37), "float32"), ((1, 37, 29), "float32")),
        {"transpose_a": False, "transpose_b": False}) == tpu_matmul.EIGEN_DOT
    b = random_tensor((29, 37), torch.float32).t() if b_transposed \
        else random_tensor((37, 29), torch.float32)
    with torch_pallas.backend("interpret"):
        check_matmul(random_tensor((1, 37), torch.float32), b)
        check_matmul(random_tensor((37,), torch.float32), b)


SIXTEEN_BIT = [torch.bfloat16, torch.float16]
LAYOUTS = {  # a, b (M, K, N) -> operands in that layout
    "a @ b": lambda a, b: (a, b),
    "a @ b.T": lambda a, b: (a, b.mT.contiguous().mT),
    "a.T @ b": lambda a, b: (a.mT.contiguous().mT, b),
    "a.T @ b.T": lambda a, b: (a.mT.contiguous().mT, b.mT.contiguous().mT),
    "batch @ b": lambda a, b: (torch.stack([a, a.flip(0)]), b),
}


def _kernel_hlo(a3, b3, params):
    """The interpret backend's matmul kernel for these 3-D operands, compiled
    as the op compiles it (config and XLA options): its HLO."""
    import functools

    import jax

    avals = tuple((tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in (a3, b3))
    config = tpu_matmul.KERNEL.config("interpret", avals, params)
    entry = functools.partial(tpu_matmul.matmul, **params, config=config, interpret=True,
                              num_cores=1)
    shapes = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in avals]
    options = tpu_matmul.KERNEL.options("interpret", avals, params)
    return jax.jit(entry).lower(*shapes).compile(options).as_text()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=str)
def test_matmul_16bit_on_onednn(dtype, layout):
    """16-bit products large enough for oneDNN (kernels/tpu/matmul.py
    cpu_library) in every layout: the dot yields the 16-bit dtype, within
    the float32-accumulation bound of the float64 reference, and XLA hands it
    to oneDNN where this CPU has the instructions."""
    m, k, n = (70, 301, 65) if layout == "a.T @ b" else (520, 530, 515)  # ragged; X^T @ dY from 64 rows
    a, b = LAYOUTS[layout](random_tensor((m, k), dtype), random_tensor((k, n), dtype))
    with torch_pallas.backend("interpret"):
        check_matmul(a, b)
    a3, transpose_a = as_kernel_operand(a.reshape(-1, m, k), a.shape[:-2])
    b3, transpose_b = as_kernel_operand(b.reshape(1, k, n), a.shape[:-2])
    params = {"transpose_a": transpose_a, "transpose_b": transpose_b}
    avals = tuple((tuple(t.shape), str(dtype).removeprefix("torch.")) for t in (a3, b3))
    name = avals[0][1]
    if not tpu_matmul.cpu_has_16bit_instructions(name):
        assert tpu_matmul.cpu_library("interpret", avals, params) is None
        pytest.skip(f"needs a CPU with {tpu_matmul._CPU_FLAGS[name]} (hardware)")
    # With the instructions (Linux x86 jaxlib wheels carry oneDNN), XLA must take it.
    assert tpu_matmul.onednn_takes_16bit(name)
    assert tpu_matmul.cpu_library("interpret", avals, params) == "onednn_16bit"
    assert "__onednn_fusion" in _kernel_hlo(a3, b3, params)


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=str)
def test_matmul_16bit_below_onednn_limits_or_without_it(dtype, monkeypatch):
    """Below the limits, or on a CPU whose XLA gives oneDNN no 16-bit dot,
    a 16-bit product keeps XLA's default (YNNPACK, or its float32 Eigen
    fallback) and the float32-accumulated dot: still within the bound."""
    name = str(dtype).removeprefix("torch.")
    square = lambda size: (((1, size, size), name), ((1, size, size), name))  # noqa: E731
    plain = {"transpose_a": False, "transpose_b": False}
    monkeypatch.setattr(tpu_matmul, "onednn_takes_16bit", lambda dtype: True)
    assert tpu_matmul.ONEDNN_16BIT_MIN_FLOPS == 2 * 500**3  # the boundary
    assert tpu_matmul.cpu_library("interpret", square(499), plain) is None
    assert tpu_matmul.cpu_library("interpret", square(500), plain) == "onednn_16bit"
    transposed = {"transpose_a": True, "transpose_b": False}
    assert tpu_matmul.cpu_library("interpret", (((1, 9, 63), name), ((1, 9, 5), name)),
                                  transposed) is None
    assert tpu_matmul.cpu_library("interpret", (((1, 9, 64), name), ((1, 9, 5), name)),
                                  transposed) == "onednn_16bit"
    assert tpu_matmul.cpu_library("tpu", square(2048), plain) is None
    monkeypatch.setattr(tpu_matmul, "onednn_takes_16bit", lambda dtype: False)
    assert tpu_matmul.select_config("interpret", square(2048), plain).dot_in_output_dtype is False
    compile_cache.clear()
    try:
        with torch_pallas.backend("interpret"):
            a = random_tensor((530, 520), dtype)
            check_matmul(a.mT, random_tensor((530, 515), dtype))  # X^T @ dY, above the limits
            check_matmul(a, random_tensor((520, 517), dtype))
    finally:
        compile_cache.clear()


@pytest.mark.parametrize("transposes", [(False, False), (True, False), (False, True), (True, True)])
def test_one_block_on_refs_equals_the_pallas_call(transposes):
    """Under JAX's generic interpreter the one-block matmul kernel runs on
    JAX refs (kernels/gridless.py), not through pallas_call: the same
    kernel, bit for bit the same results (ragged sizes, a broadcast
    batch), and an XLA computation without pallas_call's grid loop."""
    import functools

    import jax
    import numpy as np
    from jax.experimental import pallas as pl

    from torch_pallas.kernels import gridless

    transpose_a, transpose_b = transposes
    batch, m, k, n = 3, 37, 29, 23
    a = random_tensor((1, k, m) if transpose_a else (1, m, k), torch.float32).numpy()
    b = random_tensor((batch, n, k) if transpose_b else (batch, k, n), torch.float32).numpy()
    kernel = functools.partial(tpu_matmul.one_block_kernel, transpose_a=transpose_a,
                               transpose_b=transpose_b)
    out_shape = jax.ShapeDtypeStruct((batch, m, n), np.float32)
    on_refs = jax.jit(lambda x, y: gridless.call(kernel, out_shape, x, y, interpret=True))
    through_pallas = jax.jit(lambda x, y: pl.pallas_call(kernel, out_shape=out_shape,
                                                         interpret=True)(x, y))
    expected = np.asarray(through_pallas(a, b))
    np.testing.assert_array_equal(np.asarray(on_refs(a, b)), expected)
    ref = matmul_op.reference(torch.from_numpy(a.transpose(0, 2, 1) if transpose_a else a),
                              torch.from_numpy(b.transpose(0, 2, 1) if transpose_b else b))
    torch.testing.assert_close(torch.from_numpy(expected).double(), ref, rtol=1e-5, atol=1e-5)
    if gridless._REFS:
        assert "while" not in on_refs.lower(a, b).as_text()
        assert "while" in through_pallas.lower(a, b).as_text()


def test_unknown_compiler_options_fall_back(monkeypatch):
    """An XLA that does not know a kernel's options compiles without them."""
    options = {"xla_cpu_no_such_option_here": True}
    unknown = dataclasses.replace(tpu_matmul.KERNEL, compiler_options=lambda *args: options)
    monkeypatch.setattr(tpu_matmul, "KERNEL", unknown)
    monkeypatch.setitem(registry._loaded, tpu_matmul.__name__, unknown)  # if loaded already
    compile_cache.clear()
    try:
        with torch_pallas.backend("interpret"):
            check_matmul(random_tensor((11, 7), torch.float32), random_tensor((7, 5), torch.float32))
    finally:
        compile_cache.clear()


@pytest.fixture
def float32_matmul_precision():
    """Sets torch's float32 matmul precision for one test, then restores it."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


def test_float32_precision_follows_torch(cpu_backend, float32_matmul_precision):
    """'highest' asks the kernels for full float32, 'high'/'medium' allow
    TF32 (and get their own compiled kernels); on the CPU backends both are
    exact to float32."""
    for setting, expected in (("highest", "ieee"), ("high", "tf32"), ("medium", "tf32")):
        float32_matmul_precision(setting)
        assert matmul_op.float32_precision() == expected
        check_matmul(random_tensor((37, 70), torch.float32), random_tensor((70, 29), torch.float32))


def test_float32_precision_follows_torchs_newer_settings():
    """torch.backends.cuda.matmul.fp32_precision, or the global
    torch.backends.fp32_precision it inherits ('none'), after which torch's
    older getter raises."""
    cuda_before, global_before = (torch.backends.cuda.matmul.fp32_precision,
                                  torch.backends.fp32_precision)
    # PyTorch's test utilities (the OpInfo samples) freeze torch.backends.
    mutable = getattr(torch.backends, "__allow_nonbracketed_mutation")
    with mutable():
        check_newer_settings(cuda_before, global_before)


def check_newer_settings(cuda_before, global_before):
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        assert matmul_op.float32_precision() == "tf32"
        check_matmul(random_tensor((9, 70), torch.float32), random_tensor((70, 5), torch.float32))
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        assert matmul_op.float32_precision() == "ieee"
        torch.backends.cuda.matmul.fp32_precision = "none"
        torch.backends.fp32_precision = "tf32"
        assert matmul_op.float32_precision() == "tf32"
    finally:
        torch.backends.fp32_precision = global_before
        torch.backends.cuda.matmul.fp32_precision = cuda_before


def test_tensor_cores_refuse_full_float32_clearly(float32_matmul_precision):
    """mosaic_gpu multiplies float32 only as TF32: at 'highest' an automatic
    choice of it falls back to Triton, an explicit one raises, naming why."""
    avals = (((1, 8, 8), "float32"), ((1, 8, 8), "float32"))
    kernel = mosaic_matmul.KERNEL
    reason = kernel.refusal("mosaic_gpu", avals, {"precision": "ieee"})
    assert "TF32" in reason and "fp32_precision = 'tf32'" in reason
    assert kernel.refusal("mosaic_gpu", avals, {"precision": "tf32"}) is None
    assert kernel.refusal("mosaic_gpu_interpret", avals, {"precision": "ieee"}) is None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mosaic_gpu = backends.get("mosaic_gpu")
    assert backends.fall_back(device, "pallas::matmul", mosaic_gpu, reason).name == "triton"
    with torch_pallas.backend("mosaic_gpu"):
        with pytest.raises(backends.BackendError, match="pallas::matmul: backend 'mosaic_gpu' .*TF32"):
            backends.fall_back(device, "pallas::matmul", mosaic_gpu, reason)


def test_matmul_strided_operands():
    a = random_tensor((64, 40), torch.float32)
    b = random_tensor((70, 40), torch.float32)
    check_matmul(a[::2], b.t()[:, 1::3])
    check_matmul(a[:, ::2], b[::2, :20].t())


def test_transposed_operands_reach_the_kernel_without_a_copy():
    w = random_tensor((50, 70), torch.float32)
    operand, transposed = as_kernel_operand(w.t(), batch=())
    assert transposed and operand.data_ptr() == w.data_ptr()
    assert shares_memory(operand, bridge.to_jax(operand))
    x = random_tensor((4, 6, 70), torch.float32)
    operand, transposed = as_kernel_operand(x.mT, batch=(4,))
    assert transposed and operand.data_ptr() == x.data_ptr()


def test_matmul_mixed_and_unsupported_dtypes_raise():
    with pytest.raises(TypeError, match="pallas::matmul: a and b must have the same dtype"):
        torch.ops.pallas.matmul(torch.randn(2, 3), torch.randn(3, 2, dtype=torch.float16))
    with pytest.raises(TypeError, match="pallas::matmul: a has dtype torch.float64"):
        torch.ops.pallas.matmul(torch.randn(2, 3).double(), torch.randn(3, 2).double())
    with pytest.raises(TypeError, match="torch.int32, which is not supported"):
        torch.ops.pallas.matmul(torch.ones(2, 3, dtype=torch.int32), torch.ones(3, 2, dtype=torch.int32))


@pytest.mark.parametrize(
    "a_shape,b_shape",
    [((0, 5), (5, 3)), ((4, 0), (0, 3)), ((4, 5), (5, 0)), ((0, 4, 5), (5, 3)), ((2, 4, 0), (0,))],
    ids=str,
)
def test_matmul_empty_dimensions(a_shape, b_shape):
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    out = torch.ops.pallas.matmul(a, b)
    expected = torch.matmul(a, b)
    assert out.shape == expected.shape
    assert torch.equal(out, expected)  # K = 0: an empty sum, zeros


def test_matmul_gradients_match_torch():
    a = torch.randn(37, 19, dtype=torch.float32, requires_grad=True)
    b = torch.randn(19, 23, dtype=torch.float32, requires_grad=True)
    grad = torch.randn(37, 23)
    torch.ops.pallas.matmul(a, b).backward(grad)
    ga, gb = a.grad, b.grad
    a.grad = b.grad = None
    (a @ b).backward(grad)
    torch.testing.assert_close(ga, a.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb, b.grad, rtol=1e-5, atol=1e-5)


EMPTY_GRADIENTS = [  # K = 0 or N = 0, with and without a batch on b
    ((4, 0), (0, 3)), ((0,), (0,)), ((0,), (0, 3)), ((4, 0), (0,)), ((2, 4, 0), (0, 3)),
    ((4, 5), (5, 0)), ((2, 4, 5), (5, 0)), ((5,), (5, 0)), ((3, 2, 0), (3, 0, 4)),
]


@pytest.mark.parametrize("a_shape,b_shape", SEMANTICS + EMPTY_GRADIENTS, ids=str)
def test_matmul_gradients_reduce_broadcast_dimensions(a_shape, b_shape):
    a = torch.randn(a_shape, requires_grad=True)
    b = torch.randn(b_shape, requires_grad=True)
    out = torch.ops.pallas.matmul(a, b)
    grad = torch.randn(out.shape)
    ga, gb = torch.autograd.grad(out, (a, b), grad)
    ea, eb = torch.autograd.grad(torch.matmul(a, b), (a, b), grad)
    torch.testing.assert_close(ga, ea, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gb, eb, rtol=1e-5, atol=1e-5)


def test_matmul_gradient_only_where_needed():
    a = torch.randn(8, 5, requires_grad=True)
    b = torch.randn(5, 6)  # no grad: its gradient is never computed
    torch.ops.pallas.matmul(a, b).sum().backward()
    torch.testing.assert_close(a.grad, torch.ones(8, 6) @ b.t())
    assert b.grad is None


def test_matmul_wrapper_is_the_op():
    a, b = torch.randn(9, 4), torch.randn(4, 2)
    assert torch.equal(torch_pallas.matmul(a, b), torch.ops.pallas.matmul(a, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_casts_like_torch_matmul(dtype):
    a, b = torch.randn(16, 12), torch.randn(12, 8)
    with torch.autocast("cpu", dtype=dtype):
        out = torch.ops.pallas.matmul(a, b)
        expected = torch.matmul(a, b)
    assert out.dtype == expected.dtype == dtype
    ref = matmul_op.reference(a.to(dtype), b.to(dtype))
    assert_within(out, ref, matmul_op.error_bound(a.to(dtype), b.to(dtype), ref))


def test_autocast_gradients_flow_to_float32_leaves():
    a = torch.randn(16, 12, requires_grad=True)
    b = torch.randn(12, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.ops.pallas.matmul(a, b).float().sum().backward()
    assert a.grad.dtype == torch.float32
    torch.testing.assert_close(a.grad, torch.ones(16, 8) @ b.detach().t(), rtol=2e-2, atol=2e-2)


def test_compile_dynamic_serves_new_sizes_without_recompiling():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    w = torch.randn(24, 16)

    @torch.compile(backend=counter, dynamic=True, fullgraph=True)
    def f(x):
        return torch.ops.pallas.matmul(x, w.t()).relu()

    torch._dynamo.reset()
    # (Sizes 0 and 1 are specialised by torch.compile itself, for any op.)
    for batch, seq in [(2, 5), (3, 7), (4, 9), (6, 11)]:
        x = torch.randn(batch, seq, 16)
        torch.testing.assert_close(f(x), (x @ w.t()).relu(), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


@pytest.mark.parametrize("k, block, expected", [
    (128256, 4096, 768),  # Llama 3's vocabulary as K (linear_cross_entropy's d_input)
    (32000, 4096, 3200),  # fitted_block's own: a divisor down to half the block
    (8192, 4096, 4096),
    (1792, 4096, 1792),   # one block
    (4000, 4096, 4096),   # one block, K rounded up to the lanes
    (128 * 167, 1024, 1024),  # K / 128 prime: no divisor down to 256, padded
])
def test_chip_k_blocks_divide_k_where_they_can(k, block, expected):
    assert tpu_matmul.k_block(k, block) == expected


def test_chip_config_pads_no_operand_of_a_vocabulary_sized_k():
    """v5e: dz (256 x 128256) @ W (128256 x 4096) in 4096-deep blocks would
    copy W into 131072 rows at each call; its K block divides 128256."""
    v5e = types.SimpleNamespace(device_kind="TPU v5 lite")
    plain = dict(transpose_a=False, transpose_b=False)

    def config(m, k, n):
        avals = (((1, m, k), "bfloat16"), ((1, k, n), "bfloat16"))
        return tpu_matmul.chip_config(avals, plain, v5e)

    vocabulary = config(256, 128256, 4096)
    assert 128256 % vocabulary.block_k == 0 and vocabulary.block_k >= 512, vocabulary
    square = config(4096, 4096, 4096)
    assert (square.block_m, square.block_n, square.block_k) == (1024, 1024, 4096), square
