"""Race detection in the simulators: the seed's planted race is caught, the
shipped kernels are clean."""

from __future__ import annotations

import functools

import pytest
import torch

import torch_pallas
from torch_pallas.base import jax_env
from torch_pallas.kernels.tpu import cores
from torch_pallas.runtime import registry


def test_tpu_interpret_catches_the_seed_fill_42_race():
    # The Pallas TPU quickstart's fill_42 on two TensorCores: both cores
    # write the whole output, the redundancy the quickstart warns about.
    jax = jax_env.jax()
    jnp = jax.numpy
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    jax_env.simulate_tpu_on_cpu()

    @functools.partial(
        pl.kernel,
        out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
        mesh=cores.tensorcore_mesh(jax_env.SIMULATED_TPU_CORES),
        scratch_types=dict(o_vmem=pltpu.VMEM((128,), jnp.float32)),
        interpret=jax_env.tpu_interpret_params(detect_races=True),
    )
    def fill_42(o_ref, o_vmem):
        o_vmem[...] = jnp.full_like(o_vmem, 42.0)
        pltpu.sync_copy(o_vmem, o_ref)

    assert (fill_42() == 42.0).all()
    assert jax_env.races_found("tpu")


def test_mosaic_gpu_interpret_catches_a_planted_smem_race():
    # Two warpgroups of one block write the same SMEM buffer with no barrier.
    jax = jax_env.jax()
    jnp = jax.numpy
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @functools.partial(
        plgpu.kernel,
        out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
        scratch_types=dict(smem=plgpu.SMEM((128,), jnp.float32)),
        num_threads=2,
        thread_name="wg",
        interpret=jax_env.gpu_interpret_params(detect_races=True),
    )
    def racy(o_ref, smem):
        wg = jax.lax.axis_index("wg").astype(jnp.float32)
        smem[...] = jnp.full((128,), 1.0, jnp.float32) + wg
        o_ref[...] = smem[...]

    racy()
    assert jax_env.races_found("mosaic_gpu")


@pytest.mark.parametrize("fenced", [False, True], ids=["unfenced", "commit_smem"])
def test_mosaic_gpu_detector_on_a_pipeline_body_that_reads_its_slots(fenced):
    """What JAX's detector says of kernels/mosaic_gpu/add.py's form: an
    emit_pipeline body that reads its input slots with plain loads, after
    which the pipeline refills each slot by TMA (4 steps, 2 slots). The one
    pair flagged is that read and that TMA write, both of the one warpgroup:
    on the hardware the warpgroup barrier Mosaic GPU puts before each copy
    orders the threads, but only a proxy fence (commit_smem) orders plain
    loads before an async-proxy write under PTX's memory model, which JAX
    0.11 on's detector follows and 0.10's does not. Fenced, the form is
    clean on every version (add.py fences)."""
    jax = jax_env.jax()
    jnp = jax.numpy
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    steps, rows = 4, 32
    x = jnp.arange(steps * rows * 128, dtype=jnp.float32).reshape(steps * rows, 128)

    def kernel(x_gmem, o_gmem):
        def body(indices, x_smem):
            (step,) = indices
            o_gmem[pl.ds(step * rows, rows), :] = x_smem[...] + 1
            if fenced:
                plgpu.commit_smem()

        spec = plgpu.BlockSpec((rows, 128), lambda step: (step, 0))
        plgpu.emit_pipeline(body, grid=(steps,), in_specs=[spec], max_concurrent_steps=2)(x_gmem)

    out = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                       interpret=jax_env.gpu_interpret_params(detect_races=True))(x)
    assert (out == x + 1).all()
    assert jax_env.races_found("mosaic_gpu") == (not fenced and jax_env.gpu_races_follow_proxies())


@pytest.mark.parametrize("name", ["tpu_interpret", "mosaic_gpu_interpret"])
def test_shipped_kernels_have_no_races(name):
    with torch_pallas.backend(name), torch_pallas.race_detection():
        torch.ops.pallas.fill((3, 700), 2.0, dtype=torch.float32)
        torch.ops.pallas.iota(3000, dtype=torch.int32)
        torch.ops.pallas.add(torch.randn(70, 300), torch.randn(300))
        torch.ops.pallas.matmul(torch.randn(130, 70), torch.randn(70, 150))
        # Pipelines that refill slots their bodies read with plain loads
        # (more steps than slots: kernels/mosaic_gpu/fences.py)
        torch.ops.pallas.swiglu(torch.randn(70, 300), torch.randn(70, 300))
        torch_pallas.layer_norm(torch.randn(70, 300), (300,))
        x, w = torch.randn(70, 700, requires_grad=True), torch.rand(700, requires_grad=True)
        torch_pallas.rms_norm(x, (700,), w, casting_mode="llama").sum().backward()
        torch_pallas.linear_cross_entropy(torch.randn(70, 64), torch.randn(300, 64),
                                          torch.randint(0, 300, (70,)))
        rotary = registry.get("rotary_embedding").examples("cpu", False)[0]
        torch.ops.pallas.rotary_embedding(*rotary.args, **rotary.kwargs)


def test_a_flagged_kernel_raises(monkeypatch):
    monkeypatch.setattr(jax_env, "races_found", lambda family: True)
    with torch_pallas.backend("tpu_interpret"), torch_pallas.race_detection():
        with pytest.raises(torch_pallas.RaceDetectedError, match="pallas::add.*data race"):
            torch.ops.pallas.add(torch.randn(8), torch.randn(8))
    # Without detection on, the detector's state is not consulted.
    with torch_pallas.backend("tpu_interpret"):
        torch.ops.pallas.add(torch.randn(8), torch.randn(8))
