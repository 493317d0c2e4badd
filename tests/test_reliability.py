"""Reliability inside long jobs: bad input is refused clearly before any
kernel runs, failures leave the process healthy, threads, memory,
determinism."""

from __future__ import annotations

import concurrent.futures
import resource

import pytest
import torch

import torch_pallas
from torch_pallas.runtime import backends, compile_cache, launch, registry
from helpers import CPU_BACKENDS, SLOW_ON_SIMULATORS

P = torch.ops.pallas
f32 = dict(dtype=torch.float32)


def cuda_device_inputs():
    """A CUDA device this machine cannot give a factory op: the exception
    type torch.full raises for it (AssertionError where torch is built
    without CUDA, RuntimeError where it sees no GPU or not that index),
    named by the op."""
    if not torch.backends.cuda.is_built():
        return [
            (lambda: P.fill((2, 3), 1.0, device="cuda"), AssertionError,
             ["pallas::fill", "device=cuda", "not compiled with CUDA"]),
            (lambda: torch_pallas.iota(4, device="cuda:7"), AssertionError,
             ["pallas::iota", "device=cuda:7", "not compiled with CUDA"]),
        ]
    count = torch.cuda.device_count()
    if count == 0:
        return [(lambda: P.fill((2, 3), 1.0, device="cuda"), RuntimeError,
                 ["pallas::fill", "device=cuda", "sees no CUDA GPU"])]
    return [
        (lambda: P.fill((2, 3), 1.0, device=f"cuda:{count}"), RuntimeError,
         ["pallas::fill", f"device=cuda:{count} does not exist", f"cuda:{count - 1}"]),
        (lambda: P.iota(4, device=f"cuda:{count + 6}"), RuntimeError,
         ["pallas::iota", f"device=cuda:{count + 6} does not exist"]),
    ]


CUDA_DEVICE_INPUTS = cuda_device_inputs()

