"""pallas::fill against torch.full on every CPU backend."""

from __future__ import annotations

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
    from torch_pallas import compile_cache

    for first, second in ((0.0, -0.0), (-0.0, 0.0)):
        torch_pallas.clear_cache()
        assert torch.equal(torch.ops.pallas.fill((3,), first).signbit(), torch.full((3,), first).signbit())
        assert torch.equal(torch.ops.pallas.fill((3,), second).signbit(), torch.full((3,), second).signbit())
    torch.ops.pallas.fill((5,), float("nan"))
    builds = compile_cache.compiled.builds
    for _ in range(3):
        assert torch.ops.pallas.fill((5,), float("nan")).isnan().all()
    assert compile_cache.compiled.builds == builds


def test_a_cuda_device_without_index_means_the_current_one(monkeypatch):
    from torch_pallas.ops import checks

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert checks.factory_device("cuda") == torch.device("cuda", 3)
    assert checks.factory_device("cuda:1") == torch.device("cuda", 1)
    assert checks.factory_device("cpu") == torch.device("cpu")


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
            with pytest.raises(ValueError, match="pallas::fill: value .* without overflow"):
                torch.ops.pallas.fill((2,), value, dtype=dtype)
            continue
        out = torch.ops.pallas.fill((2,), value, dtype=dtype)
        assert torch.equal(out, expected), (value, out, expected)
        assert torch.equal(out.signbit(), expected.signbit()), value
