"""pallas::fill against torch.full on every CPU backend."""

from __future__ import annotations

import re

import math
import random

import pytest
import torch

import torch_pallas

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32)
SIZES = [(1,), (7,), (1000,), (3, 1001), (2, 3, 5), (64, 128)]


def random_value(dtype):
    if dtype.is_floating_point:
        return random.uniform(-1e3, 1e3)
    return random.randint(-(2**31), 2**31 - 1)


@pytest.fixture(autouse=True)
def _seed_python_random(request):
    random.seed(request.node.nodeid)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_fill_matches_torch_full(cpu_backend, size, dtype):
    value = random_value(dtype)
    out = torch.ops.pallas.fill(size, value, dtype=dtype)
    assert torch.equal(out, torch.full(size, value, dtype=dtype))


@pytest.mark.parametrize("value,dtype", [(3, torch.int64), (2.5, None), (-1.5, torch.float64)])
def test_fill_default_and_64_bit_dtypes_like_torch_full(value, dtype):
    out = torch.ops.pallas.fill((4, 3), value, dtype=dtype)
    expected = torch.full((4, 3), value, dtype=dtype)
    assert out.dtype == expected.dtype
    assert torch.equal(out, expected)


def test_fill_converts_like_torch_full():
    # A float value into an int dtype truncates toward zero, as in torch.
    assert torch.equal(
        torch.ops.pallas.fill((5,), -2.7, dtype=torch.int32),
        torch.full((5,), -2.7, dtype=torch.int32),
    )
    assert torch.ops.pallas.fill((3,), float("nan"), dtype=torch.float32).isnan().all()


@pytest.mark.parametrize(
    "value,dtype,words",
    [
        (2**40, torch.int64, "does not fit the int32"),
        (0.1, torch.float64, "not exactly representable"),
        (True, None, "torch.bool"),
        (1 + 2j, torch.float32, "real number"),
    ],
)
def test_fill_refuses_what_it_cannot_do_exactly(value, dtype, words):
    with pytest.raises((TypeError, ValueError), match=words) as info:
        torch.ops.pallas.fill((3,), value, dtype=dtype)
    assert "pallas::fill" in str(info.value)


def test_fill_wrapper_accepts_an_int_size():
    out = torch_pallas.fill(6, 1.25)
    assert torch.equal(out, torch.full((6,), 1.25))


def test_fill_empty_and_device():
    out = torch.ops.pallas.fill((0, 4), 1.0, device="cpu")
    assert out.shape == (0, 4) and out.device.type == "cpu"


def test_signed_zeros_and_nan_each_get_their_own_kernel():
    """-0.0 == 0.0 and nan != nan: the compiled-kernel cache keys floats by
    their bits, so neither shares nor misses a kernel wrongly."""
    from torch_pallas.runtime import compile_cache

    for first, second in ((0.0, -0.0), (-0.0, 0.0)):
        torch_pallas.clear_cache()
        assert torch.equal(torch.ops.pallas.fill((3,), first).signbit(), torch.full((3,), first).signbit())
        assert torch.equal(torch.ops.pallas.fill((3,), second).signbit(), torch.full((3,), second).signbit())
    torch.ops.pallas.fill((5,), float("nan"))
    builds = compile_cache.compiled.builds
    for _ in range(3):
        assert torch.ops.pallas.fill((5,), float("nan")).isnan().all()
    assert compile_cache.compiled.builds == builds


def cuda_machine(monkeypatch, *, built=True, count=1, current=0):
    """Makes torch look built with CUDA and see `count` GPUs, `current` the
    current one: only the device checks ask (no kernel runs in these tests)."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: built)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def test_a_cuda_device_without_index_means_the_current_one(monkeypatch):
    from torch_pallas.ops import checks

    cuda_machine(monkeypatch, count=4, current=3)
    assert checks.factory_device("pallas::fill", "cuda") == torch.device("cuda", 3)
    assert checks.factory_device("pallas::fill", "cuda:1") == torch.device("cuda", 1)
    assert checks.factory_device("pallas::fill", "cpu") == torch.device("cpu")


@pytest.mark.parametrize("op", ["fill", "iota"])
def test_a_cuda_device_that_cannot_be_used_is_refused_like_torch(monkeypatch, op):
    """torch.full raises AssertionError on a torch built without CUDA and
    RuntimeError for a GPU it does not see; the ops raise the same types,
    naming themselves, the device and what exists, before any kernel."""
    def call(device):
        if op == "fill":
            return torch.ops.pallas.fill((2, 3), random.uniform(-9, 9), device=device)
        return torch.ops.pallas.iota(random.randint(1, 99), device=device)

    index = random.randint(0, 7)
    cuda_machine(monkeypatch, built=False)
    with pytest.raises(AssertionError, match=f"pallas::{op}: device=cuda:{index} .*not compiled with CUDA"):
        call(f"cuda:{index}")
    cuda_machine(monkeypatch, count=0)
    with pytest.raises(RuntimeError, match=f"pallas::{op}: device=cuda .*sees no CUDA GPU"):
        call("cuda")
    count = random.randint(1, 4)
    cuda_machine(monkeypatch, count=count)
    missing = count + random.randint(0, 3)
    with pytest.raises(RuntimeError, match=f"pallas::{op}: device=cuda:{missing} does not exist; "
                       f"torch sees {count} CUDA GPU.*cuda:{count - 1}$"):
        call(f"cuda:{missing}")


def test_a_cuda_fake_is_traced_without_asking_the_machine(monkeypatch):
    """Tracing (fake tensors, as torch.compile and export use) may target a
    GPU this machine lacks, as torch.full's own fake may; the CUDA index left
    out is the one FakeTensor picks."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cuda_machine(monkeypatch, built=False)
    with FakeTensorMode():
        out = torch.ops.pallas.fill((2, 3), 1.5, device="cuda")
        expected = torch.full((2, 3), 1.5, device="cuda")
    assert out.device == expected.device and out.shape == (2, 3)