# (call, exception type, words the message must contain)
BAD_INPUTS = [
    # Shapes and devices torch refuses too raise torch's RuntimeError (also a
    # ValueError, the type they had before: test_shape_and_device_errors_stay_value_errors).
    (lambda: P.matmul(torch.tensor(1.0), torch.randn(3)), RuntimeError,
     ["pallas::matmul", "a must have at least 1 dimension", "a.shape=()"]),
    (lambda: P.matmul(torch.randn(4, 3), torch.randn(4, 5)), RuntimeError,
     ["pallas::matmul", "inner dimensions", "(4, 3)", "(4, 5)"]),
    (lambda: P.matmul(torch.randn(2, 4, 3), torch.randn(5, 3, 2)), RuntimeError,
     ["pallas::matmul", "batch dimensions", "(2, 4, 3)", "(5, 3, 2)"]),
    (lambda: P.matmul(torch.randn(2, 3), torch.randn(3, 2).half()), TypeError,
     ["pallas::matmul", "same dtype", "torch.float32", "torch.float16"]),
    (lambda: P.matmul(torch.randn(2, 3).double(), torch.randn(3, 2).double()), TypeError,
     ["pallas::matmul", "a", "torch.float64", "not supported"]),
    (lambda: P.matmul(torch.ones(2, 3, dtype=torch.bool), torch.ones(3, 2, dtype=torch.bool)),
     TypeError, ["pallas::matmul", "torch.bool"]),
    (lambda: P.matmul(torch.randn(2, 3, dtype=torch.complex64), torch.randn(3, 2, dtype=torch.complex64)),
     TypeError, ["pallas::matmul", "torch.complex64"]),
    (lambda: P.matmul(torch.randn(2, 3), torch.randn(3, 2, device="meta")), RuntimeError,
     ["pallas::matmul", "same device", "cpu", "meta"]),
    # (the torch dispatcher itself names the op, argument and type here)
    (lambda: P.matmul(torch.randn(2, 3), "b"), RuntimeError, ["pallas::matmul", "argument 'b'", "str"]),
    (lambda: P.matmul(torch.eye(3).to_sparse(), torch.randn(3, 2)), TypeError,
     ["pallas::matmul", "a", "dense", "torch.sparse_coo"]),
    (lambda: P.add(torch.randn(3), torch.randn(3).to_sparse()), TypeError,
     ["pallas::add", "y", "dense", "torch.sparse_coo"]),
    (lambda: P.add(torch.randn(3, 4), torch.randn(5)), RuntimeError,
     ["pallas::add", "(3, 4)", "(5,)", "broadcast"]),
    (lambda: P.add(torch.randn(3), torch.randn(3).bfloat16()), TypeError,
     ["pallas::add", "same dtype", "torch.bfloat16"]),
    (lambda: P.add(torch.ones(3, dtype=torch.int64), torch.ones(3, dtype=torch.int64)), TypeError,
     ["pallas::add", "torch.int64", "not supported"]),
    (lambda: P.add(torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.bool)), TypeError,
     ["pallas::add", "torch.bool"]),
    (lambda: P.add(torch.randn(3), torch.randn(3, device="meta")), RuntimeError,
     ["pallas::add", "same device", "meta"]),
    # A negative size: RuntimeError, as torch.full((3, -1), 1.0) raises.
    (lambda: P.fill((3, -1), 1.0), RuntimeError, ["pallas::fill", "size[1] must be >= 0", "-1"]),
    # A float size: torch's dispatcher refuses it for the op (RuntimeError,
    # naming the op, the argument and the value); the Python functions check
    # first and raise TypeError, as torch.full((2.5,), 1.0) does.
    (lambda: P.fill((2.5,), 1.0), RuntimeError, ["pallas::fill()", "argument 'size'", "(2.5,)"]),
    (lambda: torch_pallas.fill((3, 2.5), 1.0), TypeError, ["pallas::fill", "size[1] must be an int", "2.5"]),
    (lambda: P.fill((2, 3), True, dtype=torch.bool), TypeError,
     ["pallas::fill: dtype=torch.bool is not supported", "supported: float32"]),
    (lambda: P.fill((3,), 1.0, dtype=torch.complex64), TypeError,
     ["pallas::fill: dtype=torch.complex64 is not supported"]),
    (lambda: P.fill((3,), 2**40, dtype=torch.int64), ValueError, ["pallas::fill", "int32", str(2**40)]),
    # Past the dtype's range: RuntimeError, as torch.full raises.
    (lambda: P.fill((3,), -1e39, dtype=torch.float32), RuntimeError,
     ["pallas::fill", "value -1e+39", "torch.float32", "overflow"]),
    (lambda: P.fill((3,), 2**31, dtype=torch.int32), RuntimeError,
     ["pallas::fill", f"value {2**31}", "torch.int32", "overflow"]),
    (lambda: P.fill((3,), float("-inf"), dtype=torch.int64), RuntimeError,
     ["pallas::fill: value -inf cannot be converted to torch.int64"]),
    (lambda: P.iota(-4), RuntimeError, ["pallas::iota", "n must be >= 0", "-4"]),
    (lambda: P.iota(2**31), RuntimeError, ["pallas::iota", str(2**31), "int32"]),
    (lambda: P.iota(5, dtype=torch.bool), TypeError, ["pallas::iota: dtype=torch.bool is not supported"]),
    (lambda: torch_pallas.iota(2.5), TypeError, ["pallas::iota", "n must be an int", "2.5"]),
    *CUDA_DEVICE_INPUTS,
]


@pytest.mark.parametrize("call,error,words", BAD_INPUTS, ids=[str(i) for i in range(len(BAD_INPUTS))])
def test_bad_input_is_refused_clearly_before_any_kernel(monkeypatch, call, error, words):
    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel was reached")

    monkeypatch.setattr(launch, "run", no_kernel)  # every op calls its kernel through it
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


