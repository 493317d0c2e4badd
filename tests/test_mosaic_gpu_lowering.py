"""The Mosaic GPU kernels lowered for a Hopper GPU (sm_90a), with no GPU.

`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` with
`interpret=None` runs everything Mosaic GPU checks before the CUDA compiler:
the Pallas lowering, wgmma operand dtypes, layouts and transposes (float32
is TF32 there and must be K-major), TMA and SMEM transforms, warpgroup
layout inference, the 227 KiB shared-memory budget and the MLIR verifier.
The simulator (`mosaic_gpu_interpret`) checks the values and none of these;
together they cover what can be known of the hardware path on a CPU.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import pytest
import torch

from helpers import kernel_calls
from torch_pallas.kernels.mosaic_gpu import add, fill, iota, matmul, matmul_tuning
from torch_pallas.kernels.mosaic_gpu.matmul_warp_specialized import WarpSpecializedConfig
from torch_pallas.runtime import backends, registry

H100 = "NVIDIA H100 80GB HBM3"
H100_SMS = 132
DTYPES = ("float32", "bfloat16", "float16", "int32")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def lower_for_hopper(f, *avals) -> str:
    """The StableHLO of `f` lowered for a Hopper GPU."""
    text = jax.jit(f).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
    # The custom call itself: the module's locations name this file and
    # test_mosaic_gpu_pallas_call.py, which would match "mosaic_gpu" anywhere
    # (a Triton kernel lowered from there did).
    assert "custom_call @mosaic_gpu" in text, "no Mosaic GPU kernel in the lowered module"
    return text


def aval(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


H100_DEVICE = types.SimpleNamespace(device_kind=H100, core_count=H100_SMS)


@pytest.mark.parametrize("info", registry.ops(), ids=lambda info: info.name)
def test_every_op_lowers_as_its_examples_call_it(info, tmp_path, monkeypatch):
    """Each registered op's Mosaic GPU kernel, for the calls its examples
    make where torch allows TF32, with the config the mosaic_gpu backend
    picks on an H100; calls the hardware kernel still refuses fall back to
    Triton on a GPU and are skipped."""
    monkeypatch.setenv("TORCH_PALLAS_CACHE_DIR", str(tmp_path))  # no tuned configs
    spec = info.kernel(backends.get("mosaic_gpu"))
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32, the Tensor Cores' float32
    try:
        calls = kernel_calls(info)
    finally:
        torch.set_float32_matmul_precision(precision)
    lowered = 0
    for avals, params in calls:
        if spec.refusal("mosaic_gpu", avals, params) is not None:
            continue
        config = spec.config("mosaic_gpu", avals, params, H100_DEVICE)
        lower_for_hopper(lambda *a: spec.run(*a, **params, config=config, interpret=None),
                         *[aval(shape, dtype) for shape, dtype in avals])
        lowered += 1
    assert lowered, f"{info.name}: no example call lowered"


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_kernels_lower(dtype):
    for shape in ((1000,), (64, 4096)):
        lower_for_hopper(lambda s=shape: fill.fill(
            s, 3, dtype, config=fill.KERNEL.default_config("mosaic_gpu"), interpret=None))
    for n in (1000, 1 << 20):
        lower_for_hopper(lambda n=n: iota.iota(
            n, dtype, config=iota.KERNEL.default_config("mosaic_gpu"), interpret=None))
    for x_shape, y_shape in (((1000,), (1000,)), ((3, 999), (999,))):
        out_shape = jnp.broadcast_shapes(x_shape, y_shape)
        lower_for_hopper(
            lambda x, y, o=out_shape: add.add(
                x, y, o, config=add.KERNEL.default_config("mosaic_gpu"), interpret=None),
            aval(x_shape, dtype), aval(y_shape, dtype))


def lower_matmul(dtype, config, a_shape, b_shape, transpose_a=False, transpose_b=False) -> str:
    if isinstance(config, WarpSpecializedConfig):  # persistent: one program per SM of an H100
        config = dataclasses.replace(config, num_programs=H100_SMS)
    precision = {"precision": "tf32"} if dtype == "float32" else {}
    return lower_for_hopper(
        lambda a, b: matmul.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b,
                                   config=config, interpret=None, **precision),
        aval(a_shape, dtype), aval(b_shape, dtype))


MATMUL_SHAPES = [  # (batch of a, M, N, K, batch of b)
    (1, 1000, 999, 1001, 1),
    (1, 128, 4096, 4096, 1),
    (4, 256, 384, 512, 1),
    (3, 200, 136, 72, 3),
    (1, 200, 136, 72, 3),  # one A against a batch of B
]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("ba,m,n,k,bb", MATMUL_SHAPES, ids=str)
def test_matmul_kernels_lower(dtype, ba, m, n, k, bb):
    """The quickstart kernel, the shipped and the generic warp-specialized
    configurations, with the operands as given and transposed in memory
    (read in place by wgmma, except a transposed float32 A)."""
    configs = [matmul.KERNEL.default_config("mosaic_gpu"), matmul_tuning.GENERIC_DEFAULT,
               matmul_tuning.shipped_default(H100, dtype, m, n, k)]
    for config in filter(None, configs):
        lower_matmul(dtype, config, (ba, m, k), (bb, k, n))
        lower_matmul(dtype, config, (ba, k, m), (bb, n, k), transpose_a=True, transpose_b=True)
        lower_matmul(dtype, config, (ba, k, m), (bb, k, n), transpose_a=True)


@pytest.mark.exhaustive  # minutes; the shipped configurations lower in the default run
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_every_tunable_matmul_config_lowers(dtype):
    """Whatever the tuner may pick (matmul_tuning.candidates) fits the
    hardware, not only the simulator."""
    for config in matmul_tuning.candidates(dtype):
        lower_matmul(dtype, config, (1, 1000, 4100), (1, 4100, 1500))
        lower_matmul(dtype, config, (1, 4100, 1000), (1, 1500, 4100),
                     transpose_a=True, transpose_b=True)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_operands_are_copied_only_where_wgmma_cannot_read_them(dtype):
    """No transpose outside the kernel for 16-bit operands, whichever way
    they lie; float32 (TF32, K-major only) copies B when it is (K, N) and A
    when it is (K, M)."""
    config = matmul_tuning.GENERIC_DEFAULT
    as_given = lower_matmul(dtype, config, (1, 300, 200), (1, 200, 100))
    transposed = lower_matmul(dtype, config, (1, 200, 300), (1, 100, 200),
                              transpose_a=True, transpose_b=True)
    copies = 1 if dtype == "float32" else 0
    assert as_given.count("stablehlo.transpose") == copies
    assert transposed.count("stablehlo.transpose") == copies


def test_full_float32_is_refused_on_the_tensor_cores():
    with pytest.raises(ValueError, match="TF32 only"):
        lower_for_hopper(
            lambda a, b: matmul.matmul(a, b, transpose_a=False, transpose_b=False,
                                       config=matmul_tuning.GENERIC_DEFAULT, interpret=None,
                                       precision="ieee"),
            aval((1, 64, 64), "float32"), aval((1, 64, 64), "float32"))


def test_warp_specialized_matmul_needs_the_sm_count():
    """The persistent grid's size comes from the config (select_config sets
    it from the GPU), never from whichever device JAX lists first."""
    with pytest.raises(ValueError, match="num_programs=None"):
        lower_for_hopper(
            lambda a, b: matmul.matmul(a, b, transpose_a=False, transpose_b=False,
                                       config=matmul_tuning.GENERIC_DEFAULT, interpret=None),
            aval((1, 64, 64), "bfloat16"), aval((1, 64, 64), "bfloat16"))
