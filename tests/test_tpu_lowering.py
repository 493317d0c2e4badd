"""The Pallas TPU kernels lowered for a TPU (a v5p-like chip, 2 TensorCores),
with no TPU: every primitive they use has a Mosaic TPU lowering and the
kernels become Mosaic custom calls. Block tilings and vector layouts are
checked later, by Mosaic's compiler in the TPU runtime, which is not here;
the TPU simulator (`tpu_interpret`) checks the values and the races."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from torch_pallas.kernels.tpu import add, fill, iota, matmul
from torch_pallas.base import jax_env
from torch_pallas.runtime import backends, registry
from helpers import kernel_calls

CORES = 2


@pytest.fixture(autouse=True, scope="module")
def tpu_info():
    jax_env.simulate_tpu_on_cpu()  # the chip's description, for the pipelines


def lower_for_tpu(f, *avals):
    text = jax.jit(f).trace(*avals).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text, "no Mosaic TPU kernel in the lowered module"


def aval(shape, dtype):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


@pytest.mark.parametrize("info", registry.ops(), ids=lambda info: info.name)
def test_every_op_lowers_as_its_examples_call_it(info):
    """Each registered op's TPU kernel, for the calls its examples make, with
    its TPU config, on both TensorCores."""
    spec = info.kernel(backends.get("tpu_interpret"))  # the TPU family's kernel
    calls = kernel_calls(info)
    for avals, params in calls:
        config = spec.config("tpu", avals, params)
        lower_for_tpu(lambda *a: spec.run(*a, **params, config=config, num_cores=CORES,
                                          interpret=None),
                      *[aval(shape, dtype) for shape, dtype in avals])
    assert calls, f"{info.name}: its examples made no kernel call"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int32"])
def test_block_kernels_lower(dtype):
    lower_for_tpu(lambda: fill.fill((37, 1001), 3, dtype, config=fill.FillConfig.default("tpu"),
                                    num_cores=CORES, interpret=None))
    lower_for_tpu(lambda: iota.iota(100_001, dtype, config=iota.IotaConfig.default("tpu"),
                                    num_cores=CORES, interpret=None))
    lower_for_tpu(
        lambda x, y: add.add(x, y, (3, 1000, 999), config=add.AddConfig.default("tpu"),
                             num_cores=CORES, interpret=None),
        aval((3, 1000, 999), dtype), aval((999,), dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
def test_matmul_lowers(dtype, transpose_a, transpose_b):
    a_shape = (3, 999, 1000) if transpose_a else (3, 1000, 999)
    b_shape = (1, 1001, 999) if transpose_b else (1, 999, 1001)
    lower_for_tpu(
        lambda a, b: matmul.matmul(a, b, transpose_a=transpose_a, transpose_b=transpose_b,
                                   config=matmul.KERNEL.default_config("tpu"), num_cores=CORES,
                                   interpret=None),
        aval(a_shape, dtype), aval(b_shape, dtype))