def test_bad_sizes_are_refused_like_torch_full():
    """A negative size is a RuntimeError and a float one a TypeError, as in
    torch.full; each message names the op, the position and the value."""
    negative = -random.randint(1, 10**6)
    size = (random.randint(1, 9), negative)
    with pytest.raises(RuntimeError) as torch_error:
        torch.full(size, 1.0)
    with pytest.raises(type(torch_error.value), match=rf"pallas::fill: size\[1\] must be >= 0, got {negative}"):
        torch.ops.pallas.fill(size, 1.0)
    fractional = random.randint(1, 9) + 0.5
    with pytest.raises(TypeError):
        torch.full((fractional,), 1.0)
    with pytest.raises(TypeError, match=rf"pallas::fill: size\[0\] must be an int, got {fractional}"):
        torch_pallas.fill((fractional, 3), 1.0)


def test_values_torch_full_refuses_raise_its_type(monkeypatch):
    """A value past the dtype's range (or a NaN or infinity for an int
    dtype) raises what torch.full raises for it, a RuntimeError (a ValueError
    too, as before), naming the op, the value and the dtype."""
    from torch_pallas.runtime import launch

    monkeypatch.setattr(launch, "run", lambda *a, **k: pytest.fail("a kernel was reached"))
    sign = random.choice((-1, 1))
    cases = [
        (sign * (2**31 + random.randint(0, 2**20)), torch.int32),
        (sign * random.uniform(65520, 1e6), torch.float16),
        (sign * random.uniform(3.5e38, 1e300), torch.float32),
        (random.choice((math.inf, -math.inf, math.nan)), torch.int64),
        (2**63 + random.randint(0, 99), torch.int64),  # (below -2**63, the dispatcher refuses the Scalar first)
    ]
    for value, dtype in cases:
        with pytest.raises(RuntimeError) as torch_error:
            torch.full((3,), value, dtype=dtype)
        with pytest.raises(type(torch_error.value)) as info:
            torch.ops.pallas.fill((3,), value, dtype=dtype)
        assert isinstance(info.value, ValueError)
        assert f"pallas::fill: value {value!r} cannot be converted to {dtype}" in str(info.value)


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64, torch.int16, torch.uint8])
def test_an_unsupported_dtype_is_named_as_the_argument(dtype):
    value = True if dtype == torch.bool else random.randint(1, 100)
    with pytest.raises(TypeError, match=f"^pallas::fill: dtype={dtype} is not supported; supported: float32, "):
        torch.ops.pallas.fill((2, 3), value, dtype=dtype)


EDGE_VALUES = {
    # A finite value past the dtype's range raises in torch (for sizes past
    # one element: torch's one-element path skips the check); infinities
    # and -0.0 are kept; 16-bit floats are rounded through float32 first.
    torch.float32: [-0.0, 1e300, -3.5e38, float("-inf")],
    torch.float16: [-0.0, 1 + 2**-11 + 2**-40, 65504.0, 65519.0, 2**31, 3e-8, float("inf")],
    torch.bfloat16: [-0.0, 1 + 2**-8 + 2**-40, 3.38e38, 3.4e38, 70000.0, -1e300],
}


@pytest.mark.parametrize("dtype", list(EDGE_VALUES))
def test_fill_edge_values_like_torch_full(cpu_backend, dtype):
    for value in EDGE_VALUES[dtype]:
        try:
            expected = torch.full((2,), value, dtype=dtype)
        except RuntimeError:
            with pytest.raises(RuntimeError, match="pallas::fill: value .* without overflow"):
                torch.ops.pallas.fill((2,), value, dtype=dtype)
            continue
        out = torch.ops.pallas.fill((2,), value, dtype=dtype)
        assert torch.equal(out, expected), (value, out, expected)
        assert torch.equal(out.signbit(), expected.signbit()), value


def test_negative_zero_is_negated_exactly_in_compiled_code():
    """The kernel's -0.0 (NEGATE) compiles, for a Hopper GPU, to a sign flip
    of every float dtype it writes, never to `0 - x` (Triton 3.6's unary
    minus: +0.0 for +0.0; the interpreter's too, which
    test_fill_edge_values_like_torch_full catches)."""
    import triton_builds  # triton comes with the test extra

    result = triton_builds.run_subprocess(None, check="fill_negative_zero", timeout=600)
    assert not result["failures"] and not result["record_errors"], result
    negating = [row for row in result["kernels"]
                if row["kernel"] == "fill_kernel" and row["constexprs"].get("NEGATE")]
    # every dtype's -0.0 launched one (float64 writes through float32's)
    assert sorted(dtype for row in negating for _, dtype in row["cases"]) == [
        "bfloat16", "float16", "float32", "float64"], result["kernels"]
    built = {row["dtype"]: row["ptx_arithmetic"] for row in negating}
    for dtype, ops in built.items():
        assert not any(op.startswith("sub.") for op in ops), (dtype, ops)
        # a sign flip: the sign bit's xor, a negation or a float product by -1
        assert any(re.match(r"(xor\.b|neg\.b?f|mul(\.rn)?\.b?f)", op) for op in ops), (dtype, ops)