def test_shape_and_device_errors_stay_value_errors():
    """The checks whose type changed to torch's RuntimeError still raise a
    ValueError, so `except ValueError` written for them keeps working."""
    calls = [
        lambda: P.matmul(torch.tensor(1.0), torch.randn(3)),
        lambda: P.add(torch.randn(3, 4), torch.randn(5)),
        lambda: P.add(torch.randn(3), torch.randn(3, device="meta")),
        lambda: P.fill((3,), 1e39, dtype=torch.float16),
        lambda: P.fill((3,), float("nan"), dtype=torch.int32),
    ]
    for call in calls:
        with pytest.raises(ValueError) as info:
            call()
        assert isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("name", ["mosaic_gpu", "triton"])
def test_a_backend_that_cannot_serve_the_device_is_named(monkeypatch, name):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with torch_pallas.backend(name), pytest.raises(torch_pallas.BackendError, match=name):
        P.matmul(torch.randn(2, 3), torch.randn(3, 2))


def test_nan_and_inf_propagate_like_torch(cpu_backend):
    x = torch.tensor([[1.0, float("nan")], [float("inf"), -2.0]])
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    torch.testing.assert_close(P.add(x, w), x + w, equal_nan=True)
    out, expected = P.matmul(x, w), x @ w
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(out[~out.isnan()], expected[~expected.isnan()])


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last),
        lambda: torch.randn(4, 6, 8)[:, ::2].transpose(0, 1),
        lambda: torch.randn(1, 1, 8).expand(3, 8, 8),
        lambda: torch.randn(100)[3:67].view(8, 8),
    ],
    ids=["channels_last", "strided_batch_view", "expanded_batch", "offset_view"],
)
def test_awkward_layouts_give_right_results(make):
    x = make()
    w = torch.randn(8, 5)
    torch.testing.assert_close(P.matmul(x, w), x @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(P.add(x, x[..., :1]), x + x[..., :1])


def out_of_bounds_kernel():
    """A Mosaic GPU `add` kernel that reads past its input's edge, which
    Mosaic GPU interpret mode reports by raising inside the simulated kernel."""
    import jax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from torch_pallas.kernels.mosaic_gpu import add as real_add
    from torch_pallas.kernels.spec import KernelSpec

    def add(x, y, out_shape, *, config, interpret):
        def body(x_gmem, o_gmem):
            # x holds fewer. A traced start (0 here): JAX 0.12 refuses a
            # constant slice past the edge when tracing, before any simulation.
            start = jax.lax.axis_index("p")
            o_gmem[...] = x_gmem[pl.ds(start, 256)]

        return plgpu.kernel(
            body, out_type=jax.ShapeDtypeStruct((256,), x.dtype), grid=(1,), grid_names=("p",),
            interpret=interpret,
        )(x.reshape(-1))

    return KernelSpec(run=add, default_config=real_add.KERNEL.default_config)


def test_a_failed_simulated_kernel_leaves_the_process_healthy(monkeypatch):
    """After a simulated kernel fails, the simulator's state is reset (the
    failure leaves it allocated) and the next calls succeed."""
    from torch_pallas.base import jax_env
    from torch_pallas.runtime import registry

    module = registry.get("add").kernels["mosaic_gpu"]
    real_kernel = registry.get("add").kernel(torch_pallas.BACKENDS["mosaic_gpu_interpret"])
    monkeypatch.setitem(registry._loaded, module, out_of_bounds_kernel())
    x, y = torch.randn(300, 7), torch.randn(7)
    try:
        with torch_pallas.backend("mosaic_gpu_interpret"):
            with pytest.raises(Exception, match="Out-of-bounds read"):
                P.add(torch.randn(77), torch.randn(77))
            assert jax_env._gpu_callbacks()._shared_memory is None  # reset
            registry._loaded[module] = real_kernel
            torch.testing.assert_close(P.add(x, y), x + y)
            torch.testing.assert_close(P.matmul(x.t(), x), x.t() @ x, rtol=1e-4, atol=1e-4)
    finally:
        compile_cache.clear()


def test_threads_get_right_results_and_compile_each_kernel_once():
    compile_cache.clear()
    builds = compile_cache.compiled.builds
    shapes = [(5 + i % 4, 9, 3 + i % 3) for i in range(64)]

    def work(shape):
        m, k, n = shape
        a, b = torch.randn(m, k), torch.randn(k, n)
        x = torch.randn(m, n)
        out = P.add(P.matmul(a, b), x)
        return torch.allclose(out, a @ b + x, rtol=1e-5, atol=1e-5)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, shapes))
    distinct = {(m, n) for m, _, n in shapes}
    # one matmul and one add kernel per distinct shape, however many threads
    assert compile_cache.compiled.builds - builds == 2 * len(distinct)


def test_threads_on_a_simulator_serialise_safely():
    def work(i):
        x, y = torch.randn(50 + i), torch.randn(50 + i)
        with torch_pallas.backend("tpu_interpret"):
            return torch.equal(P.add(x, y), x + y)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(8)))


@pytest.mark.parametrize("backend", ["tpu_interpret", "mosaic_gpu_interpret"])
def test_a_simulated_kernel_compiles_its_cores_bodies_once(backend):
    """The simulators run each simulated core or thread as a compiled body;
    JAX would compile it anew on every call (jax_env.
    compile_simulated_threads_once). Later calls on fresh data build
    nothing, and give the right results."""
    from torch_pallas.base import jax_env

    n = 1000 + len(backend)  # a size no other test here builds
    with torch_pallas.backend(backend):
        x, y = torch.randn(n), torch.randn(n)
        torch.testing.assert_close(P.add(x, y), x + y, rtol=0, atol=0)
        bodies = dict(jax_env._simulated_bodies)
        assert bodies, "no simulated body was compiled through jax_env"
        for _ in range(2):
            x, y = torch.randn(n), torch.randn(n)
            torch.testing.assert_close(P.add(x, y), x + y, rtol=0, atol=0)
    assert all(jax_env._simulated_bodies.get(k) is v for k, v in bodies.items())
    assert len(jax_env._simulated_bodies) == len(bodies)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def test_many_calls_do_not_grow_memory():
    shapes = [(3 + i, 17) for i in range(25)]
    for _ in range(2):  # warm up: compile every shape, settle allocators
        for shape in shapes:
            P.add(torch.randn(shape), torch.randn(17))
    before = rss_mib()
    for i in range(5000):
        shape = shapes[i % len(shapes)]
        P.add(torch.randn(shape), torch.randn(17))
    grown = rss_mib() - before
    assert grown < 20, f"resident memory grew by {grown:.1f} MiB over 5000 calls"


def test_compile_cache_size_is_bounded():
    assert compile_cache.compiled.max_entries == compile_cache.MAX_ENTRIES


# The slow ops on the simulators take a minute here: with -m exhaustive.
DETERMINISM_CASES = [
    pytest.param(backend, info, id=f"{backend}-{info.name}", marks=[pytest.mark.exhaustive] if (
        backends.get(backend).simulated and info.name in SLOW_ON_SIMULATORS) else [])
    for backend in CPU_BACKENDS for info in registry.ops()
]


@pytest.mark.parametrize("backend,info", DETERMINISM_CASES)
def test_every_op_is_deterministic(backend, info):
    """The same inputs give bitwise identical outputs, call after call."""
    with torch_pallas.backend(backend):
        for example in info.examples(torch.device("cpu"), False):
            first = info.overload(*example.args, **example.kwargs)
            again = info.overload(*example.args, **example.kwargs)
            if isinstance(first, torch.Tensor):
                first, again = (first,), (again,)
            assert all(torch.equal(a, b) for a, b in zip(first, again)), info.name
